"""The kept worker (`lpf.experiments.kept_cells`, `cell_server`): cells forked from one process that
imported torch once give what a fresh `lpf audit --spec -` process gives, and keep its isolation.

Real cells throughout: the built-in engine on tiny:jamba with the stale-state drill in a small cache
(so the findings are not all clean), rescored by the transformers reference, analysed.
- each cell's run directory (findings, tokens, reference, requests, summary) is identical to a fresh
  process's (`LPF_CELLS_FRESH_PROCESS=1` is the fresh side, which also shows the escape hatch starts no
  worker), on the built-in engine at one thread and on the transformers engine at two;
- a cell that crashes (SIGSEGV) fails alone, in one line, and the next cell runs in the same worker;
- a worker killed between cells, and one killed with a cell in flight, is replaced (the cell in flight
  is finished by the retry, the same as a fresh process's);
- the thread settings and seeds a cell sees are those of a fresh process (OMP_NUM_THREADS 1 and 2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import write_prompts
from lpf.core.errors import LpfError
from lpf.core.sampling import SamplingParams
from lpf.experiments.cells import cell_complete, run_cell
from lpf.experiments.kept_cells import FRESH_ENV, kept_cells, serves
from lpf.pipeline.spec import AuditSpec, RunSpec, with_run
from lpf.run.store import RunDir

pytestmark = pytest.mark.slow  # real cells: a fresh one costs 10-30 s here


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=5, n=24)
    return write_prompts(
        tmp_path_factory.mktemp("w") / "w.jsonl", [{"id": i["id"], "prompt": i["prompt"]} for i in items]
    )


def spec(workload: Path, out: Path, cache_mb: float = 0.3, n: int = 2) -> AuditSpec:
    return AuditSpec(
        run=RunSpec(
            engine="builtin",
            model="tiny:jamba",
            workload=str(workload),
            out=out,
            n=n,
            sampling=SamplingParams(max_tokens=8),
            engine_options={"inject": "stale-state", "cache_mb": cache_mb, "max_num_batched_tokens": 17},
        )
    )


def outputs(run_dir: Path) -> dict:
    """What a cell produced, without what differs between any two runs of it (the run id, the times)."""
    run = RunDir.open(run_dir)
    findings = json.loads((run_dir / "findings.json").read_text())
    findings.pop("run_id", None)
    keys = {"tokens": ["request_id", "position"], "reference": ["request_id", "position"], "requests": ["request_id"]}
    tables = {name: run.read(name).sort_by([(k, "ascending") for k in by]).to_pylist() for name, by in keys.items()}
    for r in tables["requests"]:  # wall-clock times of the engine's steps differ between any two runs
        for k in [k for k in r if k.startswith("t_")]:
            r.pop(k)
    summary = pq.read_table(run_dir / "summary.parquet").sort_by("request_id").to_pylist()
    return {"findings": findings, "summary": summary, **tables}


def _hf(workload: Path, out: Path, max_tokens: int) -> AuditSpec:
    return AuditSpec(
        run=RunSpec(
            engine="hf",
            model="tiny:jamba",
            workload=str(workload),
            out=out,
            sampling=SamplingParams(max_tokens=max_tokens),
        )
    )


# the tests' configuration (builtin, one thread, the drill on: flagged requests) and one more (the
# transformers engine at two threads, where matmuls split over the OpenMP team the fork must rebuild)
CONFIGS = {
    "builtin-1-thread": (
        "1",
        [(n, lambda w, o, mb=mb: spec(w, o, mb)) for n, mb in (("a", 0.3), ("b", 0.5), ("c", 4.0))],
    ),
    "hf-2-threads": ("2", [(n, lambda w, o, t=t: _hf(w, o, t)) for n, t in (("a", 6), ("b", 8))]),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_each_cell_is_what_a_fresh_process_gives(config, workload, tmp_path, monkeypatch):
    threads, cells = CONFIGS[config]
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    with kept_cells() as pool:
        for name, make in cells:
            run_cell(make(workload, tmp_path / "kept" / name), tmp_path / f"kept-{name}.log", name)
        assert pool.started == 1  # one worker served every cell
        monkeypatch.setenv(FRESH_ENV, "1")
        for name, make in cells:
            run_cell(make(workload, tmp_path / "fresh" / name), tmp_path / f"fresh-{name}.log", name)
        assert pool.started == 1  # the escape hatch: a process per cell, no worker asked
    for name, _ in cells:
        assert outputs(tmp_path / "kept" / name) == outputs(tmp_path / "fresh" / name), name
    if config.startswith("builtin"):
        counts = [outputs(tmp_path / "kept" / n)["findings"]["counts"] for n, _ in cells]
        assert sum(c["corrupt"] + c["divergent"] for c in counts) > 0  # flagged requests compared, not only clean ones
    log = (tmp_path / "kept-b.log").read_text()
    assert log.startswith(
        f"$ lpf audit --spec - --fail-on never\n# the same audit: lpf audit --engine {config.split('-')[0]}"
    )
    assert "run directory:" in log and "verdict:" in log  # the cell's own output, into its log


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    return t, box


def _wait_for(cond, timeout=300.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)


def test_a_crashing_cell_dies_alone_and_the_next_runs(workload, tmp_path):
    with kept_cells() as pool:
        run_cell(spec(workload, tmp_path / "first"), tmp_path / "first.log", "first")
        server = pool.server.pid
        t, box = _in_thread(lambda: run_cell(spec(workload, tmp_path / "crash"), tmp_path / "crash.log", "crash"))
        _wait_for(lambda: pool.server.cell_pid is not None)
        os.kill(pool.server.cell_pid, signal.SIGSEGV)
        t.join()
        assert isinstance(box.get("error"), LpfError)
        assert str(box["error"]).startswith("cell crash: lpf audit failed with exit code -11")
        assert "\n" not in str(box["error"])
        run_cell(spec(workload, tmp_path / "after"), tmp_path / "after.log", "after")
        assert pool.server.pid == server and pool.started == 1  # the worker outlived its cell
    assert cell_complete(tmp_path / "after") and not cell_complete(tmp_path / "crash")
    assert outputs(tmp_path / "after") == outputs(tmp_path / "first")  # nothing the crash left behind


def test_a_killed_worker_is_replaced(workload, tmp_path):
    with kept_cells() as pool:
        run_cell(spec(workload, tmp_path / "one"), tmp_path / "one.log", "one")
        first = pool.server.proc
        first.kill()  # between cells
        first.wait()
        run_cell(spec(workload, tmp_path / "two"), tmp_path / "two.log", "two")
        assert pool.started == 2 and pool.server.proc is not first
        # with a cell in flight: its process dies with the worker, a new worker finishes the run
        second = pool.server.proc
        big = spec(workload, tmp_path / "three", n=6)
        t, box = _in_thread(lambda: run_cell(big, tmp_path / "three.log", "three"))
        _wait_for(lambda: (tmp_path / "three" / "manifest.json").is_file())
        second.kill()
        t.join()
        assert "error" not in box, box.get("error")
        assert pool.started == 3
    log = (tmp_path / "three.log").read_text()
    assert "# the kept worker died (it exited with code -9)" in log
    assert "(finishing the interrupted run)" in log
    assert cell_complete(tmp_path / "three")
    fresh = subprocess.run(
        [sys.executable, "-m", "lpf", "audit", "--spec", "-", "--fail-on", "never"],
        input=with_run(big, out=tmp_path / "fresh").model_dump_json(),
        capture_output=True,
        text=True,
    )
    assert fresh.returncode == 0, fresh.stderr
    assert outputs(tmp_path / "three") == outputs(tmp_path / "fresh")


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_cell_sees_a_fresh_processs_threads_and_seeds(threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads(), torch.get_num_interop_threads())"],
        capture_output=True,
        text=True,
    )
    want = [int(x) for x in fresh.stdout.split()]
    with kept_cells() as pool:
        a, b = pool.probe(), pool.probe()
    assert [a["threads"], a["interop_threads"]] == want and a["omp_num_threads"] == threads
    assert a["server"] == b["server"] and a["pid"] != b["pid"]
    # each cell draws its own seed, as each fresh process does (lpf's runs seed what they draw)
    assert a["torch_initial_seed"] != b["torch_initial_seed"]


def test_a_changed_environment_gets_a_new_worker(monkeypatch):
    with kept_cells() as pool:
        first = pool.probe()["server"]
        monkeypatch.setenv("LPF_TEST_SOMETHING", "1")
        assert pool.probe()["server"] != first and pool.started == 2


def test_which_engines_a_kept_worker_serves(tmp_path, monkeypatch):
    monkeypatch.delenv(FRESH_ENV, raising=False)
    base = AuditSpec(run=RunSpec(engine="builtin", model="tiny:jamba", out=tmp_path / "r"))
    assert serves(base) is None
    assert serves(AuditSpec(run=RunSpec(engine="hf", model="tiny:jamba", out=tmp_path / "r"))) is None
    assert "runs a process per cell" in serves(AuditSpec(run=RunSpec(engine="vllm", model="tiny:jamba", out=tmp_path)))
    monkeypatch.setenv(FRESH_ENV, "1")
    assert serves(base) == f"{FRESH_ENV} is set"
