"""Benchmark: output tokens/s of the built-in engine against HF `generate` in padded static batches.

Same model, same workload (the zoo's stress mix: prompts of ~8..470 tokens, max_tokens 4..128),
greedy with ignore_eos so both produce exactly the same number of tokens, float32, in one run.
Each engine runs in its own process through `lpf run`; process and model start-up are measured by
the same command on a 1-token workload and subtracted, so the ratio compares generation only.
Where vLLM's venv exists (`make vllm`, see lpf.adapters.vllm), vLLM (offline `vllm.LLM`, the `vllm`
adapter) joins the table with the builtin engine's knobs (max_num_seqs 64, max_num_batched_tokens 512,
chunked prefill on, prefix caching off, one torch thread). Its start-up is 20-60 s and too noisy to
subtract, so its generation time is the in-engine window instead: first request submitted to vLLM to
last request finished (the worker's own t_submit/t_finish, stored in the run's requests table).
The same window is recorded for HF and builtin as a cross-check of the two measures. Without the
venv the vLLM column is skipped, and the bench says so. Where llama.cpp is built (`make llamacpp`),
llama.cpp's llama-server (the `llamacpp` adapter: lpf converts the model to an f32 GGUF, cached, and
starts the server) joins like HF and builtin (start-up subtracted, the 1-token run includes the server
start): 16 parallel slots of 768 tokens, 32 requests in flight, one thread, flash attention off (the
adapter's float32 default), `-E ban_eos=true` (llama-server's ignore_eos bans EOS where the others
generate past it, so its outputs match the others' only up to the first EOS: counted so).

Prefix caching (`prefix_caching` in the results; `--only prefix` runs just this part and keeps the
rest of engine.json): the built-in engine on zoo:shared-prefix (400 requests, greedy, 16 output
tokens) with and without `--enable-prefix-caching`, same knobs, interleaved repeats. Reported: the
prompt tokens the engine computed (prefill and extend rows of the trace) and the tokens the cache
supplied (its hit tokens), the fraction saved, the in-engine window and the generation time (wall
minus the same start-up subtraction), each as a ratio to the run without caching.
`--quick` is the smoke run `make test` does (nothing timed is asserted, no results file): 6 requests
of at most 8 tokens, one run each, start-up not subtracted, no vLLM or llama.cpp column and no
prefix-caching rows (bench/vllm_trace.py --quick runs the vllm adapter).
`--baseline-src DIR` (a checkout's src/) runs that tree's builtin engine as a `builtin-before` arm in the
same interleaved repeats (before/after in one run); every run's CPU seconds are recorded (a run's minus
its 1-token run's: `generation_cpu_s`, blind to other processes; vLLM's worker processes count only
once reaped), and each repeat's builtin/vLLM in-engine window ratio (the two ran back to back).
Speculative decoding (`speculative` in the results; `--only spec` runs just this part, see `speculative`):
acceptance rate and speed-up of -E speculative=ngram:K and draft:zoo:llama:K against the same engine without it.
Usage: python bench/engine.py [--requests N] [--model SPEC] [--only prefix|spec] [--no-prefix] [--baseline-src DIR]
       [--quick]   (writes bench/results/engine.json)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# CPU seconds of every finished `lpf run` (user + system, its worker processes included once reaped),
# keyed by its --out directory: blind to the other engineers' processes that share the cores
CPU_S: dict[str, float] = {}


def lpf_run(
    engine: str, model: str, workload: Path, out: Path, extra: list[str], max_tokens: int = 128, src: Path | None = None
) -> float:
    """Wall seconds of one `lpf run` (its CPU seconds go to CPU_S); `src`: another tree's `src` on
    PYTHONPATH (the --baseline-src arm: the same engine as another commit has it)."""
    exe = Path(sys.executable).with_name("lpf")
    # one intra-op thread for both: at these model sizes more threads only add scheduling overhead,
    # and the builtin engine defaults to 1
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if src is not None:
        env["PYTHONPATH"] = str(src)
    t0 = time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [
            str(exe),
            "run",
            "--engine",
            engine,
            "--model",
            model,
            "--workload",
            str(workload),
            "--out",
            str(out),
            "--ignore-eos",
            "--max-tokens",
            str(max_tokens),
            "--part-size",
            "100000",
            *extra,
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_S[str(out)] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return time.perf_counter() - t0


def in_engine_window(out: Path) -> float:
    """Seconds from the first request submitted to the engine to the last one finished (engine clocks)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    req = pq.read_table(out / "requests")
    errors = [e for e in req.column("error").to_pylist() if e]
    if errors:
        sys.exit(f"{out.name}: {len(errors)} request(s) failed, first: {errors[0]}")
    return pc.max(req.column("t_finish")).as_py() - pc.min(req.column("t_submit")).as_py()


