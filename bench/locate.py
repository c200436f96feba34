"""Benchmark: `lpf locate` on the tiny models: what it names for each drill, and what it costs.

Target (issue 23): locating one request on the tiny models takes under a minute on this machine. For
each configuration a run is audited (`lpf audit`, timed: the baseline, the cost of the run it
locates), then `lpf locate RUN --json` is timed in a fresh process (imports included, as a user pays
them). Every line reports the located op, the verdict and the ratio locate / 60 s (the target) beside
locate / audit. The configurations are the tests' (tests/test_locate_drills.py) and one more each
(another model or another drill argument), so a claim never rests on the configuration it was tuned
on; `--vllm` adds the conformance tiny Lfm2, Lfm2Moe and Zamba2 on vLLM (fp32, and 16-token chunks).
Usage: python bench/locate.py [--quick] [--vllm] [--only TEXT] [--keep DIR]   (writes
bench/results/locate.json; --quick: one small configuration, nothing written; --only: the configurations
whose name contains TEXT, their rows replaced in the results file, the others kept)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 60.0
JAMBA = ["--n", "4", "--max-tokens", "16", "--cache-mb", "3", "--max-num-seqs", "16", "--max-num-batched-tokens", "32"]
# name -> (model, workload prompts, audit args); the first of each pair is the tests' configuration
CONFIGS = {
    "stale-state, tiny:jamba-longmem (tests)": ("tiny:jamba-longmem", 60, [*JAMBA, "--inject", "stale-state"]),
    "stale-state, zoo:hybrid": (
        "zoo:hybrid",
        60,
        [
            "--n",
            "4",
            "--max-tokens",
            "16",
            "--cache-mb",
            "2",
            "--max-num-batched-tokens",
            "64",
            "--inject",
            "stale-state",
        ],
    ),
    "offset-wrap:18, tiny:jamba-longmem (tests)": ("tiny:jamba-longmem", 60, [*JAMBA, "--inject", "offset-wrap:18"]),
    # 26 slots of 14880 elements at 3 MB: slots >= 18 wrap at 2^18 (at 2^19 none would: nothing to locate)
    "offset-wrap:18, tiny:hybrid-longmem": ("tiny:hybrid-longmem", 60, [*JAMBA, "--inject", "offset-wrap:18"]),
    "lost-chunk-state, zoo:hybrid (tests)": (
        "zoo:hybrid",
        60,
        ["--max-tokens", "8", "--prompt-logprobs", "--max-num-batched-tokens", "16", "--inject", "lost-chunk-state"],
    ),
    "lost-chunk-state, zoo:jamba": (
        "zoo:jamba",
        60,
        ["--max-tokens", "8", "--prompt-logprobs", "--max-num-batched-tokens", "16", "--inject", "lost-chunk-state"],
    ),
    "quantize-weights, zoo:hybrid (tests)": ("zoo:hybrid", 60, ["--max-tokens", "8", "--inject", "quantize-weights"]),
    "quantize-weights:8, zoo:jamba": ("zoo:jamba", 60, ["--max-tokens", "8", "--inject", "quantize-weights:8"]),
    # the prefix-caching drills (zoo:shared-prefix traffic, a cancel-and-resend client included)
    "stale-conv-on-reuse, tiny:jamba-longmem": (
        "tiny:jamba-longmem",
        "shared-prefix",
        ["--max-tokens", "8", "--max-num-batched-tokens", "48", "--cache-mb", "3", "--inject", "stale-conv-on-reuse"],
    ),
    "resume-wrong-units, tiny:jamba-longmem": (
        "tiny:jamba-longmem",
        "shared-prefix",
        [
            "--max-tokens",
            "8",
            "--max-num-batched-tokens",
            "48",
            "--cache-mb",
            "3",
            "--enable-prefix-caching",
            "-E",
            "mamba_block_size=32",
            "--inject",
            "resume-wrong-units",
        ],
    ),
}
QUICK = {
    "lost-chunk-state, zoo:hybrid (quick)": (
        "zoo:hybrid",
        8,
        ["--max-tokens", "4", "--prompt-logprobs", "--max-num-batched-tokens", "16", "--inject", "lost-chunk-state"],
    )
}
VLLM = {
    f"vLLM {arch}, {cell}": (arch, cell) for arch in ("Lfm2", "Lfm2Moe", "Zamba2") for cell in ("fp32", "fp32-chunk16")
}


def _lpf(*args, timeout=1800) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    env.setdefault("PYTHONPATH", str(ROOT / "src"))
    t = time.monotonic()
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("lpf")), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    return proc, time.monotonic() - t


def _workload(base: Path, n) -> Path:
    """`n` oracle prompts, or the zoo workload named `n` (240 items)."""
    sys.path.insert(0, str(ROOT / "src"))
    from lpf.zoo import registry

    path = base / f"w-{n}.jsonl"
    if isinstance(n, str):
        items = registry.workload_items(n, n=240)
        path.write_text("".join(json.dumps(i) + "\n" for i in items))
        return path
    items = registry.workload_items("oracle", seed=0, n=n)
    path.write_text("".join(json.dumps({"id": i["id"], "prompt": i["prompt"]}) + "\n" for i in items))
    return path


def _row(name: str, audit_s: float, run: Path) -> dict:
    proc, locate_s = _lpf("locate", run, "--json")
    if proc.returncode != 0:
        raise SystemExit(f"{name}: lpf locate failed:\n{proc.stderr[-2000:]}")
    doc = json.loads(proc.stdout)
    loc = doc.get("located") or {}
    return {
        "config": name,
        "audit_s": round(audit_s, 1),
        "locate_s": round(locate_s, 1),
        "ratio_to_target": round(locate_s / TARGET_S, 3),
        "ratio_to_audit": round(locate_s / audit_s, 2),
        "request_id": doc["request_id"],
        "located": loc.get("op"),
        "token": loc.get("token"),
        "suspect": doc["verdict"]["suspect"],
        "mamba_input_state": (doc.get("mamba") or {}).get("input_state"),
        "replay_reproduces": doc["replay"].get("reproduces"),
        "sentence": doc["sentence"],
    }


def _print(r: dict) -> None:
    print(
        f"{r['config']}: located {r['located']} at {r['token']} (suspect {r['suspect']}) in {r['locate_s']:.1f} s "
        f"({r['ratio_to_target']:.2f}x the {TARGET_S:.0f} s target; {r['ratio_to_audit']:.2f}x the {r['audit_s']:.1f} s "
        f"audit it locates)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--only", default=None, help="only the configurations whose name contains this")
    ap.add_argument("--keep", type=Path, default=None)
    args = ap.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="lpf-bench-locate-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        _measure(args, base)
    finally:
        if args.keep is None:  # the runs are measured, not kept, unless --keep says where
            shutil.rmtree(base, ignore_errors=True)


def _measure(args, base: Path) -> None:
    rows = []
    keep = (lambda name: args.only in name) if args.only else (lambda name: True)
    for name, (model, n, extra) in (QUICK if args.quick else CONFIGS).items():
        if not keep(name):
            continue
        run = base / name.replace(" ", "_").replace(":", "").replace(",", "")
        proc, audit_s = _lpf(
            "audit",
            "--engine",
            "builtin",
            "--model",
            model,
            "--workload",
            _workload(base, n),
            *extra,
            "--out",
            run,
            "--fail-on",
            "never",
        )
        if proc.returncode != 0:
            raise SystemExit(f"{name}: lpf audit failed:\n{proc.stderr[-2000:]}")
        rows.append(_row(name, audit_s, run))
        _print(rows[-1])
    if args.vllm and not args.quick:
        for name, (arch, cell) in ((k, v) for k, v in VLLM.items() if keep(k)):
            out = base / "conformance" / f"{arch}-{cell}"
            proc, conf_s = _lpf(
                "conformance",
                "--engine",
                "vllm",
                "--arch",
                arch,
                "--cell",
                cell,
                "--prompts",
                "4",
                "--max-tokens",
                "8",
                "--out",
                out,
                "--json",
                "--fail-on",
                "never",
            )
            if proc.returncode != 0:
                raise SystemExit(f"{name}: lpf conformance failed:\n{proc.stderr[-2000:]}")
            cell_doc = json.loads(proc.stdout)["cells"][0]
            rows.append(_row(name, conf_s, out / cell_doc["run_dir"]))
            _print(rows[-1])
    if not args.quick:
        dest = ROOT / "bench" / "results" / "locate.json"
        if args.only and dest.is_file():  # the other configurations' rows stay, in their order
            new = {r["config"]: r for r in rows}
            old = [r for r in json.loads(dest.read_text())["rows"] if r["config"] in {*CONFIGS, *VLLM}]
            rows = [new.pop(r["config"], r) for r in old] + list(new.values())
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        dest.write_text(
            json.dumps(stamp({"target_s": TARGET_S, "machine": os.uname().nodename, "rows": rows}), indent=1) + "\n"
        )
        print(f"wrote {dest}")


if __name__ == "__main__":
    main()
