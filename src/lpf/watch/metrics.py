"""`lpf watch`'s Prometheus metrics (`prometheus_client`, one registry per proxy): what /metrics serves.

Contract: `WatchMetrics()` holds the counters the proxy and the supervisor update and `render()` returns
the exposition text (and its content type). Names start `lpf_watch_`. Counters: requests proxied (by
route and whether sampled), samples dropped (queue full), upstream answers by status class and upstream
errors (4xx and 5xx answers, refused, timed out, cut), client disconnects, requests scored, alarms,
request verdicts (by verdict), windows judged (by result: `lpf.watch.outages.WINDOW_RESULTS`, among them
`upstream-failing`), failed samples (by status class), unscored samples (by reason), upstream-failing
windows, a server reference's work (requests, tokens, seconds: `reference_cost` of the scorer's status). Gauges: requests in flight, the recorder's queue depth, samples recorded, parts deleted by
`--retain`, scoring lag (answered samples not yet scored; seconds since the oldest of them arrived, 0 when
none waits: failed samples are never lag), scorer restarts, the last window's run-test p-value and whether
it alarmed, the flagged rate of the last window against its expected rate (tokens beyond the floor against
the null rate; divergent and corrupt requests against the count an honest engine of the dtype shows over as
many tokens, and that test's p-value), and whether the last window was upstream-failing.

Every series an alert rule reads exists from the start with a value that means something: labelled
counters are created at 0 for every label value they can take (no `result="None"`), and the last-window
gauges are NaN until a window is judged (a comparison with NaN is false: no rule fires on "no window yet").
`answered(status)` counts one upstream answer; `observe_status(status, now)` takes the scorer's
`live/scorer.json`, `observe_window(line)` one judged window. A missing `prometheus_client` is one line
(an `LpfError`), not a traceback.
"""

from __future__ import annotations

import math

from lpf.core.errors import LpfError
from lpf.watch.outages import FAILURE_CLASSES, UNSCORED_REASONS, WINDOW_RESULTS

STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx")
VERDICTS = ("clean", "noise", "divergent", "corrupt")


