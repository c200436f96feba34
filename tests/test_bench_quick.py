"""Every bench under bench/ runs: its `--quick` mode (tiny sizes, seconds, nothing timed asserted, no
results file) completes in a subprocess and prints its ratio lines, so a schema or API change can
never again leave `make bench` broken with nothing noticing (issue 27: bench/report.py died on run
schema v2 for a day). The vLLM benches skip without `.venv-vllm`, as the vLLM tests do.

Measured on this 2-core machine (another suite running beside it): analysis ~4 s; nondeterminism, rescore,
report ~8-10 s each; engine, locate ~12-15 s, detection, bugs ~20 s, spec_speed ~27 s and cells ~65 s (two sweeps, two
shrinks and the shrink's source audit: ~10 process start-ups, a process per cell being its baseline)
(process start-ups: one `lpf run` or `lpf audit` costs ~6-8 s here); the vLLM ones ~13-40 s each (vLLM
start-ups; conformance also asks vLLM's registry), so all but the analysis smoke are `slow`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_vllm import _vllm_python, needs_vllm

ROOT = Path(__file__).resolve().parents[1]

# bench -> (extra argv, the lines it must print)
BENCHES = {
    "analysis": (
        [],
        [
            r"analysis \(in memory, run-level test on\): .* tokens/s \([\d.]+x the 15M tokens/s target",
            r"run-level test: .*: [\d.]+x",
            r"scale \(zip\): .*\([\d.]+x the 5M tokens/s target\).*findings identical: True",
        ],
    ),
    "report": ([], [r"report for 2,000 requests .* MB, [\d.]+x\)"]),
    "rescore": (
        [],
        [
            r"\| speed, output tokens/s: .*RL-like\) \| \d+ \| \d+ \| [\d.]+x \|",
            r"\| speed, output tokens/s: .*audit-like\) \| \d+ \| \d+ \| [\d.]+x \|",
            r"\| memory, peak RSS above the model: .* \| [\d.]+ \|",
        ],
    ),
    "engine": ([], [r"\| lpf builtin \(continuous batching\) \| \d+ \| [\d.]+x \|"]),
    "detection": (
        [],
        [
            r"AUC, shipped:",
            r"\| quantize-weights:4 \| [\d.]+ \|",
            r"false alarms at p < 1e-06",
            r"tokens only, AUC, unseeded:",
            r"\| greedy quantize-weights:4 \| [\d.]+ \|",
        ],
    ),
    "nondeterminism": (
        ["--out", "{tmp}"],
        [r"\| builtin seqs=1 budget=512 \| \d+ \| \d+ \|", r"false alarms: [\d.]+ of requests, [\d.]+ of runs"],
    ),
    "vllm_trace": ([], [r'\{"drill": \{"cpu": [\d.]+, "wall": [\d.]+\}\}']),
    "conformance": ([], [r"conformance cell: .* in-process: [\d.]+x"]),
    "vllm_trace_profile": (["src/lpf/zoo/data/models/hybrid"], [r'"ratio_cpu": [\d.]+, "ratio_wall": [\d.]+']),
    "bugs": (
        ["--out", "{tmp}"],
        [
            r"\| stale-conv-on-reuse \| 240 \| \d+ \| 1\.000 \| 0 \| yes \(first_slot_used_before\) \| 1\.000 \((\d+)/\1\) \|"
        ],
    ),
    "cells": (
        [],
        [
            r"sweep \(builtin, tiny:jamba\), 2 cells: .*: [\d.]+x overall, [\d.]+x per cell \(target 2x\); findings identical: True",
            r"shrink \(builtin, tiny:jamba-longmem\), \d+ cells: .*: [\d.]+x overall, .*; same minimum: True",
        ],
    ),
    "watch": ([], [r"\| proxy 1% \| [\d.]+ \| [\d.]+ \| -?[\d.]+ \| \d+ \| [\d.]+x \| [\d.]+ \|"]),
    "watch_detection": (
        [],
        [
            r"swap \(float32 -> quantize-weights:4, .*\): \d+/\d+ windows alarmed before the swap; .* delay \d+ swapped",
            r"clean float32: \d+/\d+ windows alarmed over \d+ scored tokens",
        ],
    ),
    "spec_speed": (
        ["--out", "{tmp}"],
        [r"zoo:hybrid, MLP padded to 1024 ngram:4: drafted \d+, accepted \d+, steps \d+, window .* identical 2/2"],
    ),
    "locate": (
        [],
        [
            r"lost-chunk-state, zoo:hybrid \(quick\): located L0\.\S+ at prompt token \d+ \(suspect engine\) "
            r"in [\d.]+ s \([\d.]+x the 60 s target"
        ],
    ),
}


def _run(name: str, tmp: Path) -> subprocess.CompletedProcess:
    args = [a.format(tmp=tmp) for a in BENCHES[name][0]]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    python = sys.executable
    if name == "vllm_trace_profile":  # runs inside vLLM's own interpreter, with the plugin installed
        python, env["VLLM_CPU_KVCACHE_SPACE"] = str(_vllm_python()), "1"
        env.pop("PYTHONPATH")
    return subprocess.run(
        [python, str(ROOT / "bench" / f"{name}.py"), *args, "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _check(name: str, tmp: Path) -> None:
    results = ROOT / "bench" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.glob("*")}
    proc = _run(name, tmp)
    assert proc.returncode == 0, f"bench/{name}.py --quick failed:\n{proc.stderr[-3000:]}"
    for pattern in BENCHES[name][1]:
        assert re.search(pattern, proc.stdout), (
            f"bench/{name}.py --quick did not print {pattern!r}:\n{proc.stdout[-3000:]}"
        )
    assert {p: p.stat().st_mtime_ns for p in results.glob("*")} == before, "--quick must not write bench/results"


HELPERS = {
    "provenance",
    "vllm_openai",
}  # modules the benches share (provenance: the commit a result measured; vllm_openai: vLLM's server)


def test_every_bench_has_a_smoke_run():
    assert set(BENCHES) == {p.stem for p in (ROOT / "bench").glob("*.py")} - HELPERS


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_analysis_bench_quick(tmp_path):
    _check("analysis", tmp_path)


@pytest.mark.slow  # 8-25 s each: process start-ups (lpf run, lpf audit, a tokenizer, torch)
@pytest.mark.parametrize(
    "name",
    [
        "report",
        "rescore",
        "engine",
        "detection",
        "nondeterminism",
        "locate",
        "bugs",
        "cells",
        "watch",
        "watch_detection",
        "spec_speed",
    ],
)
def test_bench_quick(name, tmp_path):
    _check(name, tmp_path)


@pytest.mark.slow  # vLLM start-ups: 30 s to 2 min each
@needs_vllm
@pytest.mark.parametrize("name", ["vllm_trace", "conformance", "vllm_trace_profile"])
def test_vllm_bench_quick(name, tmp_path):
    _check(name, tmp_path)
