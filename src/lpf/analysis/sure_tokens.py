"""Per-token allowed error that knows how sure the reference was.

The divergent threshold is one number per run (`calibration`): an expected floor raises it to
DIVERGENT_TAIL x the floor's 99th percentile of logit error, because a token whose distribution is flat
moves by the whole logit error. A token the reference is sure of does not: widening bfloat16's floor for flat
prose to 2.0 nats let a server lower a p ~ 1 token's logprob by 2 nats unseen (issue 52). Here each token the
reference is sure of gets its own allowance, the most its logprob can drop when every other logit rises by
the largest honest logit error against it (exact, not the sensitivity's linearization, which at p = 0.9998
and 4x bfloat16's percentile underestimates the drop tenfold):

    allowed = min(divergent_abs_diff, max(SURE_MIN, log(p + (1 - p) exp(delta))))     where p >= P_SURE
    delta   = SURE_TAIL x H x token_q99

token_q99 the expected floor's 99th percentile of logit error, H the largest honest departure the floor carries
for tokens (other honest kernels: at least 1). SURE_TAIL = 8: on tiny:jamba-longmem in bfloat16 (the roughest
model measured, q99 1.13) honest sure tokens moved by up to 0.33 nats, as far as 6.9 nats of logit error
moves a p = 0.9998 token: 6x the percentile. A lie of 1.5 nats on such a token needs 9.8 nats, 18x
zoo:hybrid's bfloat16 percentile. Unsure tokens (p < P_SURE) keep the flat threshold (a sampled or tempered
run's are judged as before), and SURE_MIN keeps the rule to moves worth a verdict (0.1 nats).

Contract (pure, numpy in, numpy and dicts out; rows are judged one by one, so it runs chunk by chunk):
  `allowed(ref_logprob, floor, divergent_abs_diff) -> float64 array` (inf where the reference is not sure;
      None when the floor has no token percentile).
  `departures(d, allowed, divergent_abs_diff) -> bool array`: |d| past the allowance and within the flat
      threshold (past it the token is flagged already; a NaN d is not: absent logprobs are the tokens-only rule's).
  `first_departures(request_ids, positions, d, ref_logprob, floor, divergent_abs_diff)
      -> dict[request_id, (position, detail)]` (two chunks' results merge with `raising.merge_first`).
  `raise_sure(summary, found)`: those requests at least `divergent`, first divergence moved there when
      earlier, column `sure_token` saying which token moved and by how much against its allowance.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lpf.analysis.raising import raise_divergent

SURE_MIN = 0.1
SURE_TAIL = 8.0
P_SURE = 0.9
LOG_P_SURE = float(np.log(P_SURE))
RULE = (
    "a token the reference is sure of dropping further than every other logit rising by the largest honest logit "
    f"error allows (reference p >= {P_SURE}: log(p + (1 - p) exp({SURE_TAIL:g} x honest x q99)), at least {SURE_MIN} "
    "nats, at most the divergent threshold) is divergent"
)


def allowed(ref_logprob: np.ndarray, floor: dict | None, divergent_abs_diff: float):
    q99 = ((floor or {}).get("token") or {}).get("q99")
    if not q99:
        return None
    honest = max(1.0, float(((floor or {}).get("honest") or {}).get("token") or 1.0))
    lp = np.minimum(np.asarray(ref_logprob, dtype=np.float64), 0.0)
    delta = min(SURE_TAIL * honest * float(q99), 700.0)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(lp)
        drop = np.log(p + -np.expm1(lp) * np.exp(delta))  # every other logit up by delta against the token
        out = np.minimum(np.maximum(SURE_MIN, drop), divergent_abs_diff)
        out[~(lp >= LOG_P_SURE)] = np.inf  # not sure: the flat threshold's alone
    return out


def departures(d: np.ndarray, allow: np.ndarray, divergent_abs_diff: float) -> np.ndarray:
    """The tokens past their allowance that the flat threshold lets through (past it, they are flagged already)."""
    with np.errstate(invalid="ignore"):
        ad = np.abs(d)
        return (ad > allow) & (ad <= divergent_abs_diff)


def first_departures(
    request_ids,
    positions: np.ndarray,
    d: np.ndarray,
    ref_logprob: np.ndarray,
    floor: dict | None,
    divergent_abs_diff: float,
) -> dict:
    """The first departing token of each request: (position, detail). `request_ids` an Arrow array or list.
    Only tokens that can depart are judged: sure (p >= P_SURE) and moved past SURE_MIN, the allowance's least
    (a pass of two comparisons; the allowance itself for those few)."""
    with np.errstate(invalid="ignore"):
        ad = np.abs(d)
        cand = np.flatnonzero((ad > SURE_MIN) & (ad <= divergent_abs_diff) & (ref_logprob >= LOG_P_SURE))
    if not cand.size:
        return {}
    allow = allowed(ref_logprob[cand], floor, divergent_abs_diff)
    if allow is None:
        return {}
    rows = cand[departures(d[cand], allow, divergent_abs_diff)]
    if not rows.size:
        return {}
    allow_at = dict(zip(cand.tolist(), allow.tolist()))
    rid = (
        request_ids.take(pa.array(rows)).to_pylist() if hasattr(request_ids, "take") else [request_ids[i] for i in rows]
    )
    found: dict[str, tuple[int, str]] = {}
    for r, i in zip(rid, rows.tolist()):
        pos = int(positions[i])
        if r not in found or pos < found[r][0]:
            found[r] = (
                pos,
                f"moved {abs(float(d[i])):.3g} nats where the floor allows a token this sure {allow_at[i]:.3g}",
            )
    return found


def raise_sure(summary: pa.Table, found: dict) -> pa.Table:
    said = {rid: (pos, f"position {pos}: {text}") for rid, (pos, text) in found.items()}
    return raise_divergent(summary, said, "sure_token")
