"""Benchmark: experiment cells forked from the kept worker vs a fresh `lpf audit` process per cell.

Target (issue 27): a 24-candidate built-in shrink and a 9-cell sweep each >= 2x faster with the kept
worker (`lpf.experiments.kept_cells`) than with a process per candidate, with identical outputs. Both
ways run in this one invocation, the same commands (`lpf sweep`, `lpf shrink` as a user runs them),
the baseline with `LPF_CELLS_FRESH_PROCESS=1` (the escape hatch: a process per cell), alternately:
- sweep: tiny:jamba on the built-in engine, the stale-state drill, 3 cache sizes x 3 step budgets
  (9 cells, 24 prompts x 2, 8 tokens); the same findings = sweep.json's cell rows and moves equal;
- shrink: the shrink tests' 2,000-request stale-state run on tiny:jamba-longmem (500 short prompts x 4,
  2 state slots), `lpf shrink` with its defaults (24 candidate runs); the same minimum = shrink.json's minimum and every candidate's
  outcome (lie, fingerprint of the target's tokens and logprobs) equal.
Wall time of the whole command each way, and the median time per cell (between successive cells'
reports: a burst of load on this shared machine moves the total more than the median); the machine's
load average at both ends is recorded beside them.
`--quick` is the smoke run `make test` does (nothing timed asserted, no results file): a 2-cell sweep
(6 prompts) and a 1-candidate shrink of a 100-request run (25 prompts x 4), both ways (one candidate:
no gap between cells, so the shrink's medians print nan; the sweep's show the per-cell measure).
Usage: python bench/cells.py [--quick] [--keep DIR]   (writes bench/results/cells.json)
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
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LPF = [sys.executable, "-m", "lpf"]


def lpf(*args, fresh: bool) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("LPF_CELLS_FRESH_PROCESS", None)
    if fresh:
        env["LPF_CELLS_FRESH_PROCESS"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run([*LPF, *map(str, args)], env=env, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        sys.exit(f"lpf {' '.join(map(str, args[:2]))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def per_cell(dirs: list[Path]) -> float:
    """Median seconds between successive cells' reports (each cell writes report.html last)."""
    done = sorted(p.stat().st_mtime for d in dirs if (p := d / "report.html").is_file())
    gaps = [b - a for a, b in zip(done, done[1:])]
    return round(statistics.median(gaps), 2) if gaps else float("nan")


def workload(path: Path, n: int, model: str, max_prompt_tokens: int | None = None) -> Path:
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=1, n=6 * n)
    if max_prompt_tokens:
        tok = load_tokenizer(resolve_model(model))
        items = [i for i in items if len(tok.encode(i["prompt"])) <= max_prompt_tokens]
    keep = [{"id": i["id"], "prompt": i["prompt"], "expected": i["expected"]} for i in items[:n]]
    path.write_text("".join(json.dumps(i) + "\n" for i in keep))
    return path


def sweep(root: Path, quick: bool) -> dict:
    wl = workload(root / "sweep.jsonl", 6 if quick else 24, "tiny:jamba")
    knobs = (
        ["--knob", "cache-mb=0.3,4"]
        if quick
        else ["--knob", "cache-mb=0.3,0.6,4", "--knob", "max-num-batched-tokens=17,33,64"]
    )
    args = [*knobs, "--inject", "stale-state", "--model", "tiny:jamba", "--workload", wl, "--n", 2, "--max-tokens", 8]
    out, docs = {}, {}
    for way, fresh in (("process", True), ("kept", False)):
        d = root / f"sweep-{way}"
        wall = lpf("sweep", *args, "--out", d, "--fail-on", "never", fresh=fresh)
        doc = json.loads((d / "sweep.json").read_text())
        docs[way] = {"cells": doc["cells"], "moves": doc["moves"]}
        out[way] = {"wall_s": round(wall, 1), "per_cell_s": per_cell(sorted((d / "cells").iterdir()))}
    out["n_cells"] = len(docs["kept"]["cells"])
    out["identical"] = docs["kept"] == docs["process"]
    return out


def shrink(root: Path, quick: bool) -> dict:
    model = "tiny:jamba-longmem"
    wl = workload(root / "shrink.jsonl", 25 if quick else 500, model, max_prompt_tokens=20)
    src = root / "source"
    lpf(
        "audit", "--engine", "builtin", "--model", model, "--workload", wl, "--max-tokens", 4, "--n", 4,
        "--cache-mb", 0.2, "-E", "block_size=4", "--max-num-batched-tokens", 6, "--inject", "stale-state",
        "--out", src, "--fail-on", "never", fresh=True,
    )  # fmt: skip
    budget = 1 if quick else 60  # lpf shrink's default; this shrink needs 24 of them (docs/benchmarks.md)
    out, docs = {}, {}
    for way, fresh in (("process", True), ("kept", False)):
        d = root / f"shrink-{way}"
        wall = lpf("shrink", src, "--out", d, "--budget-runs", budget, fresh=fresh)
        doc = json.loads((d / "shrink.json").read_text())
        docs[way] = {k: doc.get(k) for k in ("minimal", "status", "runs_used", "path", "candidates", "confirmation")}
        runs = sorted((d / "candidates").iterdir()) if (d / "candidates").is_dir() else []
        out[way] = {"wall_s": round(wall, 1), "per_cell_s": per_cell(runs), "candidate_runs": len(runs)}
    out["n_candidates"] = out["kept"]["candidate_runs"]
    out["identical"] = docs["kept"] == docs["process"]
    out["status"] = docs["kept"]["status"]
    out["minimum"] = docs["kept"]["minimal"]
    return out


def line(what: str, r: dict, n: int, same: str) -> str:
    p, k = r["process"], r["kept"]
    return (
        f"{what}, {n} cells: process per cell {p['wall_s']} s (median {p['per_cell_s']} s/cell), kept worker "
        f"{k['wall_s']} s (median {k['per_cell_s']} s/cell): {p['wall_s'] / k['wall_s']:.2f}x overall, "
        f"{p['per_cell_s'] / k['per_cell_s']:.2f}x per cell (target 2x); {same}: {r['identical']}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="2 cells and 1 candidate, few prompts, no results file (a smoke run)"
    )
    ap.add_argument("--keep", type=Path, default=None, help="work in this directory and keep it (else a temporary one)")
    args = ap.parse_args()
    quick = args.quick
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lpf-bench-cells-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        s = sweep(work, quick)
        print(line("sweep (builtin, tiny:jamba)", s, s["n_cells"], "findings identical"), flush=True)
        k = shrink(work, quick)
        print(line("shrink (builtin, tiny:jamba-longmem)", k, k["n_candidates"], "same minimum"), flush=True)
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": [round(x, 2) for x in load],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "sweep": s,
        "shrink": k,
    }
    print(f"load average: {result['load_average']} at the start, {result['load_average_end']} at the end")
    if not quick:
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        (ROOT / "bench" / "results" / "cells.json").write_text(json.dumps(stamp(result), indent=2) + "\n")
    return 0 if s["identical"] and k["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
