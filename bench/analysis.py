"""Benchmark: analysis throughput on a >= 20M-token synthetic run, and report generation at 100k requests.

Targets (issue #6): the pure analysis functions (`lpf.analysis.findings.analyze`: join, noise-floor
calibration, per-token metrics, verdicts, failure shape, hypotheses) at >= 10M scored tokens/s on
this 2-core machine, on in-memory Arrow tables; `lpf.report.write_report` on a 100k-request run
directory in < 30 s with an HTML file < 20 MB.

The synthetic run is schema-true: request ids as an engine writes them, float64 logprobs, engine
top-1 lists, a float32-rounding noise floor (|d| ~ 1e-6), and 0.5% of requests corrupted from a
random position on (confident engine, improbable reference). Reference top-k lists are left empty
in the throughput run (the analysis reads them only for sampled runs' tempered-logprob signature).
The baseline is the target itself: the table reports tokens/s and the ratio to 10M tokens/s.
The run-level test's cost is measured beside it (`bench_run_test`): analyze with and without the
shipped floor table on a run with top-5 lists on both sides, as a ratio.
The streamed analysis at scale (`bench_scale`, issue #14): synthetic runs of 10M, 30M and 100M
scored tokens written as real run-directory parts by the store's writers (`write_synthetic_run`),
each analysed by `analyze_run` (no attribution) in a fresh child process, streamed, and in memory
(the named baseline) where that fits (`--memory-up-to`); reported: wall seconds and the child's
peak RSS (VmHWM), their ratios streamed / in-memory, whether findings.json is byte-identical, and
then `write_report` of the analysed run in a fresh process (its seconds and peak RSS).
Usage: python bench/analysis.py [--tokens N] [--report-requests N] [--skip-report] [--run-test-tokens N]
       [--scale 10000000,30000000,100000000] [--memory-up-to N] [--only-scale [--shuffled]]
(writes bench/results/analysis.json, or analysis_scale[_shuffled].json with --only-scale; prints a table)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
TARGET_TOKENS_PER_S = 10e6
OUT_TOKENS = 64
CORRUPT_RATE = 0.005


def _lists(values: np.ndarray, width: int, typ) -> pa.Array:
    offsets = np.arange(0, values.size + 1, width, dtype=np.int32) if width else np.zeros(values.size + 1, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.ravel() if width else [], typ))


def synthetic_run(n_requests: int, out_tokens: int, seed: int = 0, topk: int = 1, first: int = 0):
    """(requests, tokens, reference) tables of one greedy run, grouped by request (requests
    `first`.. `first + n_requests - 1`: seq and id)."""
    from lpf.run import schema

    rng = np.random.default_rng(seed)
    n = n_requests * out_tokens
    ids = pa.array([f"bench-{i:08d}-r0" for i in range(first, first + n_requests)], pa.string())
    row_req = np.repeat(np.arange(n_requests), out_tokens)
    pos = np.tile(np.arange(out_tokens, dtype=np.int32), n_requests)
    token = rng.integers(3, 500, n, dtype=np.int32)
    ref_lp = -np.abs(rng.normal(0.2, 0.3, n))
    eng_lp = ref_lp + rng.normal(0, 1e-6, n)
    top1 = token.copy()
    bad = rng.random(n_requests) < CORRUPT_RATE
    start = rng.integers(0, max(1, out_tokens - 4), n_requests)  # at least a few lying tokens
    lie = bad[row_req] & (pos >= start[row_req])
    eng_lp[lie] = -0.01
    ref_lp[lie] = -rng.uniform(7, 20, int(lie.sum()))
    top1[lie] = token[lie] + 1
    rid = ids.take(pa.array(row_req))
    empty_f = _lists(np.zeros(n, np.float32), 0, pa.float32())
    tokens = pa.table({
        "request_id": rid, "position": pos, "token_id": token, "engine_logprob": eng_lp,
        "engine_topk_ids": _lists(token.reshape(-1, 1).repeat(topk, 1), topk, pa.int32()),
        "engine_topk_logprobs": _lists(eng_lp.astype(np.float32).reshape(-1, 1).repeat(topk, 1), topk, pa.float32()),
    }, schema=schema.TOKENS)
    reference = pa.table({
        "request_id": rid, "position": pos, "ref_logprob": ref_lp,
        "ref_rank": np.where(lie, 7, 1).astype(np.int32), "ref_entropy": np.full(n, 0.5, np.float32),
        "ref_top1_id": top1, "ref_top1_logprob": np.where(lie, -0.05, ref_lp),
        "ref_topk_ids": _lists(np.zeros(n, np.int32), 0, pa.int32()), "ref_topk_logprobs": empty_f,
    }, schema=schema.REFERENCE)
    plen = 24
    requests = pa.table({
        "request_id": ids, "seq": np.arange(first, first + n_requests, dtype=np.int64), "prompt_id": ids,
        "rollout": np.zeros(n_requests, np.int32),
        "prompt_token_ids": _lists(np.ones(n_requests * plen, np.int32), plen, pa.int32()),
        "output_token_ids": _lists(token, out_tokens, pa.int32()),
        "output_text": pa.array([""] * n_requests), "finish_reason": pa.array(["length"] * n_requests),
        "error": pa.nulls(n_requests, pa.string()), "t_submit": np.zeros(n_requests), "t_first_token": np.zeros(n_requests),
        "t_finish": np.zeros(n_requests), "oracle_expected": pa.nulls(n_requests, pa.string()),
        "oracle_ok": pa.nulls(n_requests, pa.bool_()), "inconsistency": pa.nulls(n_requests, pa.string()),
        "attempts": pa.nulls(n_requests, schema.REQUESTS.field("attempts").type),
    }, schema=schema.REQUESTS)
    return requests, tokens, reference, int(bad.sum())


MANIFEST = {"run_id": "bench-analysis", "status": "complete", "engine": {"name": "builtin", "options": {"dtype": "float32"}},
            "model": {"spec": "zoo:hybrid"}, "reference": {"spec": "zoo:hybrid", "dtype": "float32"}}


def write_synthetic_run(path: Path, n_tokens: int, part_tokens: int = 2_000_000, topk: int = 1,
                        temperature: float = 0.0, shuffle_reference: bool = False, out_tokens: int = OUT_TOKENS):
    """`synthetic_run` written as a real run directory by the store's own writers, part by part
    (memory bounded by a part): requests/tokens parts of ~part_tokens tokens, reference parts
    beside them, the reference's top-k lists the engine's (`topk` wide; the run-level test reads both);
    `shuffle_reference` writes the reference parts in reverse order, each part's requests reversed,
    and leaves every 50th request unscored: parts that do not line up with the tokens (the
    streamed analysis then buckets by request range). (RunDir, requests corrupted)."""
    from lpf.run.store import RunDir

    run = RunDir.create(path, dict(MANIFEST, sampling={"temperature": temperature}))
    per_part = max(1, part_tokens // out_tokens)
    n_req, n_bad, refs = max(1, n_tokens // out_tokens), 0, []
    for i, first in enumerate(range(0, n_req, per_part)):
        requests, tokens, reference, bad = synthetic_run(min(per_part, n_req - first), out_tokens, seed=i,
                                                         topk=topk, first=first)
        for name in ("ref_topk_ids", "ref_topk_logprobs"):  # a rescorer always writes top-k
            reference = reference.set_column(reference.schema.get_field_index(name), name,
                                             tokens.column(name.replace("ref_", "engine_")))
        n_bad += bad
        run.append_requests(requests, tokens)
        if not shuffle_reference:
            run.append("reference", reference)
            continue
        keep = (np.arange(reference.num_rows) // out_tokens + first) % 50 != 7
        rows = np.flatnonzero(keep)
        refs.append(reference.take(pa.array(rows[np.lexsort((rows % out_tokens, -(rows // out_tokens)))])))
    for reference in reversed(refs):
        run.append("reference", reference)
    return run, n_bad


def bench_throughput(n_tokens: int) -> dict:
    from lpf.analysis.findings import analyze
    from lpf.analysis.thresholds import Thresholds

    n_req = max(1, n_tokens // OUT_TOKENS)
    t0 = time.perf_counter()
    requests, tokens, reference, n_bad = synthetic_run(n_req, OUT_TOKENS)
    build_s = time.perf_counter() - t0
    times = []
    for _ in range(3):  # the first pass pays page faults of freshly built columns; report the best
        t0 = time.perf_counter()
        summary, findings = analyze(requests, tokens, reference, Thresholds(), greedy=True)
        times.append(time.perf_counter() - t0)
    best = min(times)
    n = tokens.num_rows
    assert findings["counts"]["corrupt"] == n_bad, "the analysis must find exactly the corrupted requests"
    return {"tokens": n, "requests": n_req, "build_s": round(build_s, 2), "analyze_s": [round(t, 3) for t in times],
            "tokens_per_s": n / best, "ratio_to_target": n / best / TARGET_TOKENS_PER_S,
            "corrupt_found": findings["counts"]["corrupt"], "corrupt_injected": n_bad}


def bench_run_test(n_tokens: int) -> dict:
    """The run-level test's cost: `analyze` with the shipped floor table (float32 pair, zoo:hybrid's
    row) against `analyze` without it, on one synthetic run with top-5 lists on both sides, passes
    interleaved, best of 5 each."""
    from lpf.analysis.findings import analyze
    from lpf.analysis.thresholds import Thresholds
    from lpf.pipeline.analyze import floor_table

    requests, tokens, reference, _ = synthetic_run(max(1, n_tokens // OUT_TOKENS), OUT_TOKENS, topk=5)
    for name in ("ref_topk_ids", "ref_topk_logprobs"):  # the reference's top-5 are the engine's
        reference = reference.set_column(reference.schema.get_field_index(name), name,
                                         tokens.column(name.replace("ref_", "engine_")))
    info = {"engine_dtype": "float32", "reference_dtype": "float32", "model": "zoo:hybrid",
            "sampling": {"temperature": 0.0}}
    times = {"without": [], "with": []}
    for _ in range(5):
        for key, kw in (("without", {}), ("with", {"floor_table": floor_table(), "run_info": info})):
            t0 = time.perf_counter()
            _, findings = analyze(requests, tokens, reference, Thresholds(), greedy=True, **kw)
            times[key].append(round(time.perf_counter() - t0, 3))
    assert findings["run_test"]["result"] == "same"  # float32-level noise: within float32's floor
    return {"tokens": tokens.num_rows, "analyze_s": times["without"], "with_run_test_s": times["with"],
            "ratio": min(times["with"]) / min(times["without"])}


_CHILD = """
import json, sys, time
from lpf.analysis.thresholds import Thresholds
from lpf.pipeline.analyze import analyze_run
from lpf.run.store import RunDir
t0 = time.perf_counter()
f = analyze_run(RunDir.open(sys.argv[1]), Thresholds(), attribute=False, stream=sys.argv[2] == "stream")
s = time.perf_counter() - t0
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"seconds": s, "peak_rss_mb": hwm / 1024, "corrupt": f["counts"]["corrupt"],
                  "n_scored_tokens": f["n_scored_tokens"]}))
