"""Keeps the scoring process alive and turns its windows into metrics, alarms and the --fail-after exit.

Contract: `Supervisor(run_path, scorer_args, metrics, on_window, webhook, fail_after, stop)`; `start()`
starts `python -m lpf.watch.scorer` as a child (its own process: a crash or a kill of the scorer never
touches the proxy) and a thread that, every `poll` seconds, restarts the child if it died (counted in
`restarts` and `lpf_watch_scorer_restarts`) after a backoff that doubles from `backoff` seconds up to
`backoff_cap` with each consecutive quick failure (one that lived under `healthy_after` seconds; a longer
life resets the count), and gives up after `give_up_after` consecutive quick failures: no more restarts,
`gave_up` True, `lpf_watch_scorer_gave_up` 1 and one ERROR log line (`give_up_record`), the proxy and the
recording going on (`lpf_watch_scorer_up` is 1 while a scorer runs); reads the windows appended to `live/windows.jsonl` since
the last look, updates the metrics, calls `on_window(window)` for each (the command line renders the
one structured line per alarm), POSTs each alarmed window as JSON to `webhook` (a failed POST is
logged, never retried on the request path), POSTs an `upstream-failing` window as
`lpf_watch_upstream_failing` (`failing_record`), and calls `stop()` once `fail_after` windows have alarmed,
counted in arrival order (`failed` is then True, and no later window is taken, even one read in the same
look). `close()` stops the thread and the child (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lpf.watch.scorer import STATUS, WINDOWS

log = logging.getLogger("lpf.watch")
BACKOFF_S = 1.0  # the first restart's wait; doubled after each consecutive quick failure
BACKOFF_CAP_S = 60.0
GIVE_UP_AFTER = 8  # consecutive quick failures (1 + 2 + ... + 60 s of trying: about two minutes)
# a scorer that lived this long was not failing deterministically (the model loaded, it scored): the count restarts
HEALTHY_AFTER_S = 120.0


class Supervisor:
    def __init__(
        self,
        run_path: Path,
        scorer_args: list[str],
        metrics,
        on_window,
        webhook=None,
        fail_after=None,
        stop=None,
        poll: float = 0.5,
        backoff: float = BACKOFF_S,
        backoff_cap: float = BACKOFF_CAP_S,
        give_up_after: int = GIVE_UP_AFTER,
        healthy_after: float = HEALTHY_AFTER_S,
        command: list[str] | None = None,
    ):
        self.path, self.args, self.metrics = Path(run_path), scorer_args, metrics
        self.on_window, self.webhook, self.fail_after, self.stop = on_window, webhook, fail_after, stop
        self.poll = poll
        self.backoff, self.backoff_cap, self.give_up_after = backoff, backoff_cap, give_up_after
        self.healthy_after = healthy_after
        # what starts the scorer (tests start a stand-in that fails at once, without loading torch)
        self.command = command or [sys.executable, "-m", "lpf.watch.scorer", str(self.path), *self.args]
        self.proc: subprocess.Popen | None = None
        self.restarts = self.alarms = self.seen = 0
        self.quick_failures = 0  # consecutive
        self.gave_up = False
        self.spawned_at: list[float] = []  # monotonic start time of each scorer process
        self._started = self._restart_at = 0.0
        self._up, self._gave_up = _health_gauges(metrics)
        self.failed = False
        self.windows: list[dict] = []
        self._offset = 0
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lpf-watch-supervisor", daemon=True)
        self._log = open(self.path / "live" / "scorer.log", "ab")

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a Ctrl-C at the terminal goes to lpf watch, which stops it
        )
        self._started = time.monotonic()
        self.spawned_at.append(self._started)
        self._up.set(1)

    def _loop(self) -> None:
        while not self._closing.wait(self.poll):
            try:
                self.tick()
            except Exception as e:  # the watcher of the watcher must not die of one bad line
                log.error("lpf watch: supervisor: %s: %s", type(e).__name__, e)

    def tick(self) -> None:
        self._keep_alive()
        self._status()
        for w in self._new_windows():
            self._window(w)

    def _keep_alive(self) -> None:
        """Restart a dead scorer once its backoff has passed; give up after `give_up_after` quick deaths."""
        if self.proc is None or self.gave_up or self._closing.is_set():
            return
        now = time.monotonic()
        if self._restart_at:  # dead, waiting out the backoff
            if now >= self._restart_at:
                self._restart_at = 0.0
                self.restarts += 1
                self.metrics.scorer_restarts.set(self.restarts)
                self._spawn()
            return
        code = self.proc.poll()
        if code is None:
            return
        self._up.set(0)
        lived = now - self._started
        self.quick_failures = self.quick_failures + 1 if lived < self.healthy_after else 1
        if self.quick_failures >= self.give_up_after:
            self.gave_up = True
            self._gave_up.set(1)
            log.error("%s", json.dumps(give_up_record(self.quick_failures, code, self.path / "live" / "scorer.log")))
            return
        wait = min(self.backoff_cap, self.backoff * 2 ** (self.quick_failures - 1))
        log.warning("lpf watch: the scorer exited (%s) after %.1f s; restarting it in %.1f s", code, lived, wait)
        self._restart_at = now + wait

    def _status(self) -> None:
        try:
            s = json.loads((self.path / STATUS).read_text())
        except (OSError, ValueError):
            return
        self.seen = max(self.seen, s.get("scored", 0))
        self.metrics.observe_status(s, time.time())

    def _new_windows(self) -> list[dict]:
        p = self.path / WINDOWS
        if not p.is_file():
            return []
        with open(p, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next look
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def _window(self, w: dict) -> None:
        if self.failed:
            return  # --fail-after stopped at the Nth alarmed window in arrival order: later ones are not taken
        self.windows.append(w)
        m = self.metrics
        m.observe_window(w)
        if w.get("alarm"):
            m.alarms.inc()
            self.alarms += 1
            if self.webhook:
                self._post(alarm_record(w))
        elif w.get("upstream_failing") and self.webhook:
            self._post(failing_record(w))
        self.on_window(w)
        if w.get("alarm") and self.fail_after and self.alarms >= self.fail_after and not self.failed:
            self.failed = True
            if self.stop:
                self.stop()

    def _post(self, record: dict) -> None:
        import httpx

        try:
            httpx.post(self.webhook, json=record, timeout=5.0).raise_for_status()
        except httpx.HTTPError as e:
            log.error("lpf watch: the alert webhook failed: %s: %s", type(e).__name__, e)

    def close(self) -> None:
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def _health_gauges(metrics):
    """(lpf_watch_scorer_up, lpf_watch_scorer_gave_up) on the metrics' registry: the scorer's health is the
    supervisor's to report."""
    from prometheus_client import Gauge

    r = metrics.registry
    up = Gauge("lpf_watch_scorer_up", "1 while a scoring process runs", registry=r)
    gave_up = Gauge(
        "lpf_watch_scorer_gave_up", "1 once the scorer failed too often in a row to be restarted again", registry=r
    )
    return up, gave_up


