"""Benchmark: analysis throughput on a >= 20M-token synthetic run, in memory and streamed, and report generation.

Targets (issue #27): the pure analysis (`lpf.analysis.findings.analyze`: join, thresholds, per-token
metrics, verdicts, failure shape, hypotheses, and the run-level test against the expected floor) at
>= 15M scored tokens/s in memory at 20M tokens on this 2-core machine; the streamed analysis of a run
directory (`analyze_run(..., stream=True)`) at >= 5M scored tokens/s; peak memory not above the
baseline's. Issue #6's: `lpf.report.write_report` on a 100k-request run in < 30 s, HTML < 20 MB.

The synthetic run is schema-true (built with `lpf.run.schema.table`, so a schema change cannot break
it): request ids as an engine writes them, float64 logprobs, engine top-1 lists and the reference's
the same (a rescorer always writes top-k), a float32-rounding noise floor (|d| ~ 1e-6), and 0.5% of
requests corrupted from a random position on (confident engine, improbable reference). The run is
greedy, float32 against float32 on zoo:hybrid, so the run-level test runs against the shipped floor.
`bench_throughput` builds it once and analyses it in a fresh child process per measurement (the
tables read from Arrow files; best of 3 passes; peak RSS of the analysis from VmHWM, reset once the
tables are read); the named baseline is the target, and
with `--baseline SRC` (another checkout's src/, e.g. `git worktree add /tmp/base 3a53f69`) also that
code, measured interleaved with this one in the same run on the same tables, with its findings
compared (sha256 of findings.json's JSON). The run-level test's cost is measured beside it
(`bench_run_test`): analyze with and without the shipped floor table on a run with top-5 lists on
both sides, as a ratio.
The streamed analysis at scale (`bench_scale`, issue #14): synthetic runs of 10M, 30M and 100M
scored tokens written as real run-directory parts by the store's writers (`write_synthetic_run`),
each analysed by `analyze_run` (no attribution) in a fresh child process, streamed, and in memory
(the named baseline) where that fits (`--memory-up-to`); reported: wall seconds, scored tokens/s
against the streamed target, the child's peak RSS (VmHWM), their ratios streamed / in-memory,
whether findings.json is byte-identical, and then `write_report` of the analysed run in a fresh
process (its seconds and peak RSS); with `--baseline`, the baseline code's streamed analysis too.
`--quick`: tiny sizes and no report (bench/report.py --quick runs that), seconds; nothing timed is
asserted, nothing written under bench/results: the smoke run `make test` does.
Usage: python bench/analysis.py [--tokens N] [--report-requests N] [--skip-report] [--run-test-tokens N]
       [--scale 10000000,30000000,100000000] [--memory-up-to N] [--only-scale [--shuffled]]
       [--baseline SRC] [--quick]
(writes bench/results/analysis.json, or analysis_scale[_shuffled].json with --only-scale, {"rows": [...]}, each
with the commit measured (`provenance.stamp`); prints a table)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
TARGET_TOKENS_PER_S = 15e6  # in memory, run-level test on (issue #27)
STREAM_TARGET_TOKENS_PER_S = 5e6  # streamed from a run directory (issue #27)
OUT_TOKENS = 64
CORRUPT_RATE = 0.005
RUN_INFO = {
    "engine_dtype": "float32",
    "reference_dtype": "float32",
    "model": "zoo:hybrid",
    "sampling": {"temperature": 0.0},
}


def _lists(values: np.ndarray, width: int, typ) -> pa.Array:
    offsets = np.arange(0, values.size + 1, width, dtype=np.int32) if width else np.zeros(values.size + 1, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.ravel() if width else [], typ))


def synthetic_run(
    n_requests: int, out_tokens: int, seed: int = 0, topk: int = 1, first: int = 0, reference_topk: bool = False
):
    """(requests, tokens, reference, corrupted) of one greedy run, grouped by request (requests
    `first`.. `first + n_requests - 1`: seq and id). `reference_topk`: the reference's top-k lists
    are the engine's (else empty)."""
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
    topk_ids = _lists(token.reshape(-1, 1).repeat(topk, 1), topk, pa.int32())
    topk_lps = _lists(eng_lp.astype(np.float32).reshape(-1, 1).repeat(topk, 1), topk, pa.float32())
    tokens = schema.table(
        schema.TOKENS,
        {
            "request_id": rid,
            "position": pos,
            "token_id": token,
            "engine_logprob": eng_lp,
            "engine_topk_ids": topk_ids,
            "engine_topk_logprobs": topk_lps,
        },
    )
    reference = schema.table(
        schema.REFERENCE,
        {
            "request_id": rid,
            "position": pos,
            "ref_logprob": ref_lp,
            "ref_rank": np.where(lie, 7, 1).astype(np.int32),
            "ref_entropy": np.full(n, 0.5, np.float32),
            "ref_top1_id": top1,
            "ref_top1_logprob": np.where(lie, -0.05, ref_lp),
            "ref_topk_ids": topk_ids if reference_topk else _lists(np.zeros(n, np.int32), 0, pa.int32()),
            "ref_topk_logprobs": topk_lps if reference_topk else _lists(np.zeros(n, np.float32), 0, pa.float32()),
        },
    )
    plen = 24
    requests = schema.table(
        schema.REQUESTS,
        {
            "request_id": ids,
            "seq": np.arange(first, first + n_requests, dtype=np.int64),
            "prompt_id": ids,
            "rollout": np.zeros(n_requests, np.int32),
            "prompt_token_ids": _lists(np.ones(n_requests * plen, np.int32), plen, pa.int32()),
            "output_token_ids": _lists(token, out_tokens, pa.int32()),
            "output_text": pa.array([""] * n_requests),
            "finish_reason": pa.array(["length"] * n_requests),
            "t_submit": np.zeros(n_requests),
            "t_first_token": np.zeros(n_requests),
            "t_finish": np.zeros(n_requests),
        },
    )
    return requests, tokens, reference, int(bad.sum())


