"""Per-request timing features: explanations for engines without a trace (any HTTP server).

Contract: `timing_features(requests) -> list[Feature]`, values aligned to `requests` sorted by `seq`
(like `features.request_features`, whose features they join in `findings`), NaN where a request lacks
what a feature needs; a feature no request has is left out, and so is one that never decreases in
arrival order (an in-process engine queues every request at once, so its "concurrency at arrival"
is the arrival index again: `seq` already says that). Pure: the requests table in, numpy out.
Arrival is `t_submit` (when the engine under test got the request: an HTTP engine's send), and a
request is in flight from `t_submit` to `t_finish`.

  concurrency_at_arrival  other requests in flight when it arrived (its sentence points at a batch-shape
                          dependence, which `lpf repeat` against the server confirms or rules out)
  arrival_rank            its rank (0 first) among requests that arrived together: arrivals less
                          than BURST_GAP_S apart form one burst, as a client's or a batcher's do
  time_to_first_token     t_first_token - t_submit, where the engine recorded a first-token time
  queue_wait              seconds from arrival until the attempt that answered it started
                          (retries and their backoff), for engines that record attempts
  retries                 attempts beyond the first (engines that record attempts)
  server_errors_nearby    attempts of any request that failed at the server (HTTP 429/5xx, a broken
                          connection, a timeout) and ended while this request was in flight
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.features import Feature
from lpf.analysis.verdicts import by_arrival

BURST_GAP_S = 0.002


def _times(req: pa.Table, name: str) -> np.ndarray:
    if name not in req.column_names:
        return np.full(req.num_rows, np.nan)
    return req.column(name).cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)


def timing_features(requests: pa.Table) -> list[Feature]:
    req = by_arrival(requests)
    n = req.num_rows
    ts, tf, t1 = _times(req, "t_submit"), _times(req, "t_finish"), _times(req, "t_first_token")
    known = np.isfinite(ts) & np.isfinite(tf)
    feats = []
    if known.sum() >= 2:
        starts, ends = np.sort(ts[known]), np.sort(tf[known])
        # in flight at t_i: arrived at or before t_i and not finished by then, less the request itself
        conc = (np.searchsorted(starts, ts, "right") - np.searchsorted(ends, ts, "right") - 1).astype(np.float64)
        conc[~known] = np.nan
        feats.append(
            Feature(
                "concurrency_at_arrival",
                "numeric",
                np.maximum(conc, 0.0),
                "requests in flight at arrival (concurrency)",
                template="arrived while {op} {cut} other requests were in flight (load at arrival: consistent "
                "with a batch-shape dependence, logprobs that change with what else is batched; `lpf repeat` "
                "against the server tells)",
            )
        )
        feats.append(
            Feature(
                "arrival_rank",
                "numeric",
                _burst_rank(ts),
                "rank among concurrent arrivals",
                template="were at rank {op} {cut} among the requests arriving with them",
            )
        )
    ttft = t1 - ts
    if np.isfinite(ttft).any():
        feats.append(Feature("time_to_first_token", "numeric", ttft, "time to first token (s)"))
    feats += _attempt_features(req, ts, tf, n)
    return [f for f in feats if not _follows_arrival(f.values)]


def _follows_arrival(values: np.ndarray) -> bool:
    known = values[np.isfinite(values)]
    return known.size < 2 or bool(np.all(np.diff(known) >= 0))


def _burst_rank(ts: np.ndarray) -> np.ndarray:
    out = np.full(ts.size, np.nan)
    ok = np.flatnonzero(np.isfinite(ts))
    if ok.size == 0:
        return out
    order = ok[np.argsort(ts[ok], kind="stable")]
    t = ts[order]
    new_burst = np.r_[True, np.diff(t) >= BURST_GAP_S]
    burst_start = np.maximum.accumulate(np.where(new_burst, np.arange(t.size), 0))
    out[order] = np.arange(t.size) - burst_start
    return out


def _attempt_features(req: pa.Table, ts: np.ndarray, tf: np.ndarray, n: int) -> list[Feature]:
    if "attempts" not in req.column_names:
        return []
    col = req.column("attempts").combine_chunks()
    counts = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if not counts.any():
        return []  # an in-process engine: no attempts anywhere
    flat = pc.list_flatten(col)
    row = pc.list_parent_indices(col).to_numpy(zero_copy_only=False).astype(np.int64)
    status = pc.struct_field(flat, "status").fill_null(-1).to_numpy(zero_copy_only=False)
    sent = pc.struct_field(flat, "sent").fill_null(False).to_numpy(zero_copy_only=False)
    t_start = pc.struct_field(flat, "t_start").fill_null(np.nan).to_numpy(zero_copy_only=False)
    t_end = pc.struct_field(flat, "t_end").fill_null(np.nan).to_numpy(zero_copy_only=False)
    has = counts > 0
    retries = np.where(has, counts - 1, np.nan).astype(np.float64)
    last = np.full(n, np.nan)
    last[row] = t_start  # rows are in attempt order within a request: the last write is the last attempt
    wait = np.where(has, np.maximum(last - ts, 0.0), np.nan)
    failed_at_server = sent & ((status >= 500) | (status == 429) | (status < 0))
    ends = np.sort(t_end[failed_at_server & np.isfinite(t_end)])
    nearby = (np.searchsorted(ends, tf, "right") - np.searchsorted(ends, ts, "left")).astype(np.float64)
    nearby[~(np.isfinite(ts) & np.isfinite(tf))] = np.nan
    return [
        Feature("queue_wait", "numeric", wait, "queue wait before the answering attempt (s)"),
        Feature("retries", "numeric", retries, "retries"),
        Feature(
            "server_errors_nearby",
            "numeric",
            nearby,
            "server errors while in flight",
            template="saw {op} {cut} server errors (5xx, 429, broken connections) while in flight",
        ),
    ]