def spec_counts(out: Path) -> dict:
    """A run's engine steps, drafted and accepted tokens (when it speculated) and outputs in arrival order."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    tr = pq.read_table(out / "trace")
    got = {"engine_steps": int(pc.max(tr.column("step")).as_py())}
    if "num_draft_tokens" in tr.column_names:
        got["drafted"] = int(pc.sum(tr.column("num_draft_tokens")).as_py() or 0)
        got["accepted"] = int(pc.sum(tr.column("num_accepted_tokens")).as_py() or 0)
    got["outputs"] = pq.read_table(out / "requests").sort_by("seq").column("output_token_ids").to_pylist()
    return got


def vllm_args() -> tuple[list[str] | None, str]:
    """`lpf run` arguments for the vLLM column, or None and why it is skipped."""
    from lpf.adapters.vllm import vllm_python
    from lpf.core.errors import LpfError

    try:
        python = vllm_python()
    except LpfError as e:
        return None, str(e)
    # the builtin engine's knobs under vLLM's names; prefix caching off because the builtin engine has none
    return (
        [
            "--dtype",
            "float32",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "512",
            "--enable-chunked-prefill",
            "-E",
            "enable_prefix_caching=false",
        ],
        str(python),
    )


def prefix_caching(model: str, tmp: Path, repeats: int, base: float) -> dict:
    """The with/without prefix caching rows on zoo:shared-prefix (see the module docstring)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    exe = Path(sys.executable).with_name("lpf")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    knobs = ["--max-num-seqs", "64", "--max-num-batched-tokens", "64", "--max-tokens", "16", "--cache-mb", "16"]
    arms = {"off": [], "on": ["--enable-prefix-caching"]}
    rows: dict[str, dict] = {arm: {"seconds": [], "window_s": []} for arm in arms}
    for rep in range(repeats):
        for arm, extra in arms.items():
            out = tmp / f"prefix-{arm}-{rep}"
            t0 = time.perf_counter()
            subprocess.run(
                [
                    str(exe),
                    "run",
                    "--engine",
                    "builtin",
                    "--model",
                    model,
                    "--workload",
                    "zoo:shared-prefix",
                    "--out",
                    str(out),
                    *knobs,
                    *extra,
                ],
                check=True,
                capture_output=True,
                text=True,
                env=env,
            )
            rows[arm]["seconds"].append(time.perf_counter() - t0 - base)
            rows[arm]["window_s"].append(in_engine_window(out))
            if rep == 0:
                tr = pq.read_table(out / "trace")
                prefill = tr.filter(pc.is_in(tr.column("phase"), value_set=pa_strings(["prefill", "extend"])))
                rows[arm]["prompt_tokens_computed"] = int(pc.sum(prefill.column("num_scheduled_tokens")).as_py())
                rows[arm]["hit_tokens"] = int(pc.sum(tr.column("prefix_cache_hit_tokens").fill_null(0)).as_py() or 0)
                rows[arm]["engine_steps"] = int(pc.max(tr.column("step")).as_py())
                req = pq.read_table(out / "requests").sort_by("seq")
                rows[arm]["outputs"] = req.column("output_token_ids").to_pylist()
    same = sum(a == b for a, b in zip(rows["off"].pop("outputs"), rows["on"].pop("outputs")))
    for r in rows.values():
        r["median_seconds"], r["median_window_s"] = statistics.median(r["seconds"]), statistics.median(r["window_s"])
    off, on = rows["off"], rows["on"]
    return {
        "model": model,
        "workload": "zoo:shared-prefix",
        "knobs": knobs,
        "repeats": repeats,
        "arms": rows,
        "identical_greedy_outputs": same,
        "prefill_tokens_saved": off["prompt_tokens_computed"] - on["prompt_tokens_computed"],
        "prefill_saved_fraction": 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"],
        "time_ratio_on_vs_off": on["median_seconds"] / off["median_seconds"],
        "window_ratio_on_vs_off": on["median_window_s"] / off["median_window_s"],
        # the fastest repeat of each arm: the least disturbed by other processes on a shared machine
        "best_window_ratio_on_vs_off": min(on["window_s"]) / min(off["window_s"]),
        "steps_ratio_on_vs_off": on["engine_steps"] / off["engine_steps"],
    }


