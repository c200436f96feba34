"""The kept worker: an experiment's cells forked from one process that has imported torch once.

Contract:
- `with kept_cells():` around an experiment's cells (the sweep's, the shrink's) makes `cells.run_cell`
  run each cell `serves` as a fork of one long-lived server (`lpf.experiments.cell_server`, started on
  the first such cell, stopped when the block ends), instead of a fresh `python -m lpf audit --spec -`
  that pays ~4 s of torch, transformers and lpf imports before its first step. The cell is still its
  own process: same audit, same log, same exit codes, same run directory, and a cell that crashes or
  leaks state dies alone (the server only forks; it never runs a cell itself).
- `serves(spec)` is None when a kept worker runs this spec, else why not: the engines `builtin` and
  `hf` with the local rescorer only, since theirs is the whole cell in lpf's own interpreter. vLLM runs
  in its own venv and worker process (the start-up to save is vLLM's, which a torch server here cannot
  hold; `lpf conformance` keeps vLLM workers itself), openai/sglang/llama.cpp cells start or reach a
  server of their own, and the Ray executor starts a Ray instance: those keep a process per cell.
  `LPF_CELLS_FRESH_PROCESS=1` in the environment keeps a process per cell for every engine.
- `run(spec, log) -> int` is the cell's exit code (as `subprocess` gives it). A server that dies with
  a cell in flight raises `WorkerDied` once the cell's process is gone (it dies with the server), and
  the server is replaced by the next `run`: `cells.run_cell` retries the cell once (the resume rule
  finishes what the first try started). A server that started a thread of its own while learning the
  cells' imports is replaced by one that learns nothing; a server that cannot start says why in one
  `LpfError` line.
- A server runs under the environment it was started with: an experiment whose environment changed
  since gets a new one (the cell sees exactly the environment a fresh process would).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lpf.core.errors import LpfError

FRESH_ENV = "LPF_CELLS_FRESH_PROCESS"


class WorkerDied(Exception):
    """The kept worker ended while a cell ran (killed, or crashed outside any cell)."""


def serves(spec) -> str | None:
    if os.environ.get(FRESH_ENV, "") not in ("", "0"):
        return f"{FRESH_ENV} is set"
    from lpf.adapters import capability

    if not capability(spec.run.engine, "kept_worker", False):
        return f"engine {spec.run.engine} runs a process per cell"
    if spec.rescore.executor != "local":
        return f"the {spec.rescore.executor} executor runs a process per cell"
    if not hasattr(os, "fork"):
        return "this platform cannot fork"
    return None


def cell_env() -> dict:
    """The environment a cell runs under, fresh or forked (a server started under another is replaced)."""
    return dict(os.environ, PYTHONUNBUFFERED="1")


class Server:
    """One `cell_server` process and its two pipes."""

    def __init__(self, env: dict, learn: bool):
        self.env, self.learn = env, learn
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        self._errors = tempfile.TemporaryFile()  # its own stderr: the reason when it cannot start
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lpf.experiments.cell_server", str(req_r), str(rep_w), "1" if learn else "0"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # never a terminal: consoles made at import see what a cell's log is
                stderr=self._errors,
                pass_fds=(req_r, rep_w),
                env=env,
            )
        finally:
            os.close(req_r)
            os.close(rep_w)
        self._send = os.fdopen(self._req_w, "w", buffering=1)
        self._recv = os.fdopen(self._rep_r, "r")
        self.cell_pid: int | None = None  # the cell in flight (tests kill it)
        hello = self._read()
        if hello is None or not hello.get("ready"):
            why = self._last_error() or "it exited before it was ready"
            self.close()
            raise LpfError(f"the kept worker did not start ({why}); {FRESH_ENV}=1 runs each cell in its own process")
        self.pid = hello["pid"]

    def _read(self) -> dict | None:
        line = self._recv.readline()
        return json.loads(line) if line else None

    def _last_error(self) -> str:
        self._errors.seek(0)
        lines = [ln.strip() for ln in self._errors.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, req: dict) -> dict:
        """Sends one request; returns the server's final answer (`rc`, or `unsafe`)."""
        try:
            self._send.write(json.dumps(req) + "\n")
            self._send.flush()
        except (BrokenPipeError, OSError):
            raise WorkerDied(self._died()) from None
        while True:
            msg = self._read()
            if msg is None:
                why = self._died()
                if self.cell_pid is not None:
                    _wait_gone(self.cell_pid)  # it dies with the server: no second writer when the retry starts
                self.cell_pid = None
                raise WorkerDied(why)
            if "pid" in msg:
                self.cell_pid = msg["pid"]
                continue
            self.cell_pid = None
            return msg

    def _died(self) -> str:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        return f"it exited with code {rc}" + (f": {self._last_error()}" if self._last_error() else "")

    def close(self) -> None:
        for f in ("_send", "_recv"):
            with contextlib.suppress(Exception):
                getattr(self, f).close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=5)  # end of its requests: it returns from its loop
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._errors.close()


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        if Path(f"/proc/{pid}/stat").is_file():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                    return  # a zombie holds no file and no lock
        time.sleep(0.05)


class Pool:
    """The kept worker of one `with kept_cells():` block (one server at a time, replaced when needed)."""

    def __init__(self):
        self.server: Server | None = None
        self.learn = True
        self.started = 0  # servers started (tests: a killed one is replaced)
        self._lock = threading.Lock()

    def _current(self) -> Server:
        env = cell_env()
        if self.server is not None and (not self.server.alive() or self.server.env != env):
            self.server.close()
            self.server = None
        if self.server is None:
            self.server = Server(env, self.learn)
            self.started += 1
        return self.server

    def request(self, req: dict) -> dict:
        with self._lock:
            for _ in range(2):
                server = self._current()
                try:
                    answer = server.request(req)
                except WorkerDied:
                    server.close()
                    self.server = None
                    raise
                if "unsafe" not in answer:
                    return answer
                server.close()  # an import it learned started a thread: forks of it are not safe
                self.server = None
                if not self.learn:
                    raise LpfError(f"{answer['unsafe']}: {FRESH_ENV}=1 runs each cell in its own process")
                self.learn = False
            raise AssertionError("unreachable")

    def run(self, spec, log: Path) -> int:
        return self.request({"spec": spec.model_dump_json(), "log": str(Path(log).resolve()), "cwd": os.getcwd()})["rc"]

    def probe(self) -> dict:
        return self.request({"probe": True, "cwd": os.getcwd()})["probe"]

    def close(self) -> None:
        with self._lock:
            if self.server is not None:
                self.server.close()
                self.server = None


_active: list[Pool] = []


@contextlib.contextmanager
def kept_cells():
    """Cells run inside this block share one kept worker (see the module's contract); nested blocks share the outer one."""
    if _active:
        yield _active[-1]
        return
    pool = Pool()
    _active.append(pool)
    try:
        yield pool
    finally:
        _active.remove(pool)
        pool.close()


def active() -> Pool | None:
    return _active[-1] if _active else None
