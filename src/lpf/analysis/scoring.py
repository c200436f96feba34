"""The token pass: per-request reductions and the metric columns' summaries, vectorized in cache-sized pieces.

Contract (pure: numpy columns in, numpy arrays and dicts out):
- `score_requests(cols, starts, greedy, th) -> (per, flips, same)`: `cols` the `metrics.input_arrays`
  of a `join_grouped` table plus `position` (whole-run columns, grouped by request), `starts` the
  request starts (and `no_logprob` when some tokens came back without one: `lpf.analysis.absent`, at
  `temperature` when sampled; `greedy` and `temperature` the run's, or arrays of each row's own:
  `request_sampling`). `per` holds `verdicts.reduce_requests`' columns for every request, bit
  for bit what `metrics.metric_arrays` then `reduce_requests` give (verdicts as `verdicts.CODES` indices); `flips`
  the greedy flips, `same` the tokens that are the reference's top-1.
- `metric_summary(cols, flips, same[, n]) -> findings' "metrics"`, bit for bit
  `findings.token_metric_summary` over the whole-run metric columns, from one pass over
  `column_stats` leaves that never holds one; `cols` the engine and reference logprob columns, in
  memory or read piece by piece (the streamed analysis reads them from its spill files); each
  leaf's metric values are computed on a second thread while the last one is summarized (`read`
  is then called from that thread, one call at a time).
Sparse where the data is: the flags that need more than a comparison (greedy flip, lie strength)
are computed only at rows that can have them (the engine's token is not the reference's top-1, or
the reference finds it improbable), the from-the-first-divergence reductions only over requests with
a flagged token; dense per row are a few comparisons, |d|'s max and sum and d's sum. Requests are
cut into chunks of about CHUNK rows at request starts.
"""

from __future__ import annotations

import numpy as np

from lpf.analysis import absent
from lpf.analysis import column_stats as cs
from lpf.analysis import metrics as m
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.verdicts import CODES, reduce_requests, tie_moved, without_lp

CHUNK = 1 << 16
_BIG = np.iinfo(np.int32).max
_CODE = {v: i for i, v in enumerate(CODES)}


