"""`lpf rescore --executor ray`: an actor pool of rescorers on Ray Data gives the local executor's
reference parts bit for bit and the same findings, commits whole requests only, and after a SIGKILL a
rerun gives every token exactly one reference row. One local Ray (2 CPUs) serves every test here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import lpf_main

KEY = [("request_id", "ascending"), ("position", "ascending")]


@pytest.fixture(scope="module")
def run_1k(tmp_path_factory) -> Path:
    """1,000 requests of the built-in engine with the 18-bit state offset wrap: corrupt and clean ones."""
    out = tmp_path_factory.mktemp("ray") / "run"
    proc = lpf_main(
        "run",
        "--engine",
        "builtin",
        "--model",
        "tiny:hybrid",
        "--workload",
        "zoo:oracle",
        "--n",
        2,
        "--max-tokens",
        6,
        "--inject",
        "offset-wrap:18",
        "--cache-mb",
        4,
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def _reference(run: Path) -> pa.Table:
    return pq.read_table(run / "reference").sort_by(KEY)


def _expected_tokens(run: Path) -> dict[str, int]:
    req = pq.read_table(run / "requests", columns=["request_id", "output_token_ids", "error"]).to_pylist()
    return {r["request_id"]: len(r["output_token_ids"]) for r in req if r["error"] is None and r["output_token_ids"]}


def _findings(lpf_cli, run: Path) -> dict:
    r = lpf_cli("analyze", run, "--json", "--fail-on", "never")
    assert r.code == 0, r.err
    return json.loads(r.out)


@pytest.mark.slow
def test_ray_executor_gives_the_local_parts_bit_for_bit(tmp_path, run_1k, ray_cluster, lpf_cli):
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    shutil.copytree(run_1k, local)
    shutil.copytree(run_1k, on_ray)
    assert lpf_cli("rescore", local, "--token-budget", 2048).code == 0
    r = lpf_cli("rescore", on_ray, "--executor", "ray", "--actors", 2, "--token-budget", 2048)
    assert r.code == 0, r.err
    assert len(list((on_ray / "reference").glob("part-*.parquet"))) >= 2  # several work units came back
    a, b = _reference(local), _reference(on_ray)
    assert a.num_rows == sum(_expected_tokens(run_1k).values()) > 4000
    # the Ray plan is the local plan (same batches, same order in each): every column, bit for bit
    assert a.equals(b)
    manifest = json.loads((on_ray / "manifest.json").read_text())
    assert manifest["reference"]["executor"] == "ray"
    findings = _findings(lpf_cli, local)
    assert findings["counts"]["corrupt"] > 0 and findings["counts"]["clean"] > 0
    assert _findings(lpf_cli, on_ray) == findings


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.slow
def test_sigkill_mid_ray_rescore_then_rerun_scores_every_token_once(tmp_path, run_1k, ray_cluster, lpf_cli):
    run = tmp_path / "run"
    shutil.copytree(run_1k, run)
    exe = Path(sys.executable).with_name("lpf")
    # the child joins this session's Ray (a real cluster's case: the driver dies, the cluster stays)
    proc = subprocess.Popen(
        [
            str(exe),
            "rescore",
            str(run),
            "--executor",
            "ray",
            "--ray-address",
            ray_cluster,
            "--actors",
            "1",
            "--token-budget",
            "256",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while not list((run / "reference").glob("part-*.parquet")):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no reference part in 300 s"
            time.sleep(0.02)
        kids = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in kids:  # what the child started itself (Ray's workers for it belong to the cluster)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    expected = _expected_tokens(run)
    before = _reference(run)
    scored = set(before.column("request_id").to_pylist())
    assert 0 < len(scored) < len(expected), "the kill must land mid-rescore"
    counts = before.group_by("request_id").aggregate([("position", "count")]).to_pylist()
    assert all(c["position_count"] == expected[c["request_id"]] for c in counts), "a request was committed in part"

    r = lpf_cli("rescore", run, "--executor", "ray", "--actors", 1, "--token-budget", 256)
    assert r.code == 0, r.err
    after = _reference(run)
    keys = list(zip(after.column("request_id").to_pylist(), after.column("position").to_pylist()))
    assert len(keys) == len(set(keys)) == sum(expected.values())
    assert set(keys) == {(rid, p) for rid, n in expected.items() for p in range(n)}
    assert after.filter(pa.compute.is_in(after.column("request_id"), value_set=pa.array(sorted(scored)))).equals(
        before
    ), "the rerun rewrote committed rows"


def test_without_ray_the_error_says_how_to_install_it(tmp_path, lpf_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is absent
    r = lpf_cli("rescore", tmp_path, "--executor", "ray")
    assert r.code == 2
    assert r.err.strip() == "error: --executor ray needs Ray Data: pip install 'logprob-forensics[ray]'"


def test_ray_options_need_the_ray_executor(tmp_path, lpf_cli):
    r = lpf_cli("rescore", tmp_path, "--actors", 2)
    assert r.code == 2 and "need --executor ray" in r.err
    assert lpf_cli("rescore", tmp_path, "--actors", 0).code == 2  # click's range check


def test_plan_keeps_the_local_batches_whole_in_units():
    from lpf.pipeline.rescore_ray import plan, unit_tokens
    from lpf.pipeline.batch_plan import plan_batches

    ids = [f"r{i:03d}" for i in range(300)]
    n_prompt = [(i * 37) % 90 + 1 for i in range(300)]
    n_output = [(i * 11) % 20 + 1 for i in range(300)]
    pending = pa.table(
        {"request_id": ids, "part": [i // 64 for i in range(300)], "n_prompt": n_prompt, "n_output": n_output}
    )
    target = unit_tokens(sum(n_prompt) + sum(n_output), actors=2, token_budget=512)
    batch_of, starts = plan(pending, 512, target)
    local = plan_batches([p + o for p, o in zip(n_prompt, n_output)], ids, 512)
    assert [sorted(i for i, b in enumerate(batch_of) if b == k) for k in range(len(local))] == [
        sorted(b) for b in local
    ]
    bounds = [0, *starts, len(local)]
    assert bounds == sorted(set(bounds)) and len(starts) >= 4  # >= 4 units per actor's worth of work
    for lo, hi in zip(bounds[:-2], bounds[1:-1]):  # every unit but the last holds >= target tokens
        assert sum(n_prompt[i] + n_output[i] for k in range(lo, hi) for i in local[k]) >= target


def test_committer_holds_a_request_back_until_all_its_rows_arrived(tmp_path):
    from lpf.pipeline.rescore_ray import _Committer
    from lpf.run import schema
    from lpf.run.store import RunDir

    run = RunDir.create(tmp_path / "run", {"run_id": "x"})

    def rows(rid, positions):
        n = len(positions)
        return schema.table(  # columns added to the schema later (ref_logsumexp) as nulls
            schema.REFERENCE,
            {
                "request_id": [rid] * n,
                "position": positions,
                "ref_logprob": [-1.0] * n,
                "ref_rank": [1] * n,
                "ref_entropy": [0.5] * n,
                "ref_top1_id": [3] * n,
                "ref_top1_logprob": [-1.0] * n,
                "ref_topk_ids": [[3]] * n,
                "ref_topk_logprobs": [[-1.0]] * n,
            },
        )

    ticks = []
    c = _Committer(run, {"a": 3, "b": 2}, ticks.append)
    c.add(pa.concat_tables([rows("b", [0, 1]), rows("a", [0, 1])]))  # Ray cut request a in two blocks
    assert run.read("reference").column("request_id").to_pylist() == ["b", "b"] and ticks == [2]
    c.add(rows("a", [2]))
    c.finish()
    assert sorted(run.read("reference").column("request_id").to_pylist()) == ["a", "a", "a", "b", "b"]
    assert ticks == [2, 3] and len(run.parts("reference")) == 2
