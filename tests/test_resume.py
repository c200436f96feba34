"""SIGKILL a run mid-way, resume it: every request exactly once, nothing lost, nothing redone."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import lpf_main, write_prompts


@pytest.mark.slow
def test_kill_and_resume(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": f"The fox {i} ran near the river"} for i in range(60)])
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("lpf")
    proc = subprocess.Popen(
        [
            str(exe),
            "run",
            "--engine",
            "hf",
            "--model",
            "tiny:llama",
            "--workload",
            str(prompts),
            "--n",
            "2",
            "--max-tokens",
            "24",
            "--out",
            str(out),
            "-E",
            "batch_size=4",
            "--part-size",
            "4",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 300
    while len(list((out / "requests").glob("part-*.parquet"))) < 3:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "run never committed 3 parts"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = pq.read_table(out / "requests").column("request_id").to_pylist()
    assert 12 <= len(before) < 120, "the kill must land mid-run"
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"

    r = lpf_main("run", "--resume", out)
    assert r.returncode == 0, r.stderr
    requests = pq.read_table(out / "requests")
    ids = requests.column("request_id").to_pylist()
    assert len(ids) == len(set(ids)) == 120
    assert set(before) <= set(ids)
    assert sorted(requests.column("seq").to_pylist()) == list(range(120))
    tokens = pq.read_table(out / "tokens")
    keys = list(zip(tokens.column("request_id").to_pylist(), tokens.column("position").to_pylist()))
    assert len(keys) == len(set(keys)), "a token row was written twice"
    lengths = {r["request_id"]: len(r["output_token_ids"]) for r in requests.to_pylist()}
    assert len(keys) == sum(lengths.values())
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"

    # a finished run resumed again does nothing, and the resumed run analyses like any other
    r = lpf_main("run", "--resume", out)
    assert r.returncode == 0 and pq.read_table(out / "requests").num_rows == 120
    r = lpf_main("rescore", out)
    assert r.returncode == 0, r.stderr
    r = lpf_main("analyze", out, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["counts"]["clean"] == 120