def chunk_bounds(starts: np.ndarray, n: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """Row ranges of about `chunk` rows, each cut at a request start (indices into `starts`)."""
    if not n:
        return []
    cuts = np.searchsorted(starts, np.arange(0, n, chunk))
    cuts = np.unique(np.r_[cuts, starts.size])
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def score_requests(cols: dict[str, np.ndarray], starts: np.ndarray, greedy, th: Thresholds, temperature=0.0):
    n = len(cols["position"])
    parts, flips, other = [], 0, 0
    for a, b in chunk_bounds(starts, n):
        lo, hi = int(starts[a]), int(starts[b]) if b < starts.size else n
        piece = {k: v[lo:hi] for k, v in cols.items()}
        if np.ndim(greedy):  # each row's own settings: sliced with the chunk
            per, f, o = _score_chunk(piece, starts[a:b] - lo, greedy[lo:hi], th, temperature[lo:hi])
        else:
            per, f, o = _score_chunk(piece, starts[a:b] - lo, greedy, th, temperature)
        parts.append(per)
        flips, other = flips + f, other + o
    if not parts:
        empty = {
            "position": np.zeros(0, np.int32),
            **{k: np.zeros(0) for k in ("abs_logprob_diff", "engine_logprob", "ref_logprob")},
            "greedy_flip": np.zeros(0, bool),
            "gibberish": np.zeros(0, bool),
        }
        return reduce_requests(empty, th, np.zeros(0, np.int64)), 0, 0
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, flips, n - other


_TIE = ("token_id", "ref_top1_id", "ref_top1_logprob", "ref_logprob")  # what `tie_moved` reads


def _score_chunk(c: dict, st: np.ndarray, greedy, th: Thresholds, temperature=0.0):
    """One request-aligned chunk: (its requests' reductions, greedy flips, tokens off the reference's top-1)."""
    pos, eng, ref, tok, top1 = c["position"], c["engine_logprob"], c["ref_logprob"], c["token_id"], c["ref_top1_id"]
    n, k = len(pos), len(st)
    no_lp = c.get("no_logprob")
    if no_lp is not None and not no_lp.any():
        no_lp = None
    with np.errstate(over="ignore", invalid="ignore"):
        d = eng - ref
        ad = np.abs(d)
        other = tok != top1
        # rows that can be a greedy flip or a lie: off the reference's top-1, or improbable to it
        cand = np.flatnonzero(other | (ref <= th.improbable_logprob))
        dc, oc = d[cand], other[cand]
        per_row = np.ndim(greedy) > 0  # each row's own settings (`request_sampling`)
        g_c, t_c = (greedy[cand], temperature[cand]) if per_row else (greedy, temperature)
        past_tie = (c["ref_top1_logprob"][cand] - ref[cand]) > th.tie_margin
        if np.any(g_c):
            flip_c = oc & past_tie
            if per_row:
                flip_c &= g_c
        else:
            flip_c = np.zeros(cand.size, bool)
        etop = c["engine_top1_id"][cand] if "engine_top1_id" in c else np.full(cand.size, -1)
        own = (etop == tok[cand]) | ((etop < 0) & g_c)
        relative = own & oc & (c["ref_rank"][cand] > 1) & past_tie  # as metrics.metric_arrays: a tie is no lie
        strength_c = np.where(relative, np.clip(dc / th.gibberish_log_ratio, 0.0, 1.0), 0.0)
        strength_c[np.isnan(strength_c)] = 0.0
        strength_c[(eng[cand] >= th.confident_logprob) & (ref[cand] <= th.improbable_logprob)] = 1.0
        if no_lp is not None:  # a token without a logprob: the tokens-only rule (`absent`)
            nc = no_lp[cand]
            _, flip_n, strength_n = absent.judge(
                ref[cand][nc],
                c["ref_top1_logprob"][cand][nc],
                tok[cand][nc],
                top1[cand][nc],
                g_c[nc] if per_row else greedy,
                th,
                t_c[nc] if per_row else temperature,
            )
            flip_c[nc], strength_c[nc] = flip_n, strength_n
        lie_c = strength_c >= 0.5
        over = np.flatnonzero(~(ad <= th.divergent_abs_diff))  # past the threshold, or not a number
        near_tie = over[tie_moved({k: c[k][over] for k in _TIE if k in c}, ad[over], th)] if over.size else over
    if no_lp is not None:  # no logprob error where none was reported
        over = over[~no_lp[over]]
    bad = over[~np.isfinite(ad[over])]
    if no_lp is not None:
        gap = absent.margin(ref, c["ref_top1_logprob"], tok, top1)
        eng, d = absent.stand_in(eng, ref, gap, no_lp), np.where(no_lp, gap, d)
        adf, ad0, d0 = np.where(no_lp, np.nan, ad), np.where(no_lp, 0.0, ad), np.where(no_lp, 0.0, d)
        adf[bad], ad0[bad], d0[bad] = np.inf, 0.0, 0.0
    elif bad.size:  # a NaN logprob is an error of the engine, never "clean"
        adf, ad0, d0 = ad.copy(), ad.copy(), d.copy()
        adf[bad], ad0[bad], d0[bad] = np.inf, 0.0, 0.0
    else:
        adf = ad0 = ad
        d0 = d
    counts = np.diff(np.r_[st, n]).astype(np.int64)
    flagged = np.zeros(n, bool)
    flagged[over] = True
    flagged[near_tie] = False  # a near tie's token moved by no more than the tie margin (`verdicts.tie_moved`)
    flagged[cand[flip_c | lie_c]] = True
    flagged_rows = np.flatnonzero(flagged)
    seg = np.searchsorted(st, flagged_rows, side="right") - 1
    out = {
        "n_scored_tokens": counts,
        "max_abs_logprob_diff": np.maximum.reduceat(adf, st),
        "mean_abs_logprob_diff": np.add.reduceat(ad0, st) / np.maximum(counts, 1),
        "seq_log_ratio": np.add.reduceat(d0, st),
        "first_divergence": np.full(k, _BIG, np.int32),
        "n_flagged_tokens": np.bincount(seg, minlength=k).astype(np.int64),
        "n_greedy_flips": np.bincount(np.searchsorted(st, cand[flip_c], side="right") - 1, minlength=k).astype(
            np.int64
        ),
        "gibberish_tokens": np.bincount(np.searchsorted(st, cand[lie_c], side="right") - 1, minlength=k).astype(
            np.int64
        ),
        "gibberish_score": np.zeros(k),
        "n_no_logprob": np.add.reduceat(no_lp, st, dtype=np.int64) if no_lp is not None else np.zeros(k, np.int64),
    }
    if no_lp is not None:
        without_lp(out, np.fmax.reduceat(adf, st), np.add.reduceat(ad0, st))
    sustained = np.zeros(k, bool)
    if flagged_rows.size:
        at = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])  # each request's first flagged row (seg ascends)
        hit = seg[at]
        first = np.minimum.reduceat(pos[flagged_rows], at)
        out["first_divergence"][hit] = first
        strength, lie = np.zeros(n), np.zeros(n, bool)
        strength[cand], lie[cand] = strength_c, lie_c
        score, sustained[hit] = _after_first(pos, eng, ref, d, strength, lie, st, counts, hit, first, th)
        out["gibberish_score"][hit] = score
    verdict = np.zeros(k, np.int8)
    with np.errstate(invalid="ignore"):
        verdict[out["max_abs_logprob_diff"] > th.clean_abs_diff] = _CODE["noise"]
    verdict[out["first_divergence"] != _BIG] = _CODE["divergent"]
    verdict[sustained & (out["gibberish_score"] >= th.gibberish_min_score)] = _CODE["corrupt"]
    out["verdict"] = verdict
    return out, int(flip_c.sum()), int(np.count_nonzero(other))