DRAFT = "zoo:llama"  # the draft model of the draft-model arms


def speculative(model: str, tmp: Path, repeats: int, base: float) -> dict:
    """Speculative decoding's rows (`--only spec`): the built-in engine on zoo:oracle (500 requests, greedy,
    24 output tokens; copies and recalls repeat their prompt, so n-gram drafts get accepted) without
    speculation, with -E speculative=ngram:2 / ngram:4 and with the draft model DRAFT (draft:zoo:llama:2 / :4;
    its load is part of the generation time, not of the in-engine window), same knobs, interleaved repeats.
    Reported per arm:
    drafted and accepted tokens (the trace's num_draft_tokens / num_accepted_tokens), the acceptance rate,
    engine steps, the in-engine window and generation time (wall minus start-up), each as a ratio to no
    speculation, and whether every request's greedy tokens equal the run without speculation."""

    exe = Path(sys.executable).with_name("lpf")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    knobs = ["--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--max-tokens", "24"]
    arms = {
        "off": [],
        **{f"ngram:{k}": ["-E", f"speculative=ngram:{k}"] for k in (2, 4)},
        # the draft-model proposer: zoo:llama (attention-only, the zoo's tokenizer) drafts for the hybrid
        **{f"draft:{DRAFT}:{k}": ["-E", f"speculative=draft:{DRAFT}:{k}"] for k in (2, 4)},
    }
    rows: dict[str, dict] = {arm: {"seconds": [], "window_s": []} for arm in arms}
    for rep in range(repeats):
        for arm, extra in arms.items():
            out = tmp / f"spec-{arm.replace(':', '')}-{rep}"
            t0 = time.perf_counter()
            subprocess.run(
                [str(exe), "run", "--engine", "builtin", "--model", model, "--workload", "zoo:oracle"]
                + ["--out", str(out), *knobs, *extra],
                check=True,
                capture_output=True,
                text=True,
                env=env,
            )
            rows[arm]["seconds"].append(time.perf_counter() - t0 - base)
            rows[arm]["window_s"].append(in_engine_window(out))
            if rep == 0:
                rows[arm].update(spec_counts(out))
                rows[arm]["output_tokens"] = sum(len(o) for o in rows[arm]["outputs"])
    plain = rows["off"]["outputs"]
    for r in rows.values():
        r["median_seconds"], r["median_window_s"] = statistics.median(r["seconds"]), statistics.median(r["window_s"])
        r["identical_greedy_outputs"] = sum(a == b for a, b in zip(plain, r["outputs"]))
        if "drafted" in r:
            r["acceptance_rate"] = r["accepted"] / r["drafted"] if r["drafted"] else None
        r["time_ratio_vs_off"] = r["median_seconds"] / rows["off"]["median_seconds"]
        r["window_ratio_vs_off"] = r["median_window_s"] / rows["off"]["median_window_s"]
        r["best_window_ratio_vs_off"] = min(r["window_s"]) / min(rows["off"]["window_s"])
        r["steps_ratio_vs_off"] = r["engine_steps"] / rows["off"]["engine_steps"]
    for r in rows.values():
        r.pop("outputs")
    return {
        "model": model,
        "workload": "zoo:oracle",
        "knobs": knobs,
        "repeats": repeats,
        "requests": len(plain),
        "arms": rows,
    }


