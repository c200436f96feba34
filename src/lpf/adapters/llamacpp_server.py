"""One `llama-server` process on 127.0.0.1, started, waited for and stopped by the `llamacpp` engine.

Contract: `LlamaServer(binary, gguf, args, start_timeout_s).start()` picks a free port (the kernel
hands out an unused one; a server that still loses it to another process is started again on a new
one, at most three times), runs `binary -m GGUF --host 127.0.0.1 --port P ARGS` in its own session
with its output in a log file, and returns once `GET /health` answers 200 (503 while the model
loads). A server that exits first, or is not ready within `start_timeout_s`, is stopped and raises
LpfError quoting the last lines of its log. `stop()` ends it (SIGTERM to its process group, SIGKILL
after 10 s) and is safe to call twice; the log file stays (`log_path`) until `cleanup()`. Nothing
here knows what a completion is.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from lpf.core.errors import LpfError

HOST = "127.0.0.1"
_BIND_WORDS = ("couldn't bind", "address already in use", "failed to bind")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, binary: Path, gguf: Path, args: list[str], start_timeout_s: float = 120.0):
        self.binary, self.gguf, self.args = binary, gguf, list(args)
        self.start_timeout_s = start_timeout_s
        self.tmp = tempfile.TemporaryDirectory(prefix="lpf-llamacpp-")
        self.log_path = Path(self.tmp.name) / "llama-server.log"
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self, port: int) -> list[str]:
        return [str(self.binary), "-m", str(self.gguf), "--host", HOST, "--port", str(port), *self.args]

    def start(self) -> "LlamaServer":
        for _attempt in range(3):
            self.port = free_port()
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    self.command(self.port),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                self._wait_ready()
                return self
            except _PortLost:
                self.stop()
            except BaseException:  # a failed start or Ctrl-C while loading: no orphaned server
                self.stop()
                raise
        raise LpfError(f"llama-server could not bind a free port on {HOST} three times{self.log_tail()}")

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.start_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = self.log_tail()
                if any(w in tail.lower() for w in _BIND_WORDS):
                    raise _PortLost()
                raise LpfError(f"llama-server exited with code {code} before it was ready{tail}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise LpfError(
                    f"llama-server was not ready within {self.start_timeout_s:g} s "
                    f"(raise -E start_timeout_s=...){self.log_tail()}"
                )
            time.sleep(0.1)

    def log_tail(self, lines: int = 4) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        tail = " | ".join(ln.strip() for ln in text[-lines:] if ln.strip())
        return f"; llama-server log: {tail}" if tail else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)  # its own session: anything it started goes too
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def cleanup(self) -> None:
        self.stop()
        self.tmp.cleanup()


class _PortLost(Exception):
    """The chosen port was taken between choosing and binding it."""
