"""Benchmark: `lpf report` on a 100k-request run. Targets (issue #6): under 30 s, HTML under 20 MB.

A synthetic but schema-true run directory is written once (zoo:hybrid's tokenizer, 100k requests of
32 output tokens with top-5 on both sides, a per-step trace, 0.5% of requests corrupted from some
position on; parts of 64 requests as `lpf run` writes them, reference parts of 512 requests), analysed with the real `lpf analyze` code, then `write_report` is timed in a fresh
subprocess (imports included, as a user running `lpf report` pays them). The baseline for size is
the same page with every request drawn in the scatter (no downsampling). Tables are built with
`lpf.run.schema.table` (the columns the bench has, the others null), so a schema change cannot
break the bench.
`--quick`: 2,000 requests, one timed report, nothing written under bench/results (the smoke run
`make test` does: it checks the bench runs, not how fast).
Usage: python bench/report.py [--requests N] [--keep DIR] [--quick]   (writes bench/results/report.json)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

OUT_TOKENS, TOPK, PROMPT, PER_STEP_ARRIVALS = 32, 5, 24, 8
PART, REF_PART = 64, 512  # requests per requests/tokens/trace part (lpf run's default) and per reference part


def _lists(values: np.ndarray, width: int, typ) -> pa.Array:
    offsets = np.arange(0, values.size + 1, width, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.ravel(), typ))


def build(path: Path, n: int, seed: int = 0) -> None:
    from lpf.run import schema
    from lpf.run.store import RunDir

    from lpf.core.model_specs import load_tokenizer, resolve_model, tokenizer_fingerprint

    rng = np.random.default_rng(seed)
    model = resolve_model("zoo:hybrid")
    run = RunDir.create(
        path,
        {
            "run_id": "bench-report",
            "lpf_version": "bench",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "status": "complete",
            "engine": {"name": "builtin", "options": {"cache_mb": 64}},
            "model": {**model.describe(), "architecture": "GraniteMoeHybridForCausalLM"},
            "tokenizer_sha256": tokenizer_fingerprint(load_tokenizer(model)),
            "reference": {"spec": "zoo:hybrid", "dtype": "float32"},
            "workload": {"source": "synthetic", "n_prompts": n, "n": 1, "n_requests": n},
            "sampling": {"temperature": 0.0, "max_tokens": OUT_TOKENS, "logprobs": TOPK},
            "seed": seed,
        },
    )
    ids = np.array([f"req-{i:06d}" for i in range(n)], dtype=object)
    corrupt = rng.random(n) < 0.005
    onset = rng.integers(0, OUT_TOKENS, n)
    part = 25_000
    for lo in range(0, n, part):
        hi = min(n, lo + part)
        m = hi - lo
        out = rng.integers(4, 500, (m, OUT_TOKENS), dtype=np.int32)
        eng = -rng.exponential(0.05, (m, OUT_TOKENS))
        pos = np.tile(np.arange(OUT_TOKENS, dtype=np.int32), m)
        bad = corrupt[lo:hi, None] & (np.arange(OUT_TOKENS)[None, :] >= onset[lo:hi, None])
        ref = np.where(bad, eng - rng.uniform(3, 15, (m, OUT_TOKENS)), eng + rng.normal(0, 2e-6, (m, OUT_TOKENS)))
        topk_ids = np.concatenate([out[..., None], rng.integers(4, 500, (m, OUT_TOKENS, TOPK - 1), dtype=np.int32)], -1)
        topk_lp = np.sort(-rng.exponential(3, (m, OUT_TOKENS, TOPK)), -1)[..., ::-1].astype(np.float32)
        rid = np.repeat(ids[lo:hi], OUT_TOKENS)
        requests = schema.table(
            schema.REQUESTS,
            {
                "request_id": ids[lo:hi],
                "seq": np.arange(lo, hi),
                "prompt_id": ids[lo:hi],
                "rollout": np.zeros(m, np.int32),
                "prompt_token_ids": _lists(rng.integers(4, 500, (m, PROMPT), dtype=np.int32), PROMPT, pa.int32()),
                "output_token_ids": _lists(out, OUT_TOKENS, pa.int32()),
                "output_text": np.array(["synthetic output"] * m, dtype=object),
                "finish_reason": np.array(["length"] * m, dtype=object),
                "t_submit": np.zeros(m),
                "t_first_token": np.zeros(m),
                "t_finish": np.zeros(m),
            },
        )
        tokens = schema.table(
            schema.TOKENS,
            {
                "request_id": rid,
                "position": pos,
                "token_id": out.ravel(),
                "engine_logprob": eng.ravel(),
                "engine_topk_ids": _lists(topk_ids, TOPK, pa.int32()),
                "engine_topk_logprobs": _lists(topk_lp, TOPK, pa.float32()),
            },
        )
        for a in range(0, m, PART):
            run.append_requests(requests.slice(a, PART), tokens.slice(a * OUT_TOKENS, PART * OUT_TOKENS))
        reference = schema.table(
            schema.REFERENCE,
            {
                "request_id": rid,
                "position": pos,
                "ref_logprob": ref.ravel(),
                "ref_rank": np.where(bad, 7, 1).ravel().astype(np.int32),
                "ref_entropy": np.full(m * OUT_TOKENS, 0.1, np.float32),
                "ref_top1_id": np.where(bad, 3, out).ravel().astype(np.int32),
                "ref_top1_logprob": np.where(bad, -0.01, ref).ravel(),
                "ref_topk_ids": _lists(topk_ids, TOPK, pa.int32()),
                "ref_topk_logprobs": _lists(topk_lp, TOPK, pa.float32()),
            },
        )
        for a in range(0, m, REF_PART):
            run.append("reference", reference.slice(a * OUT_TOKENS, REF_PART * OUT_TOKENS))
        # trace: request i arrives at step i // 8 and runs 1 prefill + 32 decode steps
        k = np.arange(OUT_TOKENS + 1)
        req = np.repeat(np.arange(lo, hi), OUT_TOKENS + 1)
        step = (req // PER_STEP_ARRIVALS) + np.tile(k, m)
        live = (OUT_TOKENS + 1) * PER_STEP_ARRIVALS
        trace = schema.table(
            schema.TRACE,
            {
                "step": step.astype(np.int64),
                "request_id": ids[req],
                "phase": np.where(np.tile(k, m) == 0, "prefill", "decode"),
                "num_computed_tokens": np.where(np.tile(k, m) == 0, 0, PROMPT + np.tile(k, m) - 1).astype(np.int32),
                "num_scheduled_tokens": np.where(np.tile(k, m) == 0, PROMPT, 1).astype(np.int32),
                "state_slot": (req % 300).astype(np.int32),
                "batch_size": np.full(req.size, live, np.int32),
                "batch_tokens": np.full(req.size, live + PER_STEP_ARRIVALS * (PROMPT - 1), np.int32),
                "preempted": np.zeros(req.size, bool),
            },
        )
        for a in range(0, m, PART):
            run.append("trace", trace.slice(a * (OUT_TOKENS + 1), PART * (OUT_TOKENS + 1)))


def analyze(path: Path) -> float:
    from lpf.analysis.thresholds import Thresholds
    from lpf.pipeline import analyze_run
    from lpf.run.store import RunDir

    t = time.perf_counter()
    analyze_run(RunDir.open(path), Thresholds())
    return time.perf_counter() - t


def timed_report(path: Path) -> dict:
    # peak RSS from VmHWM: ru_maxrss would carry this (large) parent's peak across fork + exec
    code = (
        "import time, json, sys, re; t = time.perf_counter(); from lpf.report import write_report; "
        "p = write_report(sys.argv[1]); s = time.perf_counter() - t; "
        "hwm = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)); "
        "print(json.dumps({'seconds': s, 'peak_rss_mb': hwm / 1024}))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["html_mb"] = (path / "report.html").stat().st_size / 1e6
    return res


def baseline_size(path: Path) -> float:
    """The page's size with every request drawn in the scatter (what downsampling saves)."""
    from lpf.report import run_page
    from lpf.report.html import render

    return len(render(run_page.load(path, max_points=10**9), "baseline").encode()) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--keep", type=Path, default=None, help="build the run here and keep it")
    ap.add_argument("--quick", action="store_true", help="2,000 requests, one report, no results file (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.requests = min(args.requests, 2000)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "run"
        t = time.perf_counter()
        build(path, args.requests)
        built = time.perf_counter() - t
        analysed = analyze(path)
        runs = [timed_report(path) for _ in range(1 if args.quick else 3)]
        best = min(runs, key=lambda r: r["seconds"])
        result = {
            "requests": args.requests,
            "tokens": args.requests * OUT_TOKENS,
            "build_s": built,
            "analyze_s": analysed,
            "report_s_runs": [r["seconds"] for r in runs],
            "report_s": best["seconds"],
            "peak_rss_mb": best["peak_rss_mb"],
            "html_mb": best["html_mb"],
            "baseline_html_mb": baseline_size(path),
            "target_s": 30,
            "target_mb": 20,
        }
    if not args.quick:
        out = Path(__file__).with_name("results") / "report.json"
        out.parent.mkdir(exist_ok=True)
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        out.write_text(json.dumps(stamp(result), indent=2) + "\n")
    print(
        f"report for {result['requests']:,} requests ({result['tokens']:,} tokens): "
        f"{result['report_s']:.1f} s (target < 30 s; runs {', '.join(f'{s:.1f}' for s in result['report_s_runs'])}), "
        f"{result['html_mb']:.1f} MB (target < 20 MB; every request drawn: {result['baseline_html_mb']:.1f} MB, "
        f"{result['html_mb'] / result['baseline_html_mb']:.2f}x), peak RSS {result['peak_rss_mb']:.0f} MB"
    )


if __name__ == "__main__":
    main()