def _after_first(pos, eng, ref, d, strength, lie, st, counts, hit, first, th):
    """For the requests `hit` (with a flagged token, the first at position `first`): the gibberish
    score and whether the lie is sustained (`verdicts.reduce_requests`' rule, over their rows only)."""
    lengths = counts[hit]
    seg_st = np.r_[0, np.cumsum(lengths)[:-1]]
    rows = np.repeat(st[hit] - seg_st, lengths) + np.arange(int(lengths.sum()))
    p, e, r, dd, s, lz = pos[rows], eng[rows], ref[rows], d[rows], strength[rows], lie[rows]
    settled = (e >= th.settled_logprob) & (r >= th.settled_logprob)
    after = (p >= np.repeat(first, lengths)) & ~settled
    n_after = np.add.reduceat(after, seg_st, dtype=np.int64)
    lies_after = np.add.reduceat(lz & after, seg_st, dtype=np.int64)
    score = np.where(n_after > 0, np.add.reduceat(np.where(after, s, 0.0), seg_st) / np.maximum(n_after, 1), 0.0)
    with np.errstate(invalid="ignore"):
        strong = lz & (dd >= 2 * th.gibberish_log_ratio)
    last = np.maximum.reduceat(np.where(after, np.arange(rows.size), -1), seg_st)
    last_lies = (last >= 0) & strong[np.maximum(last, 0)]
    return score, (lies_after >= th.gibberish_min_tokens) | ((lies_after >= 1) & last_lies)


