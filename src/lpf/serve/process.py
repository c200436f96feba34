"""Start `lpf serve` as a child process and wait until it is healthy: for tests, benches and scripts.

Contract: `with served("--model", "zoo:hybrid", "--cache-mb", "12") as s:` starts the installed `lpf
serve` on 127.0.0.1 and a free port (unless `--port` is among the arguments), waits until GET /health
answers 200 (raising `RuntimeError` with the server's log if it exits or the timeout passes first),
yields a `ServedProcess` (`base_url`, `port`, `proc`, `log_path`), and on exit stops it with SIGTERM
(SIGKILL after `stop_timeout`). `s.stop()` may be called earlier; it returns (exit code, log text).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServedProcess:
    base_url: str  # http://127.0.0.1:PORT (OpenAI clients add /v1)
    port: int
    proc: subprocess.Popen
    log_path: Path
    stop_timeout: float = 30.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, self.log()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def lpf_child(
    argv: list[str], port: int, probe: str, ready: tuple[str, str], timeout: float, env: dict | None, prefix: str
) -> Iterator[ServedProcess]:
    """Run `lpf ARGV` (the installed script, else this interpreter), wait until GET `probe` on its port answers
    200, yield it, stop it on exit. `ready`: the words of the two errors ("before it was healthy", "not
    healthy"), so each command says what it waits for. Shared by `served` and `lpf.watch.process.watched`."""
    exe = Path(sys.executable).with_name("lpf")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from lpf.cli import main; main()"]
    fd, log = tempfile.mkstemp(prefix=prefix, suffix=".log")
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with os.fdopen(fd, "w") as log_file:
        proc = subprocess.Popen([*cmd, *argv], stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    s = ServedProcess(f"http://127.0.0.1:{port}", port, proc, Path(log))
    name = f"lpf {argv[0]}"
    try:
        deadline = time.monotonic() + timeout
        while not _answers(f"{s.base_url}{probe}"):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} {ready[0]}:\n{s.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} {ready[1]} after {timeout:.0f} s:\n{s.log()[-3000:]}")
            time.sleep(0.2)
        yield s
    finally:
        s.stop()
        Path(log).unlink(missing_ok=True)


@contextmanager
def served(*args: str, timeout: float = 180.0, env: dict | None = None) -> Iterator[ServedProcess]:
    args = [str(a) for a in args]
    if "--port" in args:
        port = int(args[args.index("--port") + 1])
    else:
        port = free_port()
        args += ["--port", str(port)]
    argv = ["serve", "--host", "127.0.0.1", *args]
    with lpf_child(argv, port, "/health", ("before it was healthy", "not healthy"), timeout, env, "lpf-serve-") as s:
        yield s