def give_up_record(failures: int, code: int | None, log_path: Path) -> dict:
    """The one line (JSON) `lpf watch` logs when it stops restarting the scorer."""
    return {
        "event": "lpf_watch_scorer_gave_up",
        "consecutive_failures": failures,
        "last_exit_code": code,
        "scorer_log": str(log_path),
        "sentence": f"the scorer died {failures} times in a row, each soon after it started; lpf watch stopped "
        f"restarting it (proxying and recording go on; nothing is judged): see {log_path}",
    }


def alarm_record(w: dict) -> dict:
    """What one alarm says (the log line and the webhook's body): the window, its test, its first request."""
    test = w.get("run_test") or {}
    return {
        "event": "lpf_watch_alarm",
        "window": w.get("window"),
        "first_seq": w.get("first_seq"),
        "last_seq": w.get("last_seq"),
        "run_test": test.get("result"),
        "p_value": test.get("p_value"),
        "verdicts": w.get("verdicts"),
        "flagged": (w.get("flagged") or [])[:20],
        # the flagged requests against what an honest engine of the dtype shows (a corrupt one alarms alone)
        "expected_flagged": (w.get("requests_test") or {}).get("expected"),
        "flagged_p_value": (w.get("requests_test") or {}).get("p_value"),
        # the incident's change point: the same for each of its alarmed windows, refined as evidence grows
        "change_request_id": (w.get("change") or {}).get("request_id"),
        "change_seq": (w.get("change") or {}).get("seq"),
        "change_refined": bool((w.get("change") or {}).get("refined")),
        "incident": (w.get("incident") or {}).get("id"),
        "incident_windows": (w.get("incident") or {}).get("windows"),
        "n_failed": w.get("n_failed"),
        "sentence": test.get("sentence"),
    }


def failing_record(w: dict) -> dict:
    """A window where the upstream failed more than the stated share of requests (the webhook's body)."""
    from lpf.watch.outages import UPSTREAM_FAILING_SHARE, window_notes

    return {
        "event": "lpf_watch_upstream_failing",
        "window": w.get("window"),
        "first_seq": w.get("first_seq"),
        "last_seq": w.get("last_seq"),
        "n_requests": w.get("n_settled"),
        "n_failed": w.get("n_failed"),
        "failed": w.get("failed"),
        "share": UPSTREAM_FAILING_SHARE,
        "sentence": window_notes(w),
    }