def print_spec(p: dict) -> None:
    print(
        "\n| built-in engine on zoo:oracle | drafted | accepted | acceptance | engine steps | generation s (median) | "
        "in-engine window s (median) | vs no speculation | identical greedy outputs |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for arm, r in p["arms"].items():
        rate = r.get("acceptance_rate")
        print(
            f"| {arm} | {r.get('drafted', 0):,} | {r.get('accepted', 0):,} | "
            f"{'-' if rate is None else f'{rate:.1%}'} | {r['engine_steps']} | {r['median_seconds']:.1f} | "
            f"{r['median_window_s']:.1f} | {r['time_ratio_vs_off']:.2f}x time, {r['window_ratio_vs_off']:.2f}x window "
            f"(best {r['best_window_ratio_vs_off']:.2f}x), {r['steps_ratio_vs_off']:.2f}x steps | "
            f"{r['identical_greedy_outputs']}/{p['requests']} |"
        )
    print(f"{p['model']}, {' '.join(p['knobs'])}, median of {p['repeats']}")


def pa_strings(values):
    import pyarrow as pa

    return pa.array(values, pa.string())


def print_prefix(p: dict) -> None:
    off, on = p["arms"]["off"], p["arms"]["on"]
    print(
        "\n| built-in engine on zoo:shared-prefix | prompt tokens computed | supplied by the cache | engine steps | "
        "generation s (median) | in-engine window s (median) | vs no caching |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| prefix caching off | {off['prompt_tokens_computed']:,} | 0 | {off['engine_steps']} | "
        f"{off['median_seconds']:.1f} | {off['median_window_s']:.1f} | 1.00x |"
    )
    print(
        f"| prefix caching on | {on['prompt_tokens_computed']:,} | {on['hit_tokens']:,} | {on['engine_steps']} | "
        f"{on['median_seconds']:.1f} | {on['median_window_s']:.1f} | {p['time_ratio_on_vs_off']:.2f}x time, "
        f"{p['window_ratio_on_vs_off']:.2f}x window |"
    )
    print(
        f"best repeat's window {p['best_window_ratio_on_vs_off']:.2f}x, engine steps {p['steps_ratio_on_vs_off']:.2f}x"
    )
    print(
        f"\n{p['prefill_tokens_saved']:,} prefill tokens saved ({p['prefill_saved_fraction']:.1%}); identical greedy "
        f"outputs {p['identical_greedy_outputs']}/400; {p['model']}, {' '.join(p['knobs'])}, median of {p['repeats']}"
    )


def llamacpp_args() -> tuple[list[str] | None, str]:
    """`lpf run` arguments for the llama.cpp column, or None and why it is skipped."""
    from lpf.adapters.llamacpp_gguf import find_tools
    from lpf.core.errors import LpfError

    try:
        tools = find_tools()
    except LpfError as e:
        return None, str(e)
    return (["-E", "threads=1", "-E", "parallel=16", "-E", "ctx_size=12288", "-E", "ban_eos=true"], str(tools.server))


def same_until_eos(a: list[int], b: list[int], eos: int) -> bool:
    """Equal before the first EOS of either (llama.cpp with ban_eos never emits one)."""
    n = min((s.index(eos) if eos in s else len(s)) for s in (a, b))
    return a[:n] == b[:n]


def startup(engine: str, model: str, tmp: Path, extra: list[str], name: str | None = None, src=None) -> float:
    """Wall time of the same command on a 1-request, 1-token workload: process + model start-up."""
    name = name or engine
    w = tmp / f"one-{name}.jsonl"
    w.write_text(json.dumps({"prompt": "a", "max_tokens": 1}) + "\n")
    return lpf_run(engine, model, w, tmp / f"startup-{name}", extra, src=src)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine, interleaved; the median is reported")
    ap.add_argument(
        "--only", choices=["prefix", "spec"], default=None, help="run only the prefix-caching or speculative rows"
    )
    ap.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="another checkout's src/ (e.g. `git archive REV src | tar -x -C DIR`): its builtin engine runs "
        "as the `builtin-before` arm, interleaved with this one (before/after in one run)",
    )
    ap.add_argument("--no-prefix", action="store_true", help="skip the prefix-caching rows (keeps engine.json's)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="6 short requests, one run each, no start-up runs, no vLLM, llama.cpp or prefix rows (a smoke run)",
    )
    a = ap.parse_args()
    max_tokens = 8 if a.quick else 128
    if a.quick:
        a.requests, a.repeats = 6, 1
    import pyarrow.parquet as pq

    from lpf.zoo import registry

    model = a.model or ("zoo:hybrid" if registry.model_available("hybrid") else "tiny:hybrid")
    results_file = Path(__file__).with_name("results") / "engine.json"
    if a.only:  # one part's rows, the rest of engine.json kept
        part, key, show = {
            "spec": (speculative, "speculative", print_spec),
            "prefix": (prefix_caching, "prefix_caching", print_prefix),
        }[a.only]
        with tempfile.TemporaryDirectory() as tmp:
            base = startup("builtin", model, Path(tmp), [])
            p = part(model, Path(tmp), a.repeats, base)
        doc = json.loads(results_file.read_text()) if results_file.is_file() else {}
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        doc[key] = stamp({**p, "date": time.strftime("%Y-%m-%d")})
        results_file.parent.mkdir(exist_ok=True)
        results_file.write_text(json.dumps(doc, indent=2))
        show(p)
        return
    items = registry.workload_items("stress", seed=1, n=a.requests)
    engines = {"hf": ["-E", "batch_size=32"], "builtin": ["--max-num-seqs", "64", "--max-num-batched-tokens", "512"]}
    # arm name -> (engine, PYTHONPATH): the --baseline-src arm is the builtin engine from another tree
    srcs: dict[str, tuple[str, Path | None]] = {name: (name, None) for name in engines}
    if a.baseline_src is not None:
        if not (a.baseline_src / "lpf" / "builtin").is_dir():
            sys.exit(f"--baseline-src {a.baseline_src}: no lpf/builtin package there (give a checkout's src/)")
        engines["builtin-before"] = engines["builtin"]
        srcs["builtin-before"] = ("builtin", a.baseline_src.resolve())
    vllm_extra, vllm_where = vllm_args() if not a.quick else (None, "--quick (the vLLM benches' own --quick runs vLLM)")
    if vllm_extra is None:
        print(f"vLLM column skipped: {vllm_where}", file=sys.stderr)
    llama_extra, llama_where = llamacpp_args() if not a.quick else (None, "--quick")
    if llama_extra is None:
        print(f"llama.cpp column skipped: {llama_where}", file=sys.stderr)
    else:
        engines["llamacpp"] = llama_extra
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wl = tmp / "stress.jsonl"
        wl.write_text(
            "".join(
                json.dumps({"id": it["id"], "prompt": it["prompt"], "max_tokens": min(it["max_tokens"], max_tokens)})
                + "\n"
                for it in items
            )
        )
        times: dict[str, list[float]] = {name: [] for name in engines}
        if llama_extra is not None:  # the first run writes the GGUF (cached): start-up is the second one
            (tmp / "warm").mkdir()
            startup("llamacpp", model, tmp / "warm", llama_extra)
        base = {
            name: 0.0
            if a.quick
            else startup(srcs.get(name, (name,))[0], model, tmp, extra, name, srcs.get(name, (0, None))[1])
            for name, extra in engines.items()
        }
        windows: dict[str, list[float]] = {name: [] for name in [*engines, "vllm"]}
        if vllm_extra is not None:  # its wall start-up is too noisy to subtract; its CPU start-up is not
            startup("vllm", model, tmp, vllm_extra)
        vllm_walls: list[float] = []
        for rep in range(a.repeats):  # interleaved, so a noisy minute hurts both engines alike
            for name, extra in engines.items():
                out = tmp / f"{name}-{rep}"
                engine, src = srcs.get(name, (name, None))
                times[name].append(lpf_run(engine, model, wl, out, extra, max_tokens, src) - base[name])
                windows[name].append(in_engine_window(out))
            if vllm_extra is not None:
                out = tmp / f"vllm-{rep}"
                vllm_walls.append(lpf_run("vllm", model, wl, out, vllm_extra, max_tokens))
                windows["vllm"].append(in_engine_window(out))
        for name in engines:
            req = pq.read_table(tmp / f"{name}-0" / "requests")
            n_out = sum(len(x) for x in req.column("output_token_ids").to_pylist())
            secs = statistics.median(times[name])
            results[name] = {
                "seconds": secs,
                "all_seconds": times[name],
                "startup_s": base[name],
                "output_tokens": n_out,
                "tokens_per_s": n_out / secs,
                "in_engine_window_s": windows[name],
                "cpu_s": [CPU_S[str(tmp / f"{name}-{r}")] for r in range(a.repeats)],
                "startup_cpu_s": CPU_S.get(str(tmp / f"startup-{name}")),
            }
            print(
                f"{name:8s} {n_out} tokens, median {secs:.1f}s of {[round(t, 1) for t in times[name]]} "
                f"(+{base[name]:.1f}s start-up): {results[name]['tokens_per_s']:.0f} tok/s; in-engine window "
                f"{[round(t, 1) for t in windows[name]]}",
                file=sys.stderr,
            )
        hf_out = pq.read_table(tmp / "hf-0" / "requests").sort_by("seq").column("output_token_ids").to_pylist()
        bi_out = pq.read_table(tmp / "builtin-0" / "requests").sort_by("seq").column("output_token_ids").to_pylist()
        results["identical_greedy_outputs"] = sum(x == y for x, y in zip(hf_out, bi_out)) / len(hf_out)
        if llama_extra is not None:
            from lpf.core.model_specs import load_tokenizer, resolve_model

            eos = load_tokenizer(resolve_model(model)).eos_token_id
            lc_out = (
                pq.read_table(tmp / "llamacpp-0" / "requests").sort_by("seq").column("output_token_ids").to_pylist()
            )
            results["llamacpp"].update(
                server=llama_where,
                args=llama_extra,
                identical_until_eos_vs_builtin=sum(same_until_eos(x, y, eos) for x, y in zip(lc_out, bi_out)),
                of_requests=len(bi_out),
            )
        else:
            results["llamacpp"] = {"skipped": llama_where}
        if vllm_extra is not None:
            req = pq.read_table(tmp / "vllm-0" / "requests").sort_by("seq")
            vl_out = req.column("output_token_ids").to_pylist()
            n_out = sum(len(x) for x in vl_out)
            secs = statistics.median(windows["vllm"])
            version = json.loads((tmp / "vllm-0" / "manifest.json").read_text())["engine"].get("version")
            same = sum(x == y for x, y in zip(vl_out, bi_out)) if len(vl_out) == len(bi_out) else 0
            results["vllm"] = {
                "version": version,
                "python": vllm_where,
                "args": vllm_extra,
                "seconds": secs,
                "all_seconds": windows["vllm"],
                "measure": "in-engine window",
                "lpf_run_wall_s": vllm_walls,
                "cpu_s": [CPU_S[str(tmp / f"vllm-{r}")] for r in range(a.repeats)],
                "startup_cpu_s": CPU_S.get(str(tmp / "startup-vllm")),
                "output_tokens": n_out,
                "tokens_per_s": n_out / secs,
                "identical_greedy_vs_builtin": same,
                "of_requests": len(bi_out),
            }
            print(
                f"vllm     {n_out} tokens, median {secs:.1f}s of {[round(t, 1) for t in windows['vllm']]} "
                f"(in-engine window; whole `lpf run` {[round(t, 1) for t in vllm_walls]}): "
                f"{results['vllm']['tokens_per_s']:.0f} tok/s; greedy outputs identical to builtin: "
                f"{same}/{len(bi_out)}",
                file=sys.stderr,
            )
            # each repeat ran builtin then vLLM back to back: their window ratio is the least noisy pairing
            results["vllm"]["window_ratio_builtin_vs_vllm_per_repeat"] = [
                v / b for b, v in zip(windows["builtin"], windows["vllm"])
            ]
            if "builtin-before" in engines:
                results["vllm"]["window_ratio_builtin_before_vs_vllm_per_repeat"] = [
                    v / b for b, v in zip(windows["builtin-before"], windows["vllm"])
                ]
        else:
            results["vllm"] = {"skipped": vllm_where}
        if "builtin-before" in engines:
            bo = pq.read_table(tmp / "builtin-before-0" / "requests").sort_by("seq").column("output_token_ids")
            results["builtin-before"].update(
                src=str(a.baseline_src),
                identical_greedy_vs_builtin=sum(x == y for x, y in zip(bo.to_pylist(), bi_out)),
                of_requests=len(bi_out),
                window_ratio_after_vs_before_per_repeat=[
                    b / n for b, n in zip(windows["builtin-before"], windows["builtin"])
                ],
            )
        prefix = prefix_caching(model, tmp, a.repeats, base["builtin"]) if not (a.quick or a.no_prefix) else None
    ratio = results["builtin"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    out = {
        "model": model,
        "requests": a.requests,
        "ratio": ratio,
        "results": results,
        "date": time.strftime("%Y-%m-%d"),
        "prefix_caching": {**prefix, "date": time.strftime("%Y-%m-%d")} if prefix else None,
    }
    if a.no_prefix and results_file.is_file():  # the earlier run's rows stand, with their own date
        out["prefix_caching"] = json.loads(results_file.read_text()).get("prefix_caching")
    # generation CPU seconds: a run's CPU minus its 1-token run's (start-up), blind to other processes
    for r in results.values():
        if isinstance(r, dict) and r.get("cpu_s") and r.get("startup_cpu_s") is not None:
            r["generation_cpu_s"] = statistics.median(r["cpu_s"]) - r["startup_cpu_s"]
    has_vllm = "tokens_per_s" in results["vllm"]
    if has_vllm:
        out["ratio_vllm_vs_hf"] = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        out["ratio_builtin_vs_vllm"] = results["builtin"]["tokens_per_s"] / results["vllm"]["tokens_per_s"]
        out["window_ratio_builtin_vs_vllm_median_of_repeats"] = statistics.median(
            results["vllm"]["window_ratio_builtin_vs_vllm_per_repeat"]
        )
    if "builtin-before" in results:
        out["ratio_builtin_after_vs_before"] = (
            results["builtin"]["tokens_per_s"] / results["builtin-before"]["tokens_per_s"]
        )
        out["ratio_builtin_before_vs_hf"] = results["builtin-before"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        if has_vllm:
            out["ratio_builtin_before_vs_vllm"] = (
                results["builtin-before"]["tokens_per_s"] / results["vllm"]["tokens_per_s"]
            )
    has_llama = "tokens_per_s" in results["llamacpp"]
    if has_llama:
        out["ratio_llamacpp_vs_hf"] = results["llamacpp"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        out["ratio_llamacpp_vs_builtin"] = results["llamacpp"]["tokens_per_s"] / results["builtin"]["tokens_per_s"]
        if has_vllm:
            out["ratio_llamacpp_vs_vllm"] = results["llamacpp"]["tokens_per_s"] / results["vllm"]["tokens_per_s"]
    if not a.quick:
        results_file.parent.mkdir(exist_ok=True)
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        results_file.write_text(json.dumps(stamp(out), indent=2))
    vl = results["vllm"].get("tokens_per_s")
    col = (lambda tps: f" {tps / vl:.2f}x |") if has_vllm else (lambda tps: "")
    print("| engine | output tokens/s | vs HF generate |" + (" vs vLLM |" if has_vllm else ""))
    print("|---|---|---|" + ("---|" if has_vllm else ""))
    print(
        f"| HF generate (padded static batches of 32) | {results['hf']['tokens_per_s']:.0f} | 1.00x |"
        + col(results["hf"]["tokens_per_s"])
    )
    print(
        f"| lpf builtin (continuous batching) | {results['builtin']['tokens_per_s']:.0f} | {ratio:.2f}x |"
        + col(results["builtin"]["tokens_per_s"])
    )
    if "builtin-before" in results:
        bb = results["builtin-before"]["tokens_per_s"]
        print(
            f"| lpf builtin before ({a.baseline_src}) | {bb:.0f} | {out['ratio_builtin_before_vs_hf']:.2f}x |" + col(bb)
        )
    if has_vllm:
        print(
            f"| vLLM {results['vllm']['version']} CPU (offline LLM, chunked prefill) | {vl:.0f} | "
            f"{out['ratio_vllm_vs_hf']:.2f}x |" + col(vl)
        )
    if has_llama:
        lc = results["llamacpp"]["tokens_per_s"]
        print(
            f"| llama.cpp llama-server (16 slots, f32 GGUF) | {lc:.0f} | {out['ratio_llamacpp_vs_hf']:.2f}x |" + col(lc)
        )
    if not has_vllm:
        print(f"\n(vLLM column skipped: {results['vllm']['skipped']})")
    else:
        per = results["vllm"]["window_ratio_builtin_vs_vllm_per_repeat"]
        print(
            f"\nbuiltin vs vLLM on in-engine windows, each repeat's pair run back to back: "
            f"{', '.join(f'{x:.2f}x' for x in per)} (median {out['window_ratio_builtin_vs_vllm_median_of_repeats']:.2f}x)"
            + (
                "; builtin before: "
                + ", ".join(f"{x:.2f}x" for x in results["vllm"]["window_ratio_builtin_before_vs_vllm_per_repeat"])
                if "builtin-before" in results
                else ""
            )
        )
    cpu = {n: r["generation_cpu_s"] for n, r in results.items() if isinstance(r, dict) and "generation_cpu_s" in r}
    if cpu:
        print(
            "generation CPU seconds (run minus its 1-token run): " + ", ".join(f"{n} {c:.1f}" for n, c in cpu.items())
        )
    if not has_llama:
        print(f"\n(llama.cpp column skipped: {results['llamacpp']['skipped']})")
    print(
        f"\n{a.requests} requests of zoo:stress on {model}, float32, greedy, ignore_eos, median of {a.repeats} "
        f"interleaved runs; "
        f"identical greedy outputs: {results['identical_greedy_outputs']:.1%}"
        + (
            f"; vLLM's greedy outputs identical to builtin's: {results['vllm']['identical_greedy_vs_builtin']}/"
            f"{results['vllm']['of_requests']}"
            if has_vllm
            else ""
        )
        + (
            f"; llama.cpp's identical to builtin's up to the first EOS: "
            f"{results['llamacpp']['identical_until_eos_vs_builtin']}/{results['llamacpp']['of_requests']}"
            if has_llama
            else ""
        )
    )
    if prefix:
        print_prefix(prefix)
    else:
        print("\n(prefix-caching rows skipped: --quick)")


if __name__ == "__main__":
    main()
