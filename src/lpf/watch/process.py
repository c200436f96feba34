"""Start `lpf watch` as a child process and wait until it proxies: for tests, benches and scripts.

Contract: `with watched(upstream, out, "--reference", "zoo:hybrid", ...) as w:` starts `lpf watch` on
127.0.0.1 and a free port, waits until GET /metrics answers 200 (raising `RuntimeError` with its log if
it exits or the timeout passes first), yields a `lpf.serve.process.ServedProcess` (`base_url` is the
proxy's) with `out` set, and stops it with SIGTERM on exit (SIGKILL after its stop timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from lpf.serve.process import ServedProcess, free_port


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def watched(upstream: str, out: Path, *args: str, timeout: float = 180.0, env: dict | None = None):
    port = free_port()
    exe = Path(sys.executable).with_name("lpf")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from lpf.cli import main; main()"]
    fd, log = tempfile.mkstemp(prefix="lpf-watch-", suffix=".log")
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    argv = [*cmd, "watch", "--upstream", upstream, "--listen", f"127.0.0.1:{port}", "--out", str(out), *map(str, args)]
    with os.fdopen(fd, "w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    w = ServedProcess(f"http://127.0.0.1:{port}", port, proc, Path(log))
    w.out = Path(out)
    try:
        deadline = time.monotonic() + timeout
        while not _up(f"{w.base_url}/metrics"):
            if proc.poll() is not None:
                raise RuntimeError(f"lpf watch exited with {proc.returncode} before it listened:\n{w.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"lpf watch not listening after {timeout:.0f} s:\n{w.log()[-3000:]}")
            time.sleep(0.2)
        yield w
    finally:
        w.stop()
        Path(log).unlink(missing_ok=True)
