"""`lpf watch`'s Prometheus metrics (`prometheus_client`, one registry per proxy): what /metrics serves.

Contract: `WatchMetrics()` holds the counters the proxy and the supervisor update and `render()` returns
the exposition text (and its content type). Names start `lpf_watch_`. Counters: requests proxied (by
route and whether sampled), samples dropped (queue full), upstream errors, client disconnects,
requests scored, alarms, request verdicts (by verdict), windows judged (by run-test result).
Gauges: requests in flight, the recorder's queue depth, samples recorded, parts deleted by `--retain`, scoring lag (recorded but not
yet scored requests; and seconds since the newest scored request's arrival), scorer restarts, the last
window's run-test p-value and whether it alarmed, the flagged rate of the last window against its
expected rate (tokens beyond the floor against the null rate; divergent and corrupt requests against the
count an honest engine of the dtype shows over as many tokens, and that test's p-value). A missing `prometheus_client` is one line (an `LpfError`), not a traceback.
"""

from __future__ import annotations

from lpf.core.errors import LpfError


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
            "lpf_watch_upstream_errors", "Requests the upstream could not answer (refused, timed out, cut)", registry=r
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
        self.lag_requests = Gauge("lpf_watch_scoring_lag_requests", "Recorded requests not yet scored", registry=r)
        self.lag_seconds = Gauge(
            "lpf_watch_scoring_lag_seconds", "Seconds between now and the newest scored request's arrival", registry=r
        )
        self.skipped = Gauge(
            "lpf_watch_scoring_skipped", "Recorded requests given up unscored to keep the lag bounded", registry=r
        )
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

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
