"""Benchmark: what recording the step trace (lpf-vllm-trace) costs vLLM's generation.

Baseline: the same `vllm` adapter with `-E trace=false` (the plugin not switched on, so no hook is
installed), same model, workload and knobs, in the same run. Modes alternate (off, on, off, on, ...)
so drift in the machine's load hits both; each mode's median is reported and the result is the
ratio on / off. Each repeat starts a fresh worker (hooks are installed at start-up) and times one
batch through the adapter's own `generate`, from the first request sent to the last completion
received, as lpf runs it: the hooks on every step, the background flusher, the worker's flush before
it reports finished requests, and lpf's move of the parts (`side_tables`). Two measures of that
window: the worker process's CPU seconds (all its threads, from /proc; what the trace costs the
engine, and steady on a shared machine) and wall seconds (what a user waits; noisy when other jobs
share the cores). vLLM's 10-30 s start-up is outside the window.
Two configurations: the drill's (zoo:oracle, 500 requests, 16 tokens, a 32-token step budget over 16
sequences: many small steps, the worst case for a per-step cost) and the engine bench's (zoo:stress,
200 requests, 128 tokens, 512-token budget over 64 sequences).
`--quick` is the smoke run `make test` does (nothing timed is asserted, no results file): the drill
config on 40 requests, one repeat of each mode, no settling pause before the window.
Usage: python bench/vllm_trace.py [--repeats N] [--quick]   (writes bench/results/vllm_trace.json; needs .venv-vllm)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "drill": {
        "workload": "zoo:oracle",
        "n_requests": 500,
        "max_tokens": 16,
        "ignore_eos": False,
        "knobs": {"max_num_seqs": 16, "max_num_batched_tokens": 32},
    },
    "engine-bench": {
        "workload": "zoo:stress",
        "n_requests": 200,
        "max_tokens": 128,
        "ignore_eos": True,
        "knobs": {"max_num_seqs": 64, "max_num_batched_tokens": 512},
    },
}
MODEL = "zoo:hybrid"


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests(cfg: dict, tmp: Path):
    from lpf.core.sampling import SamplingParams
    from lpf.pipeline import create_run, pending_requests
    from lpf.pipeline.spec import RunSpec

    run = create_run(
        RunSpec(
            engine="vllm",
            model=MODEL,
            workload=_workload(cfg, tmp),
            out=tmp / f"spec-{cfg['workload'][4:]}",
            sampling=SamplingParams(max_tokens=cfg["max_tokens"], ignore_eos=cfg["ignore_eos"]),
        )
    )
    return run, pending_requests(run)


def _workload(cfg: dict, tmp: Path) -> str:
    from lpf.zoo import registry

    items = registry.workload_items(cfg["workload"][4:], seed=0, n=cfg["n_requests"])
    path = tmp / f"{cfg['workload'][4:]}-{cfg['n_requests']}.jsonl"
    path.write_text("".join(json.dumps({"id": i["id"], "prompt": i["prompt"]}) + "\n" for i in items))
    return str(path)


def one(cfg: dict, run, reqs, trace: bool, settle_s: float = 1.0) -> dict:
    from lpf.adapters.vllm import VLLMEngine, VLLMOptions
    from lpf.core.model_specs import resolve_model
    from lpf.core.sampling import SamplingParams

    options = VLLMOptions.parse(
        {**cfg["knobs"], "enable_chunked_prefill": True, "enable_prefix_caching": False, "trace": trace}
    )
    engine = VLLMEngine(resolve_model(MODEL), SamplingParams.from_dict(run.manifest["sampling"]), options)
    try:
        time.sleep(settle_s)  # let start-up's last threads settle before the window opens
        cpu0, t0 = cpu_seconds(engine.proc.pid), time.perf_counter()
        done = list(engine.generate(reqs))
        rows = sum(t.num_rows for t in [engine.side_tables().get("trace")] if t is not None)
        wall, cpu = time.perf_counter() - t0, cpu_seconds(engine.proc.pid) - cpu0
    finally:
        engine.close()
    errors = [c.error for c in done if c.error]
    if errors:
        sys.exit(f"{len(errors)} request(s) failed, first: {errors[0]}")
    if trace and not rows:
        sys.exit(f"tracing was on but no trace was recorded: {engine._trace_info()['why']}")
    return {
        "trace": trace,
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": sum(len(c.output_token_ids) for c in done),
        "trace_rows": rows,
    }


def main() -> None:
    from lpf.adapters.vllm import vllm_python
    from lpf.core.errors import LpfError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vllm_trace.json")
    ap.add_argument(
        "--quick", action="store_true", help="the drill config, 40 requests, one repeat, no pause, no results file"
    )
    args = ap.parse_args()
    configs = CONFIGS
    if args.quick:
        args.repeats = 1
        configs = {"drill": {**CONFIGS["drill"], "n_requests": 40}}
    try:
        vllm_python()
    except LpfError as e:
        sys.exit(f"skipped: {e}")
    os.environ["OMP_NUM_THREADS"] = "1"  # reaches the worker: one intra-op thread, as in bench/engine.py
    results = {"date": time.strftime("%Y-%m-%d"), "model": MODEL, "repeats": args.repeats, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="lpf-bench-vllm-trace-") as tmp:
        for name, cfg in configs.items():
            run, reqs = requests(cfg, Path(tmp))
            runs = []
            for i in range(args.repeats):
                for trace in (False, True):  # interleaved: off, on, off, on, ...
                    r = one(cfg, run, reqs, trace, 0.0 if args.quick else 1.0)
                    runs.append(r)
                    print(
                        f"{name} #{i} trace={'on ' if trace else 'off'} cpu {r['cpu_s']:.2f} s, wall {r['wall_s']:.2f} s "
                        f"({r['output_tokens']} tokens, {r['trace_rows']} trace rows)",
                        file=sys.stderr,
                    )
            med = {
                f"median_{k}_{m}": statistics.median(r[f"{k}_s"] for r in runs if r["trace"] == (m == "on"))
                for k in ("cpu", "wall")
                for m in ("off", "on")
            }
            results["configs"][name] = {
                **{k: cfg[k] for k in ("workload", "n_requests", "max_tokens", "knobs")},
                **med,
                "ratio_cpu": med["median_cpu_on"] / med["median_cpu_off"],
                "ratio_wall": med["median_wall_on"] / med["median_wall_off"],
                "trace_rows": max(r["trace_rows"] for r in runs),
                "runs": runs,
            }
            c = results["configs"][name]
            print(
                f"{name}: cpu {c['median_cpu_off']:.2f} -> {c['median_cpu_on']:.2f} s ({c['ratio_cpu']:.3f}x), "
                f"wall {c['median_wall_off']:.2f} -> {c['median_wall_on']:.2f} s ({c['ratio_wall']:.3f}x)",
                file=sys.stderr,
            )
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        args.out.write_text(json.dumps(stamp(results), indent=2) + "\n")
    print(
        json.dumps(
            {
                k: {"cpu": round(v["ratio_cpu"], 3), "wall": round(v["ratio_wall"], 3)}
                for k, v in results["configs"].items()
            }
        )
    )


if __name__ == "__main__":
    main()