MANIFEST = {
    "run_id": "bench-analysis",
    "status": "complete",
    "engine": {"name": "builtin", "options": {"dtype": "float32"}},
    "model": {"spec": "zoo:hybrid"},
    "reference": {"spec": "zoo:hybrid", "dtype": "float32"},
}


def write_synthetic_run(
    path: Path,
    n_tokens: int,
    part_tokens: int = 2_000_000,
    topk: int = 1,
    temperature: float = 0.0,
    shuffle_reference: bool = False,
    out_tokens: int = OUT_TOKENS,
):
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
        requests, tokens, reference, bad = synthetic_run(
            min(per_part, n_req - first), out_tokens, seed=i, topk=topk, first=first, reference_topk=True
        )
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


def _findings_digest(findings: dict) -> str:
    try:  # the code measured may be a baseline from before lpf.core (issue 21) moved it
        from lpf.core.jsonsafe import finite
    except ImportError:
        from lpf.jsonsafe import finite

    return hashlib.sha256(json.dumps(finite(findings), sort_keys=True, default=float).encode()).hexdigest()


def _peak_rss_mb() -> float:
    return [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")][0] / 1024


def _save_tables(folder: Path, **tables: pa.Table) -> None:
    for name, t in tables.items():
        with pa.ipc.new_file(folder / f"{name}.arrow", t.schema) as w:
            w.write_table(t)


def _load_tables(folder: Path, *names: str) -> list[pa.Table]:
    """Read into memory (not mapped): as the tables of a caller that built them."""
    out = []
    for name in names:
        with pa.OSFile(str(folder / f"{name}.arrow")) as f:
            out.append(pa.ipc.open_file(f).read_all())
    return out


def throughput_child(folder: Path, passes: int) -> dict:
    """One measurement in a fresh process (the lpf on its PYTHONPATH): the run's tables read from
    `folder`, VmHWM reset, then `analyze` with the run-level test on, `passes` times."""
    from lpf.analysis.findings import analyze
    from lpf.analysis.thresholds import Thresholds
    from lpf.pipeline.analyze import floor_table

    requests, tokens, reference = _load_tables(folder, "requests", "tokens", "reference")
    table = floor_table()
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: the analysis' own (tables included)
        f.write("5")
    times, cpu = [], []
    for _ in range(passes):  # the first pass pays page faults of fresh memory; the best counts
        t0, c0 = time.perf_counter(), time.process_time()
        summary, findings = analyze(
            requests, tokens, reference, Thresholds(), greedy=True, floor_table=table, run_info=RUN_INFO
        )
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    n = tokens.num_rows
    return {
        "tokens": n,
        "requests": requests.num_rows,
        "analyze_s": [round(t, 3) for t in times],
        "cpu_s": [round(t, 3) for t in cpu],
        "tokens_per_s": n / min(times),
        "tokens_per_cpu_s": n / min(cpu),
        "peak_rss_mb": round(_peak_rss_mb()),
        "corrupt_found": findings["counts"]["corrupt"],
        "run_test": findings["run_test"]["result"],
        "findings_sha256": _findings_digest(findings),
    }


def _child(src: Path, *args: str) -> dict:
    """This script's child mode (`--child ...`) with `src` first on the path: the code measured."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_throughput(n_tokens: int, baseline: Path | None = None, repeats: int = 2, passes: int = 3) -> dict:
    """This code (and `baseline`'s, interleaved) on the same synthetic run (built once, handed to
    each fresh child as Arrow files), per code the best pass of its best child. Findings must
    agree with the injected lies, and with the baseline's byte for byte."""
    codes = {"this": ROOT / "src", **({"baseline": baseline} if baseline else {})}
    runs: dict[str, list[dict]] = {k: [] for k in codes}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        requests, tokens, reference, n_bad = synthetic_run(
            max(1, n_tokens // OUT_TOKENS), OUT_TOKENS, reference_topk=True
        )
        _save_tables(Path(tmp), requests=requests, tokens=tokens, reference=reference)
        del requests, tokens, reference
        build_s = time.perf_counter() - t0
        for _ in range(repeats):
            for name, src in codes.items():
                runs[name].append(_child(src, "throughput", tmp, str(passes)))
    out = {}
    for name, rs in runs.items():
        best = max(rs, key=lambda r: r["tokens_per_s"])
        assert best["corrupt_found"] == n_bad, "the analysis must find exactly the corrupted requests"
        out[name] = {
            **best,
            "corrupt_injected": n_bad,
            "build_s": round(build_s, 1),
            "src": str(codes[name]),
            "all_analyze_s": [r["analyze_s"] for r in rs],
            "peak_rss_mb_all": [r["peak_rss_mb"] for r in rs],
            "ratio_to_target": best["tokens_per_s"] / TARGET_TOKENS_PER_S,
        }
    if baseline:
        b, t = out["baseline"], out["this"]
        out["vs_baseline"] = {
            "tokens_per_s": t["tokens_per_s"] / b["tokens_per_s"],
            "tokens_per_cpu_s": max(r["tokens_per_cpu_s"] for r in runs["this"])
            / max(r["tokens_per_cpu_s"] for r in runs["baseline"]),
            "peak_rss": min(t["peak_rss_mb_all"]) / min(b["peak_rss_mb_all"]),
            "findings_identical": t["findings_sha256"] == b["findings_sha256"],
        }
    return out


def bench_run_test(n_tokens: int) -> dict:
    """The run-level test's cost: `analyze` with the shipped floor table (float32 pair, zoo:hybrid's
    row) against `analyze` without it, on one synthetic run with top-5 lists on both sides, passes
    interleaved, best of 5 each."""
    from lpf.analysis.findings import analyze
    from lpf.analysis.thresholds import Thresholds
    from lpf.pipeline.analyze import floor_table

    requests, tokens, reference, _ = synthetic_run(
        max(1, n_tokens // OUT_TOKENS), OUT_TOKENS, topk=5, reference_topk=True
    )
    times = {"without": [], "with": []}
    for _ in range(5):
        for key, kw in (("without", {}), ("with", {"floor_table": floor_table(), "run_info": RUN_INFO})):
            t0 = time.perf_counter()
            _, findings = analyze(requests, tokens, reference, Thresholds(), greedy=True, **kw)
            times[key].append(round(time.perf_counter() - t0, 3))
    assert findings["run_test"]["result"] == "same"  # float32-level noise: within float32's floor
    return {
        "tokens": tokens.num_rows,
        "analyze_s": times["without"],
        "with_run_test_s": times["with"],
        "ratio": min(times["with"]) / min(times["without"]),
    }


def analyse_child(path: Path, mode: str) -> dict:
    """`analyze_run` (no attribution) of the run at `path`, `mode` stream or memory: wall seconds and
    peak RSS (VmHWM, which counts everything the process ever held resident, imports included)."""
    from lpf.analysis.thresholds import Thresholds
    from lpf.pipeline.analyze import analyze_run
    from lpf.run.store import RunDir

    t0, c0 = time.perf_counter(), time.process_time()
    f = analyze_run(RunDir.open(path), Thresholds(), attribute=False, stream=mode == "stream")
    s, c = time.perf_counter() - t0, time.process_time() - c0
    return {
        "seconds": s,
        "cpu_s": c,
        "peak_rss_mb": _peak_rss_mb(),
        "corrupt": f["counts"]["corrupt"],
        "n_scored_tokens": f["n_scored_tokens"],
        "tokens_per_s": f["n_scored_tokens"] / s,
    }


def analyse_in_child(path: Path, mode: str, src: Path | None = None) -> dict:
    """`analyse_child` in a fresh process (the code of `src`, else this checkout's)."""
    return _child(src or ROOT / "src", "analyse", str(path), mode)


def bench_scale(
    sizes: list[int], memory_up_to: int, shuffled: bool = False, baseline: Path | None = None, report: bool = True
) -> list[dict]:
    """Per size: a synthetic run written as run-directory parts (2M tokens a part), analysed
    streamed in a fresh process (and by `baseline`'s code, when given), and in memory (the baseline
    of memory) up to `memory_up_to` tokens; the findings of all must be byte-identical. `shuffled`:
    reference parts that do not line up with the tokens (`write_synthetic_run`), which the
    streamed path buckets by request range. `report`: time `write_report` of each analysed run too."""
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "run"
            t0 = time.perf_counter()
            _, n_bad = write_synthetic_run(path, n, shuffle_reference=shuffled)
            row = {
                "tokens": n,
                "chunks": "request ranges" if shuffled else "zip",
                "write_s": round(time.perf_counter() - t0, 1),
                "parts_mb": round(sum(f.stat().st_size for f in path.rglob("*.parquet")) / 2**20),
                "stream": analyse_in_child(path, "stream"),
            }
            assert shuffled or (
                row["stream"]["corrupt"] == n_bad and row["stream"]["n_scored_tokens"] == n // OUT_TOKENS * OUT_TOKENS
            )
            streamed = (path / "findings.json").read_bytes()
            row["stream_ratio_to_target"] = row["stream"]["tokens_per_s"] / STREAM_TARGET_TOKENS_PER_S
            if baseline:
                row["baseline_stream"] = analyse_in_child(path, "stream", baseline)
                row["baseline_identical"] = (path / "findings.json").read_bytes() == streamed
                row["stream_vs_baseline"] = row["baseline_stream"]["seconds"] / row["stream"]["seconds"]
                row["stream_vs_baseline_cpu"] = row["baseline_stream"]["cpu_s"] / row["stream"]["cpu_s"]
            row["report"] = _report_in_child(path) if report else None
            if n <= memory_up_to:
                row["memory"] = analyse_in_child(path, "memory")
                row["identical"] = (path / "findings.json").read_bytes() == streamed
                row["time_ratio"] = row["stream"]["seconds"] / row["memory"]["seconds"]
                row["rss_ratio"] = row["stream"]["peak_rss_mb"] / row["memory"]["peak_rss_mb"]
            rows.append(row)
            st = row["stream"]
            print(
                f"scale ({row['chunks']}): {n:,} tokens ({row['parts_mb']} MB of parts, written in {row['write_s']} s): streamed "
                f"{st['seconds']:.1f} s (CPU {st['cpu_s']:.1f} s) = {st['tokens_per_s'] / 1e6:.1f}M tokens/s "
                f"({row['stream_ratio_to_target']:.2f}x the 5M tokens/s target), peak RSS {st['peak_rss_mb']:.0f} MB"
                + (
                    f"; baseline code streamed {row['baseline_stream']['seconds']:.1f} s (CPU "
                    f"{row['baseline_stream']['cpu_s']:.1f} s), {row['baseline_stream']['peak_rss_mb']:.0f} MB (this / "
                    f"baseline: {row['stream_vs_baseline']:.2f}x faster, CPU {row['stream_vs_baseline_cpu']:.2f}x, findings "
                    f"identical: {row['baseline_identical']})"
                    if baseline
                    else ""
                )
                + (
                    f"; report {row['report']['seconds']:.1f} s, peak RSS {row['report']['peak_rss_mb']:.0f} MB"
                    if report
                    else ""
                )
                + (
                    f"; in memory {row['memory']['seconds']:.1f} s, {row['memory']['peak_rss_mb']:.0f} MB "
                    f"(streamed/in-memory: time {row['time_ratio']:.2f}x, RSS {row['rss_ratio']:.2f}x, "
                    f"findings identical: {row['identical']})"
                    if "memory" in row
                    else ""
                ),
                flush=True,
            )
    return rows


def _report_in_child(path: Path) -> dict:
    """`write_report` of the analysed run in a fresh process (bench/report.py's timer): seconds, peak RSS."""
    import report as report_bench  # bench/report.py, beside this script

    r = report_bench.timed_report(path)
    return {
        "seconds": round(r["seconds"], 1),
        "peak_rss_mb": round(r["peak_rss_mb"]),
        "html_mb": round(r["html_mb"], 1),
    }


def bench_report(n_requests: int) -> dict:
    """The report target, on bench/report.py's schema-true run (one builder and one timer for both
    benches): analysed by the real code, then `write_report` timed in a fresh process."""
    import report as report_bench  # bench/report.py, beside this script

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run"
        report_bench.build(path, n_requests)
        report_bench.analyze(path)
        r = report_bench.timed_report(path)
    return {
        "requests": n_requests,
        "tokens": n_requests * report_bench.OUT_TOKENS,
        "seconds": round(r["seconds"], 2),
        "html_mb": round(r["html_mb"], 2),
        "peak_rss_mb": round(r["peak_rss_mb"]),
        "target_s": 30,
        "target_mb": 20,
    }


def _print_throughput(result: dict) -> None:
    t = result["this"]
    print(
        f"analysis (in memory, run-level test on): {t['tokens']:,} tokens in {min(t['analyze_s']):.2f} s "
        f"(CPU {min(t['cpu_s']):.2f} s) = {t['tokens_per_s'] / 1e6:.1f}M tokens/s ({t['ratio_to_target']:.2f}x the 15M "
        f"tokens/s target; {t['tokens_per_cpu_s'] / 1e6:.1f}M per CPU second), peak RSS "
        f"{t['peak_rss_mb']} MB; corrupt found {t['corrupt_found']}/{t['corrupt_injected']}, run-level test {t['run_test']}"
    )
    if "baseline" in result:
        b, v = result["baseline"], result["vs_baseline"]
        print(
            f"baseline code ({b['src']}): {min(b['analyze_s']):.2f} s (CPU {min(b['cpu_s']):.2f} s) = "
            f"{b['tokens_per_s'] / 1e6:.1f}M tokens/s, peak RSS {b['peak_rss_mb']} MB; this / baseline: "
            f"{v['tokens_per_s']:.2f}x tokens/s ({v['tokens_per_cpu_s']:.2f}x per CPU second), peak RSS "
            f"{v['peak_rss']:.2f}x, findings identical: {v['findings_identical']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--report-requests", type=int, default=100_000)
    ap.add_argument("--skip-report", action="store_true")
    ap.add_argument("--run-test-tokens", type=int, default=4_000_000)
    ap.add_argument(
        "--scale",
        default="10000000,30000000,100000000",
        help="comma-separated run sizes (tokens) for the streamed-analysis scale bench ('' skips it)",
    )
    ap.add_argument(
        "--memory-up-to",
        type=int,
        default=10_000_000,
        help="also analyse in memory (the baseline) up to this many tokens",
    )
    ap.add_argument("--only-scale", action="store_true")
    ap.add_argument("--shuffled", action="store_true", help="scale bench on reference parts that do not line up")
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout's src/ to measure beside this code (e.g. the day's starting commit)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="child processes per code for the in-memory throughput")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, no results file (a smoke run)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *args = a.child
        print(
            json.dumps(
                throughput_child(Path(args[0]), int(args[1]))
                if kind == "throughput"
                else analyse_child(Path(args[0]), args[1])
            )
        )
        return
    if a.quick:
        a.tokens, a.run_test_tokens, a.repeats, a.skip_report = (
            200_000,
            100_000,
            1,
            True,
        )  # bench/report.py --quick times the report
        a.scale, a.memory_up_to = ",".join(str(min(int(x), 320_000)) for x in a.scale.split(",")[:1] if x), 320_000
    from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

    if a.baseline is not None and not (a.baseline / "lpf").is_dir():
        sys.exit(f"--baseline {a.baseline}: not a src/ folder with the lpf package in it")
    if a.only_scale:
        rows = bench_scale(
            [int(x) for x in a.scale.split(",") if x], a.memory_up_to, a.shuffled, a.baseline, report=not a.skip_report
        )
        if not a.quick:
            out = ROOT / "bench" / "results" / f"analysis_scale{'_shuffled' if a.shuffled else ''}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(stamp({"rows": rows}), indent=2) + "\n")
        return
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "load_average": os.getloadavg(),
        "throughput": bench_throughput(a.tokens, a.baseline, repeats=a.repeats, passes=2 if a.quick else 3),
    }
    _print_throughput(result["throughput"])
    result["run_test"] = rt = bench_run_test(a.run_test_tokens)
    print(
        f"run-level test: {rt['tokens']:,} tokens, analyze {min(rt['analyze_s']):.2f} s without it, "
        f"{min(rt['with_run_test_s']):.2f} s with it (best of 5): {rt['ratio']:.2f}x"
    )
    if a.scale:
        result["scale"] = bench_scale(
            [int(x) for x in a.scale.split(",") if x], a.memory_up_to, baseline=a.baseline, report=not a.skip_report
        )
    if not a.skip_report:
        result["report"] = bench_report(a.report_requests)
        r = result["report"]
        print(
            f"report: {r['requests']:,} requests in {r['seconds']:.1f} s, {r['html_mb']:.1f} MB (targets 30 s, 20 MB): "
            f"{r['seconds'] / 30:.2f}x the time target"
        )
    result["load_average_end"] = os.getloadavg()  # the machine is shared: its load at both ends of the run
    if not a.quick:
        out = ROOT / "bench" / "results" / "analysis.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(stamp(result), indent=2) + "\n")


if __name__ == "__main__":
    main()
