"""Requests whose own tokens reject the expected floor, in a run the run-level test rejects.

A `noise` request departs from the reference by more than the clean threshold but less than the
divergent one (0.5 nats by default): small, yet not necessarily rounding. Against an expected floor
(the shipped table for the run's dtype pair, or a calibration run: nothing the engine reports moves
it) the question "is this request's departure more than its dtype explains" has an exact answer,
the run-level test's (`run_test`), asked of that request's tokens alone. A state that is nearly
right (a stale conv state of the first three tokens, a checkpoint a token short) shifts every later
logprob by tenths of a nat where float32 moves them by 1e-4: noise to the fixed threshold,
unmistakable to the floor.

Contract (pure: arrays and a summary table in, a summary table and a dict out):
`raise_localized(summary, test, exceed, token_request_ids, alpha)` -> (summary, info). `exceed`: the
run-level test's per-token evidence (`token_evidence(...)["logprob"]`: the token's error past
KAPPA x the floor's 99th percentile, or a greedy flip past its tie margin), `token_request_ids` the
request of each of those tokens. A `noise` request becomes `divergent` when
  - the run-level test rejected the run (`test["result"] == "different"`), and
  - the departure is localized: at least MIN_CLEAN requests are `clean` (every token within the
    clean threshold) and the engine's arithmetic is honest where its state is: CLEAN_SHARE of the
    scored requests are clean, or, when fewer are (a drill that corrupts 96% of a run leaves 4%
    clean), the clean requests' own tokens accept the floor (their pooled exceedances not
    improbable at `alpha`). A lie small everywhere (a quantized model, noise on every logprob)
    leaves no request clean, or clean ones whose tokens still reject the floor, and stays the
    run-level `systematic`, not a verdict on each request, and
  - its exceedance count k of n tokens is improbable under the floor: P(Binomial(n, NULL_RATE) >= k)
    times the number of scored requests (Bonferroni over the requests tested) below `alpha`.
`info` (findings.json's `run_test.localized`): {requests: how many were raised, clean, scored,
rule}; None when the rule did not apply (no test, the run not rejected, or the departure everywhere).
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.levels import REQUEST_VERDICTS
from lpf.analysis.run_test import DEFAULT_ALPHA, NULL_RATE
from lpf.analysis.stats import binom_log_tail

MIN_CLEAN = 5
CLEAN_SHARE = 0.05

RULE = (
    "a noise request whose own tokens reject the expected floor (Bonferroni over the scored requests) "
    "in a run the run-level test rejects while some requests are clean is divergent"
)
RULE_FEW_CLEAN = f" (fewer than {CLEAN_SHARE:.0%} clean: the clean requests' own tokens accept the floor)"


def raise_localized(
    summary: pa.Table, test: dict | None, exceed: np.ndarray | None, token_request_ids, alpha: float = DEFAULT_ALPHA
) -> tuple[pa.Table, dict | None]:
    if test is None or test.get("result") != "different" or exceed is None or len(exceed) == 0:
        return summary, None
    verdict = np.asarray(summary.column("verdict").to_pylist(), dtype=object)
    scored = int(np.isin(verdict, REQUEST_VERDICTS).sum())
    clean = int(np.count_nonzero(verdict == "clean"))
    if clean < MIN_CLEAN:
        return summary, None
    ids = summary.column("request_id").combine_chunks()
    tok_ids = (
        token_request_ids.combine_chunks()
        if isinstance(token_request_ids, pa.ChunkedArray)
        else pa.array(token_request_ids)
        if not isinstance(token_request_ids, pa.Array)
        else token_request_ids
    )
    rule = RULE
    if clean < CLEAN_SHARE * scored:
        if not _clean_tokens_accept(exceed, tok_ids, ids.filter(pa.array(verdict == "clean")), alpha):
            return summary, None
        rule = RULE + RULE_FEW_CLEAN
    noise = verdict == "noise"
    raised = 0
    if noise.any():
        noise_ids = ids.filter(pa.array(noise))
        at = pc.index_in(tok_ids, value_set=noise_ids).fill_null(-1).to_numpy(zero_copy_only=False)
        keep = at >= 0
        n = np.bincount(at[keep], minlength=len(noise_ids))
        k = np.bincount(at[keep], weights=np.asarray(exceed)[keep].astype(np.float64), minlength=len(noise_ids))
        bound = math.log(alpha) - math.log(max(scored, 1))
        hit = np.asarray(binom_log_tail(k, n, NULL_RATE)) < bound
        if hit.any():
            where = np.flatnonzero(noise)[hit]
            verdict[where] = "divergent"
            raised = int(hit.sum())
            col = summary.column_names.index("verdict")
            summary = summary.set_column(col, "verdict", pa.array(verdict.tolist(), pa.string()))
    return summary, {"requests": raised, "clean": clean, "scored": scored, "rule": rule}


def _clean_tokens_accept(exceed, tok_ids: pa.Array, clean_ids: pa.Array, alpha: float) -> bool:
    """Whether the clean requests' tokens, pooled, accept the floor: their exceedance count is not
    improbable under NULL_RATE at `alpha` (one test, no correction)."""
    mine = pc.is_in(tok_ids, value_set=clean_ids).fill_null(False).to_numpy(zero_copy_only=False)
    n = int(mine.sum())
    if n == 0:
        return False  # clean requests the test read no token of: no evidence the arithmetic is honest
    k = int(np.count_nonzero(np.asarray(exceed)[mine]))
    return binom_log_tail(k, n, NULL_RATE) >= math.log(alpha)