class WatchMetrics:
    def __init__(self):
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge
        except ImportError:
            raise LpfError("lpf watch needs prometheus_client: pip install prometheus_client") from None
        r = self.registry = CollectorRegistry()
        self.proxied = Counter("lpf_watch_requests", "Requests proxied", ["route", "sampled"], registry=r)
        self.dropped = Counter(
            "lpf_watch_samples_dropped", "Sampled requests dropped (recorder queue full)", registry=r
        )
        self.upstream_errors = Counter(
            "lpf_watch_upstream_errors",
            "Requests the upstream failed: 4xx and 5xx answers, refused, timed out, cut",
            registry=r,
        )
        self.answers = Counter(
            "lpf_watch_upstream_answers", "Upstream answers by status class", ["status_class"], registry=r
        )
        self.failed = Counter(
            "lpf_watch_samples_failed",
            "Sampled requests the upstream failed (4xx, 5xx, no-answer) or the client left (client-gone)",
            ["status_class"],
            registry=r,
        )
        self.unscored = Counter(
            "lpf_watch_unscored",
            "Answered samples not scored as recorded, by reason (inconsistent ones are scored, with caution)",
            ["reason"],
            registry=r,
        )
        self.failing_windows = Counter(
            "lpf_watch_upstream_failing_windows",
            "Windows where more than the stated share of requests failed upstream",
            registry=r,
        )
        self.window_failing = Gauge(
            "lpf_watch_window_upstream_failing", "1 when the last judged window was upstream-failing", registry=r
        )
        self.client_gone = Counter("lpf_watch_client_disconnects", "Clients that left before their answer", registry=r)
        self.scored = Counter("lpf_watch_requests_scored", "Sampled requests the reference scored", registry=r)
        self.verdicts = Counter("lpf_watch_verdicts", "Per-request verdicts of judged windows", ["verdict"], registry=r)
        self.windows = Counter("lpf_watch_windows", "Windows judged, by run-test result", ["result"], registry=r)
        self.alarms = Counter("lpf_watch_alarms", "Alarmed windows", registry=r)
        self.in_flight = Gauge("lpf_watch_in_flight", "Requests in flight through the proxy", registry=r)
        self.queue_depth = Gauge("lpf_watch_queue_depth", "Samples waiting to be written", registry=r)
        self.recorded = Gauge("lpf_watch_samples_recorded", "Sampled requests committed to the run", registry=r)
        self.unrecordable = Gauge(
            "lpf_watch_samples_unrecordable",
            "Sampled requests that could not be turned into rows or written",
            registry=r,
        )
        self.pruned = Gauge(
            "lpf_watch_parts_deleted", "Parts the retention limit (--retain) deleted, oldest first", registry=r
        )
        self.lag_requests = Gauge("lpf_watch_scoring_lag_requests", "Answered samples not yet scored", registry=r)
        self.lag_seconds = Gauge(
            "lpf_watch_scoring_lag_seconds",
            "Seconds since the oldest answered, not yet scored sample arrived (0 when none waits)",
            registry=r,
        )
        self.skipped = Gauge(
            "lpf_watch_scoring_skipped", "Recorded requests given up unscored to keep the lag bounded", registry=r
        )
        self.reference_work = {
            what: Counter(
                f"lpf_watch_reference_{what}",
                f"A server reference's re-scoring work ({help_}): the upstream's own with --reference self",
                registry=r,
            )
            for what, help_ in (
                ("requests", "requests sent"),
                ("tokens", "tokens prefilled, prompts included"),
                ("seconds", "seconds waited"),
            )
        }
        self.scorer_restarts = Gauge("lpf_watch_scorer_restarts", "Times the scoring process was restarted", registry=r)
        self.p_value = Gauge(
            "lpf_watch_window_run_test_p_value", "The last judged window's run-test p-value", registry=r
        )
        self.alarmed = Gauge("lpf_watch_window_alarmed", "1 when the last judged window alarmed", registry=r)
        self.flagged_rate = Gauge(
            "lpf_watch_window_flagged_rate", "Share of the last window's tokens beyond the floor", registry=r
        )
        self.expected_rate = Gauge(
            "lpf_watch_window_expected_rate", "The share an honest engine stays under (the null rate)", registry=r
        )

        self.flagged_requests = Gauge(
            "lpf_watch_window_flagged_requests", "The last window's divergent and corrupt requests", registry=r
        )
        self.expected_requests = Gauge(
            "lpf_watch_window_expected_flagged_requests",
            "How many an honest engine of the upstream's dtype stays under over as many scored tokens",
            registry=r,
        )
        self.requests_p_value = Gauge(
            "lpf_watch_window_flagged_requests_p_value",
            "The last window's flagged-request count against the expected one (Poisson)",
            registry=r,
        )

        # every label value from the start, at 0; the last-window gauges NaN until a window is judged
        for route in ("/v1/completions", "/v1/chat/completions"):
            for sampled in ("True", "False"):
                self.proxied.labels(route=route, sampled=sampled)
        for c in STATUS_CLASSES:
            self.answers.labels(status_class=c)
        for c in FAILURE_CLASSES:
            self.failed.labels(status_class=c)
        for reason in UNSCORED_REASONS:
            self.unscored.labels(reason=reason)
        for result in WINDOW_RESULTS:
            self.windows.labels(result=result)
        for v in VERDICTS:
            self.verdicts.labels(verdict=v)
        for g in (
            self.p_value,
            self.alarmed,
            self.flagged_rate,
            self.expected_rate,
            self.flagged_requests,
            self.expected_requests,
            self.requests_p_value,
            self.window_failing,
        ):
            g.set(math.nan)
        self._seen: dict[tuple, float] = {}  # totals already counted from the scorer's status

    def answered(self, status: int) -> None:
        """One answer from the upstream: counted by class, and as an upstream error from 400 on."""
        self.answers.labels(status_class=f"{min(max(status // 100, 2), 5)}xx").inc()
        if status >= 400:
            self.upstream_errors.inc()

    def _add_total(self, key: tuple, counter, total: float) -> None:
        """Counts what a total (recomputed by the scorer each cycle) grew by since the last look."""
        grew = total - self._seen.get(key, 0)
        if grew > 0:
            counter.inc(grew)
            self._seen[key] = total

    def observe_status(self, s: dict, now: float) -> None:
        """The scorer's `live/scorer.json`: scored, skipped, lag, failed and unscored totals."""
        self._add_total(("scored",), self.scored, s.get("scored", 0))
        self.skipped.set(s.get("skipped", 0))
        if "pending" in s:
            self.lag_requests.set(s["pending"])
            oldest = s.get("oldest_pending_arrival")
            self.lag_seconds.set(max(0.0, now - oldest) if oldest else 0.0)
        for c, n in (s.get("failed") or {}).items():
            self._add_total(("failed", c), self.failed.labels(status_class=c), n)
        for reason, n in (s.get("unscored") or {}).items():
            self._add_total(("unscored", reason), self.unscored.labels(reason=reason), n)
        for what, n in (s.get("reference_cost") or {}).items():
            if what in self.reference_work:
                self._add_total(("reference", what), self.reference_work[what], n)

    def observe_window(self, w: dict) -> None:
        from lpf.watch.outages import window_result

        for verdict, n in (w.get("verdicts") or {}).items():
            self.verdicts.labels(verdict=verdict).inc(n)
        test = w.get("run_test") or {}
        self.windows.labels(result=w.get("result") or window_result(w)).inc()
        self.p_value.set(math.nan if test.get("p_value") is None else test["p_value"])
        self.flagged_rate.set(math.nan if w.get("flagged_rate") is None else w["flagged_rate"])
        self.expected_rate.set(math.nan if w.get("expected_rate") is None else w["expected_rate"])
        rt = w.get("requests_test") or {}
        self.flagged_requests.set(rt.get("flagged", math.nan))
        self.expected_requests.set(rt.get("expected", math.nan))
        self.requests_p_value.set(rt.get("p_value", math.nan))
        self.alarmed.set(1 if w.get("alarm") else 0)
        self.window_failing.set(1 if w.get("upstream_failing") else 0)
        if w.get("upstream_failing"):
            self.failing_windows.inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
