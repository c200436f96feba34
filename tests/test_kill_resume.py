"""SIGKILL `lpf run`, `lpf rescore` and `lpf sweep` at many points, then resume: every request and token
row exactly once, and greedy outputs (and reference scores) equal to an uninterrupted run's.

Kill points are spread over each command's life: while it starts (imports, model load), as soon as the
run directory appears, and after each of several part commits (the store writes tokens before
requests, reference parts one batch at a time, so kills land between and inside those writes). A
killed sweep must not leave its running cell behind (the child dies with it and the run directory's
lock refuses a second writer), so the rerun that resumes it never interleaves with an orphan.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import lpf_main, write_prompts

pytestmark = pytest.mark.slow

EXE = str(Path(sys.executable).with_name("lpf"))
N = 36
RUN_ARGS = ["--model", "zoo:hybrid", "--max-tokens", "6", "--part-size", "2", "-E", "max_num_seqs=4"]


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=3, n=N)
    return write_prompts(
        tmp_path_factory.mktemp("kill") / "w.jsonl", [{"id": it["id"], "prompt": it["prompt"]} for it in items]
    )


def _parts(d: Path, table: str) -> int:
    return len(list((d / table).glob("part-*.parquet"))) if (d / table).is_dir() else 0


def _kill_at(cmd: list[str], trigger, timeout: float = 120) -> bool:
    """Start `cmd`, SIGKILL it when `trigger()` turns true; True when the kill landed on a live process."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and not trigger():
            assert time.monotonic() < deadline, "the command neither finished nor reached its kill point"
            time.sleep(0.005)
        landed = proc.poll() is None
        if landed:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if not landed:
            assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]
        return landed
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def after(seconds: float):
    """A kill point `seconds` after the command starts (imports, model load: cheap to hit)."""
    state = {}

    def go():
        state.setdefault("t0", time.monotonic())
        return time.monotonic() - state["t0"] >= seconds

    return go


def parts_more(count, k: int):
    """A kill point once `count()` (committed parts) has grown by k since the command started."""
    state = {}

    def go():
        state.setdefault("base", count())
        return count() >= state["base"] + k

    return go


def _exactly_once(d: Path) -> dict:
    req = pq.read_table(d / "requests").to_pylist()
    ids = [r["request_id"] for r in req]
    assert len(ids) == len(set(ids)) == N
    tok = pq.read_table(d / "tokens")
    keys = list(zip(tok.column("request_id").to_pylist(), tok.column("position").to_pylist()))
    assert len(keys) == len(set(keys)) == sum(len(r["output_token_ids"]) for r in req)
    return {r["request_id"]: r["output_token_ids"] for r in req}


def _reference(d: Path) -> dict:
    ref = pq.read_table(d / "reference").to_pylist()
    keys = [(r["request_id"], r["position"]) for r in ref]
    assert len(keys) == len(set(keys)), "a reference row was written twice"
    return {(r["request_id"], r["position"]): r["ref_logprob"] for r in ref}


def _kill_and_resume_until_done(triggers, start: list[str], resume: list[str], d: Path, done) -> int:
    kills = 0
    for trigger in triggers:
        if done():
            break
        cmd = resume if (d / "manifest.json").is_file() else start
        kills += _kill_at(cmd, trigger)
    while not done():  # the rest, unkilled: in this process (the same command, no start-up to pay)
        cmd = resume if (d / "manifest.json").is_file() else start
        r = lpf_main(*cmd[1:])
        assert r.returncode == 0, r.stderr[-2000:]
    return kills


def test_sigkill_run_rescore_and_sweep_at_20_points_then_resume(workload, tmp_path):
    base = tmp_path / "base"
    r = lpf_main("run", *RUN_ARGS, "--workload", workload, "--out", base)
    assert r.returncode == 0, r.stderr
    expected = _exactly_once(base)

    # lpf run
    run = tmp_path / "run"
    start = [EXE, "run", *RUN_ARGS, "--workload", str(workload), "--out", str(run)]

    def run_done():
        return (run / "manifest.json").is_file() and json.loads((run / "manifest.json").read_text())[
            "status"
        ] == "complete"

    run_parts = lambda: _parts(run, "requests")  # noqa: E731
    points = [
        after(0.2),
        after(0.6),
        after(1.2),
        lambda: (run / "manifest.json").is_file(),
        parts_more(run_parts, 1),
        parts_more(run_parts, 2),
        parts_more(run_parts, 1),
        parts_more(run_parts, 3),
    ]
    kills = _kill_and_resume_until_done(points, start, [EXE, "run", "--resume", str(run)], run, run_done)
    assert _exactly_once(run) == expected  # greedy: the same tokens as the uninterrupted run

    # lpf rescore (small batches: many reference parts to land between)
    r = lpf_main("rescore", base, "--token-budget", 64)
    assert r.returncode == 0, r.stderr
    want = _reference(base)
    shutil.rmtree(run / "reference")
    (run / "reference").mkdir()
    rescore = [EXE, "rescore", str(run), "--token-budget", "64"]

    def rescored():
        return len(want) == sum(pq.ParquetFile(p).metadata.num_rows for p in (run / "reference").glob("part-*.parquet"))

    ref_parts = lambda: _parts(run, "reference")  # noqa: E731
    points = [
        after(0.3),
        after(1.0),
        after(2.0),
        parts_more(ref_parts, 1),
        parts_more(ref_parts, 2),
        parts_more(ref_parts, 1),
        parts_more(ref_parts, 2),
    ]
    kills += _kill_and_resume_until_done(points, rescore, rescore, run, rescored)
    got = _reference(run)
    assert got.keys() == want.keys() and max(abs(got[k] - want[k]) for k in want) < 1e-5

    # lpf sweep: two cells, each its own `lpf audit` child
    sweep = tmp_path / "sweep"
    cmd = [
        EXE,
        "sweep",
        "--knob",
        "cache-mb=4,8",
        *RUN_ARGS,
        "--workload",
        str(workload),
        "--out",
        str(sweep),
        "--no-attribution",
        "--fail-on",
        "never",
    ]

    def cell_parts():
        return sum(_parts(c, t) for c in (sweep / "cells").glob("*") for t in ("requests", "reference"))

    def sweep_done():
        doc = sweep / "sweep.json"
        return doc.is_file() and len(json.loads(doc.read_text())["cells"]) == 2

    points = [after(0.5), parts_more(cell_parts, 2), parts_more(cell_parts, 5), after(1.5), parts_more(cell_parts, 4)]
    kills += _kill_and_resume_until_done(points, cmd, cmd, sweep, sweep_done)
    time.sleep(0.5)
    orphans = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, str(sweep))]
    assert orphans == [], "a killed sweep left a cell running"
    for cell in (sweep / "cells").iterdir():
        assert _exactly_once(cell) == expected
        f = json.loads((cell / "findings.json").read_text())
        assert f["run_complete"] and f["counts"]["clean"] + f["counts"]["noise"] == N
    assert kills >= 20, kills


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