"""


def analyse_in_child(path: Path, mode: str) -> dict:
    """`analyze_run` (no attribution) in a fresh process: wall seconds and its peak RSS (VmHWM,
    which counts everything the process ever held resident, imports included)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_scale(sizes: list[int], memory_up_to: int, shuffled: bool = False) -> list[dict]:
    """Per size: a synthetic run written as run-directory parts (2M tokens a part), analysed
    streamed in a fresh process, and in memory (the baseline) up to `memory_up_to` tokens; the
    findings of both must be byte-identical. `shuffled`: reference parts that do not line up with
    the tokens (`write_synthetic_run`), which the streamed path buckets by request range."""
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "run"
            t0 = time.perf_counter()
            _, n_bad = write_synthetic_run(path, n, shuffle_reference=shuffled)
            row = {"tokens": n, "chunks": "request ranges" if shuffled else "zip", "write_s": round(time.perf_counter() - t0, 1),
                   "parts_mb": round(sum(f.stat().st_size for f in path.rglob("*.parquet")) / 2**20),
                   "stream": analyse_in_child(path, "stream")}
            assert shuffled or (row["stream"]["corrupt"] == n_bad and row["stream"]["n_scored_tokens"] == n)
            streamed = (path / "findings.json").read_bytes()
            row["report"] = _report_in_child(path)
            if n <= memory_up_to:
                row["memory"] = analyse_in_child(path, "memory")
                row["identical"] = (path / "findings.json").read_bytes() == streamed
                row["time_ratio"] = row["stream"]["seconds"] / row["memory"]["seconds"]
                row["rss_ratio"] = row["stream"]["peak_rss_mb"] / row["memory"]["peak_rss_mb"]
            rows.append(row)
            print(f"scale ({row['chunks']}): {n:,} tokens ({row['parts_mb']} MB of parts, written in {row['write_s']} s): streamed "
                  f"{row['stream']['seconds']:.1f} s, peak RSS {row['stream']['peak_rss_mb']:.0f} MB"
                  + f"; report {row['report']['seconds']:.1f} s, peak RSS {row['report']['peak_rss_mb']:.0f} MB"
                  + (f"; in memory {row['memory']['seconds']:.1f} s, {row['memory']['peak_rss_mb']:.0f} MB "
                     f"(streamed/in-memory: time {row['time_ratio']:.2f}x, RSS {row['rss_ratio']:.2f}x, "
                     f"findings identical: {row['identical']})" if "memory" in row else ""), flush=True)
    return rows


