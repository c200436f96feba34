"""Start `lpf watch` as a child process and wait until it proxies: for tests, benches and scripts.

Contract: `with watched(upstream, out, "--reference", "zoo:hybrid", ...) as w:` starts `lpf watch` on
127.0.0.1 and a free port, waits until GET /metrics answers 200 (raising `RuntimeError` with its log if
it exits or the timeout passes first), yields a `lpf.serve.process.ServedProcess` (`base_url` is the
proxy's) with `out` set, and stops it with SIGTERM on exit (SIGKILL after its stop timeout).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from lpf.serve.process import free_port, lpf_child


@contextmanager
def watched(upstream: str, out: Path, *args: str, timeout: float = 180.0, env: dict | None = None):
    port = free_port()
    argv = ["watch", "--upstream", upstream, "--listen", f"127.0.0.1:{port}", "--out", str(out), *map(str, args)]
    with lpf_child(argv, port, "/metrics", ("before it listened", "not listening"), timeout, env, "lpf-watch-") as w:
        w.out = Path(out)
        yield w
