"""Benchmark: output tokens/s of the built-in engine against HF `generate` in padded static batches.

Same model, same workload (the zoo's stress mix: prompts of ~8..470 tokens, max_tokens 4..128),
greedy with ignore_eos so both produce exactly the same number of tokens, float32, in one run.
Each engine runs in its own process through `lpf run`; process and model start-up are measured by
the same command on a 1-token workload and subtracted, so the ratio compares generation only.
Usage: python bench/engine.py [--requests N] [--model SPEC]   (writes bench/results/engine.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def lpf_run(engine: str, model: str, workload: Path, out: Path, extra: list[str]) -> float:
    exe = Path(sys.executable).with_name("lpf")
    # one intra-op thread for both: at these model sizes more threads only add scheduling overhead,
    # and the builtin engine defaults to 1
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    subprocess.run([str(exe), "run", "--engine", engine, "--model", model, "--workload", str(workload),
                    "--out", str(out), "--ignore-eos", "--max-tokens", "128", "--part-size", "100000", *extra],
                   check=True, capture_output=True, text=True, env=env)
    return time.perf_counter() - t0


def startup(engine: str, model: str, tmp: Path, extra: list[str]) -> float:
    """Wall time of the same command on a 1-request, 1-token workload: process + model start-up."""
    w = tmp / f"one-{engine}.jsonl"
    w.write_text(json.dumps({"prompt": "a", "max_tokens": 1}) + "\n")
    return lpf_run(engine, model, w, tmp / f"startup-{engine}", extra)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine, interleaved; the median is reported")
    a = ap.parse_args()
    import pyarrow.parquet as pq

    from lpf.zoo import registry

    model = a.model or ("zoo:hybrid" if registry.model_available("hybrid") else "tiny:hybrid")
    items = registry.workload_items("stress", seed=1, n=a.requests)
    engines = {"hf": ["-E", "batch_size=32"], "builtin": ["--max-num-seqs", "64", "--max-num-batched-tokens", "512"]}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wl = tmp / "stress.jsonl"
        wl.write_text("".join(json.dumps({"id": it["id"], "prompt": it["prompt"], "max_tokens": it["max_tokens"]}) + "\n"
                              for it in items))
        times: dict[str, list[float]] = {name: [] for name in engines}
        base = {name: startup(name, model, tmp, extra) for name, extra in engines.items()}
        for rep in range(a.repeats):  # interleaved, so a noisy minute hurts both engines alike
            for name, extra in engines.items():
                out = tmp / f"{name}-{rep}"
                times[name].append(lpf_run(name, model, wl, out, extra) - base[name])
        for name in engines:
            req = pq.read_table(tmp / f"{name}-0" / "requests")
            n_out = sum(len(x) for x in req.column("output_token_ids").to_pylist())
            secs = statistics.median(times[name])
            results[name] = {"seconds": secs, "all_seconds": times[name], "startup_s": base[name],
                             "output_tokens": n_out, "tokens_per_s": n_out / secs}
            print(f"{name:8s} {n_out} tokens, median {secs:.1f}s of {[round(t, 1) for t in times[name]]} "
                  f"(+{base[name]:.1f}s start-up): {results[name]['tokens_per_s']:.0f} tok/s", file=sys.stderr)
        hf_out = pq.read_table(tmp / "hf-0" / "requests").sort_by("seq").column("output_token_ids").to_pylist()
        bi_out = pq.read_table(tmp / "builtin-0" / "requests").sort_by("seq").column("output_token_ids").to_pylist()
        results["identical_greedy_outputs"] = sum(x == y for x, y in zip(hf_out, bi_out)) / len(hf_out)
    ratio = results["builtin"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    out = {"model": model, "requests": a.requests, "ratio": ratio, "results": results, "date": time.strftime("%Y-%m-%d")}
    Path(__file__).with_name("results").mkdir(exist_ok=True)
    Path(__file__).with_name("results").joinpath("engine.json").write_text(json.dumps(out, indent=2))
    print("| engine | output tokens/s | vs HF generate |")
    print("|---|---|---|")
    print(f"| HF generate (padded static batches of 32) | {results['hf']['tokens_per_s']:.0f} | 1.0x |")
    print(f"| lpf builtin (continuous batching) | {results['builtin']['tokens_per_s']:.0f} | {ratio:.2f}x |")
    print(f"\n{a.requests} requests of zoo:stress on {model}, float32, greedy, ignore_eos, median of {a.repeats} "
          f"interleaved runs; "
          f"identical greedy outputs: {results['identical_greedy_outputs']:.1%}")


if __name__ == "__main__":
    main()