def _report_in_child(path: Path) -> dict:
    """`write_report` of the analysed run in a fresh process (bench/report.py's timer): seconds, peak RSS."""
    import report as report_bench  # bench/report.py, beside this script

    r = report_bench.timed_report(path)
    return {"seconds": round(r["seconds"], 1), "peak_rss_mb": round(r["peak_rss_mb"]), "html_mb": round(r["html_mb"], 1)}


def bench_report(n_requests: int) -> dict:
    """The report target, on bench/report.py's schema-true run (one builder and one timer for both
    benches): analysed by the real code, then `write_report` timed in a fresh process."""
    import report as report_bench  # bench/report.py, beside this script

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run"
        report_bench.build(path, n_requests)
        report_bench.analyze(path)
        r = report_bench.timed_report(path)
    return {"requests": n_requests, "tokens": n_requests * report_bench.OUT_TOKENS, "seconds": round(r["seconds"], 2),
            "html_mb": round(r["html_mb"], 2), "peak_rss_mb": round(r["peak_rss_mb"]), "target_s": 30, "target_mb": 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--report-requests", type=int, default=100_000)
    ap.add_argument("--skip-report", action="store_true")
    ap.add_argument("--run-test-tokens", type=int, default=4_000_000)
    ap.add_argument("--scale", default="10000000,30000000,100000000",
                    help="comma-separated run sizes (tokens) for the streamed-analysis scale bench ('' skips it)")
    ap.add_argument("--memory-up-to", type=int, default=30_000_000,
                    help="also analyse in memory (the baseline) up to this many tokens")
    ap.add_argument("--only-scale", action="store_true")
    ap.add_argument("--shuffled", action="store_true", help="scale bench on reference parts that do not line up")
    a = ap.parse_args()
    if a.only_scale:
        out = ROOT / "bench" / "results" / f"analysis_scale{'_shuffled' if a.shuffled else ''}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        rows = bench_scale([int(x) for x in a.scale.split(",") if x], a.memory_up_to, a.shuffled)
        out.write_text(json.dumps(rows, indent=2) + "\n")
        return
    result = {"throughput": bench_throughput(a.tokens)}
    t = result["throughput"]
    print(f"analysis: {t['tokens']:,} tokens in {min(t['analyze_s']):.2f} s = {t['tokens_per_s'] / 1e6:.1f}M tokens/s "
          f"({t['ratio_to_target']:.2f}x the 10M tokens/s target); corrupt found {t['corrupt_found']}/{t['corrupt_injected']}")
    result["run_test"] = rt = bench_run_test(a.run_test_tokens)
    print(f"run-level test: {rt['tokens']:,} tokens, analyze {min(rt['analyze_s']):.2f} s without it, "
          f"{min(rt['with_run_test_s']):.2f} s with it (best of 5): {rt['ratio']:.2f}x")
    if a.scale:
        result["scale"] = bench_scale([int(x) for x in a.scale.split(",") if x], a.memory_up_to)
    if not a.skip_report:
        result["report"] = bench_report(a.report_requests)
        r = result["report"]
        print(f"report: {r['requests']:,} requests in {r['seconds']:.1f} s, {r['html_mb']:.1f} MB (targets 30 s, 20 MB)")
    out = ROOT / "bench" / "results" / "analysis.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
