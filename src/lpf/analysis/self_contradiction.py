"""Answers that contradict themselves: evidence whatever the floor.

An engine reports, per output token, the sampled token's logprob and (when asked) its top-k list. Both
come from one distribution, so an honest answer satisfies, up to the rounding of its own numbers (TOL):
  - `topk_mismatch`: the token's reported logprob equals its own entry in the top-k list, when listed;
  - `topk_order`: the top-k list is in descending order;
  - `over_one`: no logprob, reported or listed, is above 0 (a probability over 1; OVER_ONE past bfloat16's
    rounding of a log-softmax).
A server that lowers the reported logprob of some tokens by nats and leaves their top-k entries as they
were breaks the first rule on every such token, whatever the engine's dtype and however lenient its floor
(no honest bfloat16 engine reports a token twice with two numbers). The checks need no reference. A token
missing from its own list is no contradiction to judge: a recorder that maps a server's token strings back to
ids keeps only the entries it can map (`lpf watch` recorded lists of 2 where the server sent 5).

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

from lpf.analysis.columns import one_array
from lpf.analysis.raising import raise_divergent

# an answer's own numbers agree to their printing's rounding (float32 logprobs, 6-digit probabilities:
# 1e-6 relative); 0.01 nats is far above that and far below a lie worth reporting
TOL = 0.01
# a logprob computed as x - logsumexp(x) in bfloat16 can come out positive by an ulp of the logsumexp
# (0.0625 for values in [8, 16), 0.125 in [16, 32)): "over 1" starts past that
OVER_ONE = 0.25
KINDS = ("topk_mismatch", "topk_order", "over_one")
# rule code -> kind, in the order a row's first broken rule is named (3: the reported logprob over 1, 4: a listed one)
_RULES = {0: "topk_mismatch", 2: "topk_order", 3: "over_one", 4: "over_one"}
RULE = (
    f"a token whose reported logprob differs from its own top-k entry by more than {TOL} nats (or an "
    "out-of-order top-k list, a probability over 1) is an answer that "
    "contradicts itself: at least divergent there, whatever the floor"
)


def contradictions(tokens: pa.Table) -> dict[str, tuple[int, str, str]]:
    if tokens.num_rows == 0 or "engine_logprob" not in tokens.column_names:
        return {}
    eng = np.asarray(tokens.column("engine_logprob").to_numpy(zero_copy_only=False), dtype=np.float64)
    tok = np.asarray(tokens.column("token_id").to_numpy(zero_copy_only=False))
    with np.errstate(invalid="ignore"):
        broken = {3: np.flatnonzero(eng > OVER_ONE)}  # rule code -> rows breaking it (a few, or none)
    lists = None
    if "engine_topk_ids" in tokens.column_names and "engine_topk_logprobs" in tokens.column_names:
        lists = _topk_matrix(tokens, eng.size)
    if lists is not None:
        broken.update(_topk_checks(eng, tok, *lists))
    rows = np.unique(np.concatenate(list(broken.values())))
    if not rows.size:
        return {}
    # the first rule each row breaks is named, with its numbers (only these rows are read again)
    pos = tokens.column("position").take(pa.array(rows)).to_pylist()
    rid = tokens.column("request_id").take(pa.array(rows)).to_pylist()
    found: dict[str, tuple[int, str, str]] = {}
    for r, p, i in zip(rid, pos, rows.tolist()):
        code = min(c for c, at in broken.items() if _has(at, i))
        hit = (int(p), _RULES[code], _detail(code, i, tok, eng, lists))
        if r not in found or hit[0] < found[r][0]:
            found[r] = hit
    return found


def _has(sorted_rows: np.ndarray, i: int) -> bool:
    j = np.searchsorted(sorted_rows, i)
    return j < sorted_rows.size and sorted_rows[j] == i


def _topk_matrix(tokens: pa.Table, n: int):
    """(ids [n, k], logprobs [n, k], lens [n]) of the engine's top-k lists, padded (id -1, logprob -inf) where a
    list is shorter; for the common uniform lists views of the flattened values (no copy). None without lists,
    or with lists whose ids and logprobs do not pair up (the adapter says so elsewhere)."""
    ids_col = one_array(tokens.column("engine_topk_ids"))  # a slice's one chunk as it is (no copy)
    lp_col = one_array(tokens.column("engine_topk_logprobs"))
    offsets, lp_offsets = ids_col.offsets.to_numpy(), lp_col.offsets.to_numpy()
    if offsets[0] != lp_offsets[0]:
        offsets, lp_offsets = offsets - offsets[0], lp_offsets - lp_offsets[0]
    if not np.array_equal(offsets, lp_offsets):
        return None
    offsets = ids_col.offsets.to_numpy()
    lens = np.diff(offsets)
    if ids_col.null_count:
        lens = np.where(ids_col.is_null().to_numpy(zero_copy_only=False), 0, lens)
    k = int(lens.max(initial=0))
    if k == 0:
        return None
    ids_flat = ids_col.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    o = lp_col.offsets.to_numpy()
    lps_flat = lp_col.values.to_numpy(zero_copy_only=False)[o[0] : o[-1]]
    if lens.min() == k and ids_flat.size == n * k:
        return ids_flat.reshape(n, k), lps_flat.reshape(n, k), lens
    ids, lps = np.full((n, k), -1, ids_flat.dtype), np.full((n, k), -np.inf, np.float32)
    row = np.repeat(np.arange(n), lens)
    col = np.arange(row.size) - np.repeat(np.r_[0, np.cumsum(lens)[:-1]], lens)
    if ids_flat.size != row.size:
        return None
    ids[row, col], lps[row, col] = ids_flat, lps_flat
    return ids, lps, lens


def _topk_checks(eng: np.ndarray, tok: np.ndarray, ids: np.ndarray, lps: np.ndarray, lens: np.ndarray) -> dict:
    """Rule code -> sorted rows breaking it. The token's own entry is mostly the list's first (greedy, and
    most sampled tokens): compared there in one pass, matched id by id only on the other rows."""
    has = lens > 0
    with np.errstate(invalid="ignore", over="ignore"):
        first = ids[:, 0] == tok
        mismatch = first & (np.abs(eng - lps[:, 0]) > TOL)
        out = {0: np.flatnonzero(mismatch), 2: np.zeros(0, np.int64)}
        rest = np.flatnonzero(has & ~first)
        if rest.size:
            match = ids[rest] == tok[rest, None]
            listed = match.any(axis=1)
            own = lps[rest, match.argmax(axis=1)]
            e = eng[rest]
            out[0] = np.union1d(out[0], rest[listed & (np.abs(e - own) > TOL)])
        if ids.shape[1] > 1:
            out[2] = np.flatnonzero((lps[:, 1:] > lps[:, :-1] + TOL).any(axis=1))
        # a sorted list's largest entry is its first; an unsorted one breaks the order rule already
        out[4] = np.flatnonzero(lps[:, 0] > OVER_ONE)
    return out


def _detail(code: int, i: int, tok: np.ndarray, eng: np.ndarray, lists) -> str:
    """The numbers of row `i` breaking rule `code` (`_RULES`), in words."""
    if code == 3:
        return f"reported logprob {eng[i]:.5g} > 0 (a probability over 1)"
    ids, lps, lens = lists
    row_ids, row_lps = ids[i, : lens[i]], lps[i, : lens[i]].astype(np.float64)
    if code == 0:
        own = row_lps[np.flatnonzero(row_ids == tok[i])[0]]
        return f"reported logprob {eng[i]:.5g}, its own top-k entry {own:.5g} ({abs(eng[i] - own):.3g} nats apart)"
    if code == 2:
        return "the top-k list is not in descending order"
    return f"a top-k logprob of {row_lps.max():.5g} > 0 (a probability over 1)"


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
