"""Start the `vllm` adapter's worker by a fork of a vLLM already imported (`vllm_zygote_server.py`).

Contract: `spawn(python, config_path, env, log, results_fd, cwd) -> WorkerProcess | None`. It finds
(or starts, detached in its own session) the zygote server for this interpreter and environment, asks
it for a worker on `config_path` with `env` and `cwd`, hands it a fresh stdin pipe, `log` (its stdout
and stderr) and `results_fd` (the write end of the results pipe; the caller closes its copy), and
returns a `subprocess.Popen`-like handle: `pid`, `args`, `stdin` (text), `returncode`, `poll()`,
`wait(timeout)` (raises `subprocess.TimeoutExpired`), `kill()`, `terminate()`, `send_signal()`. The
worker is a session leader, as the adapter's own Popen makes it, so `os.killpg(pid, ...)` reaches
it. Its exit code comes from the server, which reaps it.
None when a zygote cannot serve (turned off with LPF_VLLM_ZYGOTE=0, the server did not come up,
refused, or died): the caller starts the worker as a plain process, as before.
Why: each worker otherwise imports vLLM afresh (~9 CPU s here, three times what building the engine
costs), and a sweep, a shrink on vLLM, a conformance matrix or the test suite start dozens.
A server is keyed by the interpreter, the user, the code it loads (its own, the worker's and
`lpf.core.fresh_process`), and the environment variables read while vLLM and torch import
(`IMPORT_ENV`); any other variable reaches the worker as the caller set it. Servers live on abstract
unix sockets (no file to clean up) and exit after `IDLE_S` seconds with no worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SERVER = Path(__file__).with_name("vllm_zygote_server.py")
WORKER = Path(__file__).with_name("vllm_worker.py")
FRESH_PROCESS = Path(__file__).parents[1] / "core" / "fresh_process.py"  # the server loads it by path
IDLE_S = 60.0  # a server with no worker and no request for this long exits
START_S = 300.0  # vLLM's import under load; a server not up by then is not waited for
# variables that can be read while vLLM, torch and their dependencies import (the server's own
# environment fixes them for every worker it forks), minus the ones lpf sets per run (read later)
IMPORT_ENV = re.compile(
    r"^(VLLM_|TORCH|PYTORCH_|OMP_|MKL_|KMP_|OPENBLAS_|NUMBA_|TRITON_|CUDA|HF_|TRANSFORMERS_|LD_|PYTHON)"
)
PER_RUN = {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "PYTHONUNBUFFERED"}


def enabled() -> bool:
    return os.environ.get("LPF_VLLM_ZYGOTE", "1") != "0"


def import_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if IMPORT_ENV.match(k) and k not in PER_RUN and not k.startswith("LPF_")}


def server_name(python: Path, env: dict) -> str:
    # the server's and the worker's code are part of the key: a server forks the code it loaded, and
    # two checkouts of lpf may share vLLM's interpreter
    code = hashlib.sha1(b"".join(f.read_bytes() for f in (SERVER, WORKER, FRESH_PROCESS))).hexdigest()
    key = json.dumps([str(python), os.getuid(), code, sorted(import_env(env).items())])
    return f"lpf-vllm-zygote-{hashlib.sha1(key.encode()).hexdigest()[:16]}"


def _connect(name: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0" + name)
        return s
    except OSError:
        s.close()
        return None


def _server(python: Path, env: dict, name: str) -> socket.socket | None:
    """A connection to the named server, started here when none answers."""
    conn = _connect(name)
    if conn is not None:
        return conn
    base = {k: v for k, v in env.items() if k not in PER_RUN and not k.startswith("LPF_")}
    base["PYTHONUNBUFFERED"] = "1"  # the streams vLLM's loggers hold: a worker's log lines reach its file at once
    log = open(Path(tempfile.gettempdir()) / f"{name}.log", "ab")
    try:
        proc = subprocess.Popen(
            [str(python), str(SERVER), name, str(IDLE_S)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=base,
            cwd="/",
            start_new_session=True,  # it outlives this process: the next one reuses it
        )
    finally:
        log.close()
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        conn = _connect(name)
        if conn is not None:
            return conn
        if proc.poll() is not None:  # exited: another server won the name, or this one could not serve
            return _connect(name)
        time.sleep(0.2)
    return None


def spawn(python: Path, config_path: Path, env: dict, log, results_fd: int, cwd: str | None = None):
    if not enabled():
        return None
    name = server_name(python, env)
    conn = _server(python, env, name)
    if conn is None:
        return None
    stdin_r, stdin_w = os.pipe()
    request = {"argv": [str(config_path)], "env": env, "cwd": cwd or os.getcwd()}
    reply, rest = None, b""
    try:
        socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], [stdin_r, log.fileno(), results_fd])
        reply, rest = _first_line(conn, timeout=60.0)
    except (OSError, ValueError):
        pass
    finally:
        os.close(stdin_r)
    if not reply or "pid" not in reply:
        conn.close()
        os.close(stdin_w)
        return None
    # `rest`: the exit word, when it came with the pid (a worker that died at once)
    return WorkerProcess(conn, reply["pid"], [str(python), str(SERVER), name, str(config_path)], stdin_w, rest)


def _first_line(conn: socket.socket, timeout: float | None) -> tuple[dict | None, bytes]:
    """The server's reply to a request and what came after it, or (None, b"") when it closed first."""
    conn.settimeout(timeout)
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return None, b""
        data += chunk
    line, _, rest = data.partition(b"\n")
    return json.loads(line), rest


class WorkerProcess:
    """A zygote-forked worker, handled as a `subprocess.Popen`."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], stdin_fd: int, buffered: bytes = b""):
        self.conn, self.pid, self.args = conn, pid, args
        self.stdin = os.fdopen(stdin_fd, "w")
        self.returncode: int | None = None
        self._buf = buffered

    def _take_exit(self, timeout: float | None) -> None:
        """Wait up to `timeout` seconds (None: for ever) for the server's word that the worker exited."""
        if self.returncode is not None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.conn is not None and not self._buf.endswith(b"\n"):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.conn.settimeout(left)
            try:
                chunk = self.conn.recv(4096)
            except (BlockingIOError, TimeoutError, socket.timeout):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            except OSError:
                chunk = b""
            if not chunk:  # the server went away: from here on /proc says whether the worker lives
                self.conn.close()
                self.conn = None
            self._buf += chunk
        if self._buf.endswith(b"\n"):
            self.returncode = int(json.loads(self._buf)["exit"])
            if self.conn is not None:
                self.conn.close()
                self.conn = None
            return
        while _alive(self.pid):
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.1)
        self.returncode = 1  # reaped by someone else: its code is lost, and it did not finish cleanly here

    def poll(self) -> int | None:
        try:
            self._take_exit(0.0)
        except subprocess.TimeoutExpired:
            return None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._take_exit(timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
