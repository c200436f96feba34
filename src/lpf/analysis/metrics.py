"""Per-token metrics: engine tokens joined with reference scores, named as the RL ecosystem names them.

With d = engine_logprob - ref_logprob:
  abs_logprob_diff      |d|                                  (slime, SkyRL)
  prob_diff             |exp(engine) - exp(ref)|             (verl rollout_probs_diff)
  k3_kl                 rho - log(rho) - 1, rho = exp(-d)    (verl rollout_corr/k3_kl, prime-rl)
  token_mult_prob_error exp(|d|)                             (NeMo-RL)
  greedy_flip           greedy run and the reference's argmax beats the engine's token by > tie_margin
  lie_strength          0..1: 1 when the engine was sure of the token and the reference finds it
                        improbable; for the engine's own top choice that the reference ranks lower,
                        d / gibberish_log_ratio clipped to 1; else 0 (see `thresholds`)
  gibberish             a lie token: lie_strength >= 0.5
Input and output are Arrow tables; the math is numpy over whole columns. `join_scored` returns the
rows grouped by request (each request's rows contiguous, positions ascending), which is all the
per-request reductions need; when the two tables already line up row for row (the usual case for
in-memory tables and single-part runs) it zips them instead of hashing and sorting.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.thresholds import Thresholds

_REF_COLS = ["request_id", "position", "ref_logprob", "ref_rank", "ref_entropy", "ref_top1_id", "ref_top1_logprob"]


def first_of_lists(col) -> np.ndarray:
    """First element of each list (int64), -1 where the list is empty or null."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if len(arr) == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    has = offsets[1:] > offsets[:-1]
    if arr.null_count:
        has &= arr.is_valid().to_numpy(zero_copy_only=False)
    if values.size == 0:
        return np.full(len(arr), -1, dtype=np.int64)
    return np.where(has, values[np.minimum(offsets[:-1], values.size - 1)], -1).astype(np.int64)


def _grouped(ids: pa.ChunkedArray, pos: np.ndarray) -> bool:
    """Each request's rows contiguous with positions strictly ascending."""
    n = len(pos)
    if n < 2:
        return True
    ids = ids.combine_chunks()
    change = pc.not_equal(ids.slice(0, n - 1), ids.slice(1)).to_numpy(zero_copy_only=False)
    if np.any(~change & (pos[1:] <= pos[:-1])):
        return False
    starts = ids.take(pa.array(np.flatnonzero(np.r_[True, change])))
    return len(starts) == len(pc.unique(starts))


def _aligned(tokens: pa.Table, reference: pa.Table) -> bool:
    if tokens.num_rows != reference.num_rows:
        return False
    if tokens.num_rows == 0:
        return True
    same_pos = np.array_equal(tokens.column("position").to_numpy(), reference.column("position").to_numpy())
    return same_pos and pc.all(pc.equal(tokens.column("request_id"), reference.column("request_id"))).as_py()


def join_scored(tokens: pa.Table, reference: pa.Table) -> pa.Table:
    """Engine tokens that have a reference score, grouped by request, positions ascending.
    Adds `engine_top1_id` (first of the engine's top-k, -1 when it gave none)."""
    eng = tokens.select(["request_id", "position", "token_id", "engine_logprob"])
    top1 = first_of_lists(tokens.column("engine_topk_ids")) if "engine_topk_ids" in tokens.column_names \
        else np.full(tokens.num_rows, -1, dtype=np.int64)
    eng = eng.append_column("engine_top1_id", pa.array(top1))
    if _aligned(eng, reference) and _grouped(eng.column("request_id"), eng.column("position").to_numpy()):
        out = eng
        for name in _REF_COLS[2:]:
            out = out.append_column(name, reference.column(name))
        return out
    joined = eng.join(reference.select(_REF_COLS), keys=["request_id", "position"], join_type="inner")
    return joined.sort_by([("request_id", "ascending"), ("position", "ascending")])


def token_metrics(joined: pa.Table, greedy: bool, th: Thresholds) -> pa.Table:
    """Adds the metric columns to a `join_scored` table."""
    eng = joined.column("engine_logprob").to_numpy()
    ref = joined.column("ref_logprob").to_numpy()
    tok = joined.column("token_id").to_numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        d = eng - ref
        ad = np.abs(d)
        rho = np.exp(-d)
        cols = {
            "abs_logprob_diff": ad,
            "prob_diff": np.abs(np.exp(eng) - np.exp(ref)),
            "k3_kl": rho + d - 1.0,  # rho - log(rho) - 1 with log(rho) = -d, exact for large |d| too
            "token_mult_prob_error": np.exp(ad),
        }
        rank = joined.column("ref_rank").to_numpy(zero_copy_only=False)
        top1 = joined.column("ref_top1_id").to_numpy()
        if greedy:
            margin = joined.column("ref_top1_logprob").to_numpy() - ref
            flip = (tok != top1) & (margin > th.tie_margin)
        else:
            flip = np.zeros(len(eng), dtype=bool)
        cols["greedy_flip"] = flip
        # The engine's own top choice: its reported top-1, or (greedy, no top-k) the token itself.
        etop = joined.column("engine_top1_id").to_numpy() if "engine_top1_id" in joined.column_names \
            else np.full(len(eng), -1)
        own_top = (etop == tok) | ((etop < 0) & greedy)
        absolute = (eng >= th.confident_logprob) & (ref <= th.improbable_logprob)
        # relative: the engine's own choice, not the reference's, graded by how many times more
        # likely the engine found it (1 at gibberish_log_ratio and beyond)
        relative = np.where(own_top & (tok != top1) & (rank > 1), np.clip(d / th.gibberish_log_ratio, 0.0, 1.0), 0.0)
        strength = np.where(absolute, 1.0, np.nan_to_num(relative, nan=0.0))
        cols["lie_strength"] = strength
        cols["gibberish"] = strength >= 0.5
    for name, values in cols.items():
        joined = joined.append_column(name, pa.array(values))
    return joined


QUANTILES = (0.5, 0.9, 0.99, 0.999)


def percentiles(values: np.ndarray) -> dict:
    """llama.cpp-style summary of a per-token error distribution."""
    finite = np.isfinite(values)
    if not finite.all():
        values = values[finite]
    if values.size == 0:
        return {k: None for k in ("p50", "p90", "p99", "p99_9", "max", "mean")}
    q = np.quantile(values, QUANTILES)
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "p99_9": float(q[3]),
            "max": float(values.max()), "mean": float(values.mean())}


def monotone_percentiles(summary: dict, fn) -> dict:
    """Percentiles of fn(x) from those of x for an increasing fn (order statistics map through fn;
    between two neighbours the interpolation differs by far less than either's rounding)."""
    return {k: (None if v is None else float(fn(v))) for k, v in summary.items() if k != "mean"}


def request_codes(table: pa.Table) -> tuple[np.ndarray, pa.Array]:
    """Integer code per row and the distinct request ids (codes index into them)."""
    enc = pc.dictionary_encode(table.column("request_id").combine_chunks())
    return enc.indices.to_numpy(zero_copy_only=False), enc.dictionary
