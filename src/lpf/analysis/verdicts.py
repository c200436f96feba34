"""Per-request summaries and verdicts from per-token metrics.

`summarize_requests(metrics, requests, th)` returns one row per request of the run: token counts,
max/mean |d|, sequence log-ratio, first_divergence (first output position with |d| above the
divergence threshold or a greedy flip; null when none), flagged-token and gibberish counts, and the
verdict. Requests the engine failed get verdict `error`; completed requests with outputs but no
reference rows get `unscored`. Vectorised: one pass of numpy reductions over request segments.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.thresholds import Thresholds

VERDICTS = ("clean", "noise", "divergent", "corrupt")  # in order of severity
SEVERITY = {v: i for i, v in enumerate(VERDICTS)}


def summarize_requests(metrics: pa.Table, requests: pa.Table, th: Thresholds) -> pa.Table:
    n = metrics.num_rows
    rid = metrics.column("request_id").to_numpy(zero_copy_only=False) if n else np.array([], dtype=object)
    # metrics is sorted by request: segment starts are where the id changes.
    starts = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]]) if n else np.array([], dtype=np.int64)
    seg_ids = rid[starts] if n else np.array([], dtype=object)
    pos = metrics.column("position").to_numpy() if n else np.array([], dtype=np.int32)
    ad = metrics.column("abs_logprob_diff").to_numpy() if n else np.array([])
    eng = metrics.column("engine_logprob").to_numpy() if n else np.array([])
    ref = metrics.column("ref_logprob").to_numpy() if n else np.array([])
    flip = metrics.column("greedy_flip").to_numpy(zero_copy_only=False) if n else np.array([], bool)
    gib = metrics.column("gibberish").to_numpy(zero_copy_only=False) if n else np.array([], bool)
    bad = ~np.isfinite(ad)  # a missing or NaN logprob is an error of the engine, never "clean"
    adf = np.where(bad, np.inf, ad)
    flagged = (adf > th.divergent_abs_diff) | flip

    def seg(op, values):
        return op.reduceat(values, starts) if n else np.array([], dtype=values.dtype)

    counts = np.diff(np.r_[starts, n]) if n else np.array([], dtype=np.int64)
    big = np.iinfo(np.int32).max
    first = seg(np.minimum, np.where(flagged, pos, big))
    by_id = {
        "n_scored_tokens": counts,
        "max_abs_logprob_diff": seg(np.maximum, adf),
        "mean_abs_logprob_diff": seg(np.add, np.where(bad, 0.0, ad)) / np.maximum(counts, 1),
        "seq_log_ratio": seg(np.add, np.where(bad, 0.0, eng - ref)),
        "first_divergence": first,
        "n_flagged_tokens": seg(np.add, flagged.astype(np.int64)),
        "n_greedy_flips": seg(np.add, flip.astype(np.int64)),
        "gibberish_tokens": seg(np.add, gib.astype(np.int64)),
    }
    verdict = np.full(len(starts), "clean", dtype=object)
    verdict[by_id["max_abs_logprob_diff"] > th.clean_abs_diff] = "noise"
    verdict[(by_id["max_abs_logprob_diff"] > th.divergent_abs_diff) | (by_id["n_greedy_flips"] > 0)] = "divergent"
    verdict[by_id["gibberish_tokens"] >= th.gibberish_min_tokens] = "corrupt"

    # Align to every request of the run, in arrival order.
    req = requests.sort_by("seq")
    req_ids = req.column("request_id").to_numpy(zero_copy_only=False)
    index = {r: i for i, r in enumerate(seg_ids)}
    at = np.array([index.get(r, -1) for r in req_ids], dtype=np.int64)
    has = at >= 0

    def take(values, fill):
        out = np.full(len(req_ids), fill, dtype=np.asarray(values).dtype if len(values) else type(fill))
        out[has] = np.asarray(values)[at[has]]
        return out

    n_out = pc.list_value_length(req.column("output_token_ids")).to_numpy(zero_copy_only=False)
    errors = req.column("error").to_numpy(zero_copy_only=False)
    final = take(verdict, "clean").astype(object)
    final[~has & (n_out > 0)] = "unscored"
    final[np.array([e is not None for e in errors], dtype=bool)] = "error"
    first_col = take(first, big)
    return pa.table({
        "request_id": req.column("request_id"),
        "seq": req.column("seq"),
        "prompt_id": req.column("prompt_id"),
        "rollout": req.column("rollout"),
        "n_output_tokens": pa.array(n_out.astype(np.int32)),
        "n_scored_tokens": pa.array(take(counts, 0).astype(np.int32)),
        "max_abs_logprob_diff": pa.array(take(by_id["max_abs_logprob_diff"], 0.0)),
        "mean_abs_logprob_diff": pa.array(take(by_id["mean_abs_logprob_diff"], 0.0)),
        "seq_log_ratio": pa.array(take(by_id["seq_log_ratio"], 0.0)),
        "first_divergence": pa.array(first_col.astype(np.int32), mask=first_col == big),
        "n_flagged_tokens": pa.array(take(by_id["n_flagged_tokens"], 0).astype(np.int32)),
        "n_greedy_flips": pa.array(take(by_id["n_greedy_flips"], 0).astype(np.int32)),
        "gibberish_tokens": pa.array(take(by_id["gibberish_tokens"], 0).astype(np.int32)),
        "verdict": pa.array(final.tolist(), type=pa.string()),
        "error": req.column("error"),
        "oracle_ok": req.column("oracle_ok"),
    })