# -- the metric columns' summaries ---------------------------------------------------------------
def _metric_values(eng: np.ndarray, ref: np.ndarray, buf: dict | None = None) -> dict[str, np.ndarray]:
    """The four error metrics of `metrics.metric_arrays` (the same operations, the same values),
    written into `buf`'s arrays (at least as long) when given: a leaf's temporaries are reused."""
    n = len(eng)
    b = {k: v[:n] for k, v in buf.items()} if buf else {k: np.empty(n) for k in _BUFFERS}
    with np.errstate(over="ignore", invalid="ignore"):
        d = np.subtract(eng, ref, out=b["d"])
        ad = np.abs(d, out=b["abs_logprob_diff"])
        prob = np.exp(eng, out=b["prob_diff"])
        np.subtract(prob, np.exp(ref, out=b["t"]), out=prob)
        np.abs(prob, out=prob)
        k3 = np.exp(np.negative(d, out=b["k3_kl"]), out=b["k3_kl"])
        np.add(k3, d, out=k3)
        k3 -= 1.0
        mult = np.exp(ad, out=b["token_mult_prob_error"])
    return {"abs_logprob_diff": ad, "prob_diff": prob, "k3_kl": k3, "token_mult_prob_error": mult}


_BUFFERS = ("d", "t", "abs_logprob_diff", "prob_diff", "k3_kl", "token_mult_prob_error")
SUMMARIZED = ("abs_logprob_diff", "prob_diff", "k3_kl")  # percentiles; token_mult_prob_error: its mean only


def _leaf_values(read, pieces: list[tuple[int, int]], size: int):
    """`_metric_values` of each leaf in order, the next one computed on a second thread while the
    caller takes in the last (numpy releases the GIL: the metric pass on both cores); two buffer
    sets, alternating, so a leaf's values stay put until the caller asks for the next."""
    bufs = [{k: np.empty(size) for k in _BUFFERS} for _ in range(min(2, len(pieces)))]

    def values(i: int) -> dict[str, np.ndarray]:
        lo, hi = pieces[i]
        return _metric_values(read("engine_logprob", slice(lo, hi)), read("ref_logprob", slice(lo, hi)), bufs[i % 2])

    if len(pieces) < 2:
        yield from (values(i) for i in range(len(pieces)))
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="lpf-metrics") as pool:
        ahead = pool.submit(values, 0)
        for i in range(len(pieces)):
            done = ahead.result()
            if i + 1 < len(pieces):
                ahead = pool.submit(values, i + 1)
            yield done


def metric_summary(cols, flips: int, same: int, n: int | None = None) -> dict:
    """`cols`: the whole-run engine_logprob and ref_logprob columns (a dict of arrays), or a
    function (name, rows) -> that column's values at `rows` (a slice or row indices) for columns
    that are not in memory (`n`: their length)."""
    read = (lambda name, rows: cols[name][rows]) if isinstance(cols, dict) else cols  # noqa: E731
    n = len(cols["engine_logprob"]) if isinstance(cols, dict) else n
    rows = cs.sample_rows(n)
    sample = _metric_values(read("engine_logprob", rows), read("ref_logprob", rows))
    stats = cs.ColumnStats(n, {**{name: sample[name] for name in SUMMARIZED}, "token_mult_prob_error": None})
    pieces = stats.leaves()
    size = max((hi - lo for lo, hi in pieces), default=0)
    buf = {k: np.empty(size) for k in _BUFFERS}
    for values in _leaf_values(read, pieces, size):
        stats.add(values)

    def column(name):  # the whole column, built piece by piece, only where one pass could not be exact
        out = np.empty(n)
        for lo, hi in pieces:
            out[lo:hi] = _metric_values(read("engine_logprob", slice(lo, hi)), read("ref_logprob", slice(lo, hi)), buf)[
                name
            ]
        return out

    metrics = {name: stats.result(name) or m.percentiles(column(name)) for name in SUMMARIZED}
    total = stats.sum("token_mult_prob_error")
    if total is not None:
        mean = float(total / n) if n else None
    else:
        mult = column("token_mult_prob_error")
        mult = mult[np.isfinite(mult)]
        mean = float(mult.mean()) if mult.size else None
    metrics["token_mult_prob_error"] = {**m.monotone_percentiles(metrics["abs_logprob_diff"], np.exp), "mean": mean}
    if n:
        metrics["greedy_flip_rate"] = float(flips / n)
        metrics["same_top1_pct"] = float(100.0 * (same / n))
    return metrics
