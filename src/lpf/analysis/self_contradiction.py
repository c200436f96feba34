"""Answers that contradict themselves: evidence whatever the floor.

An engine reports, per output token, the sampled token's logprob and (when asked) its top-k list. Both
come from one distribution, so an honest answer satisfies, up to the rounding of its own numbers (TOL):
  - `topk_mismatch`: the token's reported logprob equals its own entry in the top-k list, when listed;
  - `not_listed`: a token missing from its top-k list is no likelier than the list's last entry;
  - `topk_order`: the top-k list is in descending order;
  - `over_one`: no logprob, reported or listed, is above 0 (a probability over 1; OVER_ONE past bfloat16's
    rounding of a log-softmax).
A server that lowers the reported logprob of some tokens by nats and leaves their top-k entries as they
were breaks the first rule on every such token, whatever the engine's dtype and however lenient its floor
(no honest bfloat16 engine reports a token twice with two numbers). The checks need no reference.

Contract (pure: an Arrow table in, plain data out; rows are judged one by one, so any subset of whole or
partial requests, in any order, gives the same per-row results: the streamed analysis runs it chunk by chunk
and keeps, per request, the earliest position):
  `contradictions(tokens) -> dict[request_id, (position, kind, detail)]`: the first contradicting token of
      each request that has one (`tokens`: request_id, position, token_id, engine_logprob,
      engine_topk_ids, engine_topk_logprobs; rows without a top-k list are checked for `over_one` only).
  Two chunks' results merge with `raising.merge_first`.
  `raise_contradictions(summary, found) -> summary`: those requests at least `divergent`, their first
      divergence moved to the contradiction when earlier, and column `self_contradiction` saying what
      the answer said twice.
  `block(found, n_requests) -> dict`: findings.json's `self_contradiction` (requests, kinds, rule).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.raising import raise_divergent

# an answer's own numbers agree to their printing's rounding (float32 logprobs, 6-digit probabilities:
# 1e-6 relative); 0.01 nats is far above that and far below a lie worth reporting
TOL = 0.01
# a logprob computed as x - logsumexp(x) in bfloat16 can come out positive by an ulp of the logsumexp
# (0.0625 for values in [8, 16), 0.125 in [16, 32)): "over 1" starts past that
OVER_ONE = 0.25
KINDS = ("topk_mismatch", "not_listed", "topk_order", "over_one")
RULE = (
    f"a token whose reported logprob differs from its own top-k entry by more than {TOL} nats (or is missing "
    "from a top-k list it outranks, an out-of-order top-k list, a probability over 1) is an answer that "
    "contradicts itself: at least divergent there, whatever the floor"
)


def contradictions(tokens: pa.Table) -> dict[str, tuple[int, str, str]]:
    if tokens.num_rows == 0 or "engine_logprob" not in tokens.column_names:
        return {}
    eng = np.asarray(tokens.column("engine_logprob").to_numpy(zero_copy_only=False), dtype=np.float64)
    pos = np.asarray(tokens.column("position").to_numpy(zero_copy_only=False), dtype=np.int64)
    tok = np.asarray(tokens.column("token_id").to_numpy(zero_copy_only=False), dtype=np.int64)
    n = eng.size
    first_kind = np.full(n, -1, np.int8)
    detail = np.full(n, None, dtype=object)
    with np.errstate(invalid="ignore"):
        over = eng > OVER_ONE
    _mark(first_kind, detail, over, 3, lambda i: f"reported logprob {eng[i]:.5g} > 0 (a probability over 1)")
    if "engine_topk_ids" in tokens.column_names and "engine_topk_logprobs" in tokens.column_names:
        _topk_checks(tokens, eng, tok, first_kind, detail)
    rows = np.flatnonzero(first_kind >= 0)
    if not rows.size:
        return {}
    rid = tokens.column("request_id").take(pa.array(rows)).to_pylist()
    found: dict[str, tuple[int, str, str]] = {}
    for r, i in zip(rid, rows.tolist()):
        hit = (int(pos[i]), KINDS[first_kind[i]], str(detail[i]))
        if r not in found or hit[0] < found[r][0]:
            found[r] = hit
    return found


def _mark(kind: np.ndarray, detail: np.ndarray, where: np.ndarray, code: int, say) -> None:
    """Record `code` at the rows of `where` that have no earlier kind (the first rule broken is named)."""
    for i in np.flatnonzero(where & (kind < 0)).tolist():
        kind[i] = code
        detail[i] = say(i)


def _topk_checks(tokens: pa.Table, eng: np.ndarray, tok: np.ndarray, kind: np.ndarray, detail: np.ndarray) -> None:
    ids_col = tokens.column("engine_topk_ids").combine_chunks()
    lp_col = tokens.column("engine_topk_logprobs").combine_chunks()
    lens = pc.list_value_length(ids_col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    lp_lens = pc.list_value_length(lp_col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if not lens.any() or not np.array_equal(lens, lp_lens):
        return  # no lists, or lists whose ids and logprobs do not pair up (the adapter says so elsewhere)
    k = int(lens.max())
    # a [rows, k] matrix view, padded where a list is shorter (id -1, logprob -inf): one layout for every
    # check, and for the common uniform lists no copy beyond the flattening
    ids_flat = np.asarray(pc.list_flatten(ids_col).to_numpy(zero_copy_only=False), dtype=np.int64)
    lps_flat = np.asarray(pc.list_flatten(lp_col).to_numpy(zero_copy_only=False), dtype=np.float64)
    if (lens == k).all():
        ids, lps = ids_flat.reshape(-1, k), lps_flat.reshape(-1, k)
    else:
        ids, lps = np.full((eng.size, k), -1, np.int64), np.full((eng.size, k), -np.inf)
        col = np.arange(ids_flat.size) - np.repeat(np.r_[0, np.cumsum(lens)[:-1]], lens)
        row = np.repeat(np.arange(eng.size), lens)
        ids[row, col], lps[row, col] = ids_flat, lps_flat
    has = lens > 0
    with np.errstate(invalid="ignore", over="ignore"):
        # the token's own entry, where listed: mostly the first (greedy), matched id by id only elsewhere
        own_lp = np.where(ids[:, 0] == tok, lps[:, 0], np.nan)
        rest = np.flatnonzero(has & (ids[:, 0] != tok))
        if rest.size:
            match = ids[rest] == tok[rest, None]
            at = match.argmax(axis=1)
            own_lp[rest] = np.where(match.any(axis=1), lps[rest, at], np.nan)
        listed = ~np.isnan(own_lp)
        gap = np.abs(eng - own_lp)
        _mark(
            kind,
            detail,
            listed & (gap > TOL),
            0,
            lambda i: f"reported logprob {eng[i]:.5g}, its own top-k entry {own_lp[i]:.5g} ({gap[i]:.3g} nats apart)",
        )
        last = lps[np.arange(eng.size), np.maximum(lens - 1, 0)]
        _mark(
            kind,
            detail,
            has & ~listed & (eng > last + TOL),
            1,
            lambda i: f"reported logprob {eng[i]:.5g} outranks the top-k list's last entry {last[i]:.5g}, "
            "yet the token is not listed",
        )
        if k > 1:
            rise = (lps[:, 1:] > lps[:, :-1] + TOL).any(axis=1)
            _mark(kind, detail, rise, 2, lambda i: "the top-k list is not in descending order")
        top = lps.max(axis=1)
        _mark(kind, detail, top > OVER_ONE, 3, lambda i: f"a top-k logprob of {top[i]:.5g} > 0 (a probability over 1)")


def raise_contradictions(summary: pa.Table, found: dict) -> pa.Table:
    said = {rid: (pos, f"{kind} at position {pos}: {text}") for rid, (pos, kind, text) in found.items()}
    return raise_divergent(summary, said, "self_contradiction")


def block(found: dict, n_requests: int) -> dict | None:
    if not found:
        return None
    kinds = {k: 0 for k in KINDS}
    for _, kind, _ in found.values():
        kinds[kind] += 1
    return {"requests": len(found), "of": n_requests, "kinds": {k: v for k, v in kinds.items() if v}, "rule": RULE}
