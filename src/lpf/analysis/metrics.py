"""Per-token metrics: engine tokens joined with reference scores, named as the RL ecosystem names them.

With d = engine_logprob - ref_logprob:
  abs_logprob_diff      |d|                                  (slime, SkyRL)
  prob_diff             |exp(engine) - exp(ref)|             (verl rollout_probs_diff)
  k3_kl                 rho - log(rho) - 1, rho = exp(-d)    (verl rollout_corr/k3_kl, prime-rl)
  token_mult_prob_error exp(|d|)                             (NeMo-RL)
  greedy_flip           greedy run and the reference's argmax beats the engine's token by > tie_margin
  gibberish             engine confident, reference says improbable
Input and output are Arrow tables; the math is numpy over whole columns.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.thresholds import Thresholds

_REF_COLS = ["request_id", "position", "ref_logprob", "ref_rank", "ref_entropy", "ref_top1_id", "ref_top1_logprob"]


def join_scored(tokens: pa.Table, reference: pa.Table) -> pa.Table:
    """Engine tokens that have a reference score, sorted by (request_id, position)."""
    eng = tokens.select(["request_id", "position", "token_id", "engine_logprob"])
    joined = eng.join(reference.select(_REF_COLS), keys=["request_id", "position"], join_type="inner")
    return joined.sort_by([("request_id", "ascending"), ("position", "ascending")])


def token_metrics(joined: pa.Table, greedy: bool, th: Thresholds) -> pa.Table:
    """Adds the metric columns to a `join_scored` table."""
    eng = joined.column("engine_logprob").to_numpy()
    ref = joined.column("ref_logprob").to_numpy()
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
    if greedy:
        top1 = joined.column("ref_top1_id").to_numpy()
        tok = joined.column("token_id").to_numpy()
        margin = joined.column("ref_top1_logprob").to_numpy() - ref
        flip = (tok != top1) & (margin > th.tie_margin)
    else:
        flip = np.zeros(len(eng), dtype=bool)
    cols["greedy_flip"] = flip
    cols["gibberish"] = (eng >= th.confident_logprob) & (ref <= th.improbable_logprob)
    for name, values in cols.items():
        joined = joined.append_column(name, pa.array(values))
    return joined


def percentiles(values: np.ndarray) -> dict:
    """llama.cpp-style summary of a per-token error distribution."""
    values = values[np.isfinite(values)]
    if values.size == 0:
        return {k: None for k in ("p50", "p90", "p99", "p99_9", "max", "mean")}
    q = np.quantile(values, [0.5, 0.9, 0.99, 0.999])
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "p99_9": float(q[3]),
            "max": float(values.max()), "mean": float(values.mean())}


def request_codes(table: pa.Table) -> tuple[np.ndarray, pa.Array]:
    """Integer code per row and the distinct request ids (codes index into them)."""
    enc = pc.dictionary_encode(table.column("request_id").combine_chunks())
    return enc.indices.to_numpy(zero_copy_only=False), enc.dictionary
