"""The rejection sampler's decisions checked against the reference's distribution (speculative decoding).

On a sampled verify step (`spec_sampled`), draft d_i, which the proposer drew with probability
q_i(d_i), is kept with probability min(1, p(d_i) / q_i(d_i)) (p: the target's distribution after the
temperature); the first rejected draft ends the step, replaced by a draw from max(0, p - q). The trace
says which drafts were verified (`draft_token_ids`), what q was (`draft_token_probs`; null: one-hot
drafts, q = 1) and how many were kept (`num_accepted_tokens`), on any row with drafts (vLLM calls an
attention-only model's such rows `extend`); the reference gives p: a kept draft is an output token
(`ref_logprob` at its position), and the first rejected one, when it is among the reference's top-k at
its position, has its logprob there. Each decision so has a probability under an honest sampler,
bounded from above:
  kept      min(1, p_hi / q), p_hi = the reference's p at the temperature normalised over its top-k and
            the draft only (fewer terms than the vocabulary: an upper bound; exact at temperature 1),
            divided by top_p (the nucleus holds at least that much) and times e^(2 slack / T)
  rejected  1 - min(1, p_lo / q), tested only at T <= 1 without top-p and with the draft among the
            reference's top-k there: p_lo = exp((lp - 2 slack) / T) (at T <= 1 the normaliser
            sum p^(1/T) is at most 1)
and, for a one-hot draft rejected at temperature 1 without top-p, the token drawn in its place has a
tail bound: the chance the residual (the target without the draft) gives a token as improbable, at most
(1 - p_lo(draft) - the mass of the reference's top-k entries above it) / (1 - p_hi(draft)).
slack (`decision_slack`): the logprob error an honest engine may show per token (8 x the expected
floor's 99th percentile of logit error, at least 0.01 nats, at most the divergent threshold; without a
floor, that threshold); a decision is tested only where the engine's reported logprob of the token
emitted there agrees with the reference's within it (the target the sampler saw is the reference's;
elsewhere the logprob test judges the position). Requests sampled with top-k are not tested (the kept
set's mass is not bounded by what the reference keeps).
An honest sampler makes a decision whose bound is at most c with probability at most c: a request is
flagged when one decision's bound is at most alpha/2 / (decisions tested in the run) (Bonferroni), or when
Fisher's combination of its decisions' p-values (the bound when under 1/2: the rarer outcome happened;
else 1) and its draws' tails is at most alpha/2 / (requests tested): an honest run is flagged with
probability at most alpha.

Contract (pure): `decision_test(tokens, reference, requests, trace, sampling, slack, alpha)` ->
`{request_id: (position, p, detail)}` for the flagged requests (the position of the decision, or of the
request's least likely one), and an info dict {tested, kept, rejected_tested, draws_tested, threshold,
request_threshold, smallest (the least likely decision's bound), alpha, requests, rule}; None when
nothing is tested (no trace columns, no sampled rows with drafts, greedy or top-k runs).
`raise_decisions(summary, found)`: those requests `divergent` there (column `spec_decision`: why);
`decision_signature(summary, crowded)`: the hypothesis signature `spec_decision_against_odds`;
`fisher(ps)`: Fisher's combination; `decision_slack(divergent, floor)`: the slack.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.feature import Feature
from lpf.analysis.speculative_features import prompt_lengths, row_requests

SIGNATURE = "spec_decision_against_odds"
RULE = (
    "a draft the rejection sampler kept or rejected with a probability under the reference's distribution at "
    "most alpha/2 / (decisions tested in the run), or a request whose decisions and draws together (Fisher) have "
    "one at most alpha/2 / (requests tested), is divergent there"
)
_TRACE = ("request_id", "num_computed_tokens", "num_scheduled_tokens", "num_draft_tokens")


def _decisions(requests: pa.Table, trace: pa.Table) -> dict[str, np.ndarray] | None:
    """Every tested decision as flat columns: request id, output position, draft, q, kept."""
    need = (*_TRACE, "num_accepted_tokens", "spec_sampled", "draft_token_ids")
    if trace is None or any(c not in trace.column_names for c in need):
        return None
    # any row with drafts verified (vLLM calls an attention-only model's such rows `extend`, not `verify`)
    mask = pc.and_(
        trace.column("spec_sampled").fill_null(False),
        pc.and_(pc.is_valid(trace.column("draft_token_ids")), pc.is_valid(trace.column("num_accepted_tokens"))),
    )
    rows = trace.filter(mask)
    if rows.num_rows == 0:
        return None
    rid = rows.column("request_id").to_numpy(zero_copy_only=False)
    req = row_requests(requests, rows.column("request_id"))
    prompt = np.full(req.size, -1, dtype=np.int64)  # -1: a request the run does not have
    prompt[req >= 0] = prompt_lengths(requests)[req[req >= 0]]
    col = {c: rows.column(c).to_numpy(zero_copy_only=False).astype(np.int64) for c in _TRACE[1:]}
    accepted = rows.column("num_accepted_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    # the row samples output positions from here on (spec_features' rule)
    start = col["num_computed_tokens"] + col["num_scheduled_tokens"] - col["num_draft_tokens"] - prompt
    ids = rows.column("draft_token_ids").combine_chunks()
    parent = pc.list_parent_indices(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    draft = pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = ids.offsets.to_numpy()[:-1].astype(np.int64) - int(ids.offset)
    index = np.arange(draft.size) - offsets[parent]  # the draft's place in its row
    q = np.ones(draft.size)  # one-hot drafts (no probabilities recorded): q = 1
    if "draft_token_probs" in rows.column_names and pa.types.is_list(rows.schema.field("draft_token_probs").type):
        probs = rows.column("draft_token_probs").combine_chunks()
        n_ids = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
        n_probs = pc.list_value_length(probs).fill_null(-1).to_numpy(zero_copy_only=False)
        ok = n_probs == n_ids  # a row's probabilities line up with its drafts
        if ok.any():
            q[np.flatnonzero(ok[parent])] = pc.list_flatten(probs.filter(pa.array(ok))).to_numpy(zero_copy_only=False)
    acc = accepted[parent]
    keep = (index <= acc) & (prompt[parent] >= 0) & (start[parent] >= 0)
    return {
        "request_id": rid[parent][keep],
        "position": (start[parent] + index)[keep],
        "draft": draft[keep],
        "q": q[keep],
        "kept": (index < acc)[keep],
    }


def _int32_positions(table: pa.Table) -> pa.Table:
    i = table.column_names.index("position")
    return table.set_column(i, "position", pc.cast(table.column(i), pa.int32()))


def _reference_at(tokens, reference, rid, pos) -> dict:
    """The emitted token, the reference's logprob of it and its top-k at each (request, position); a
    position the run did not score gets token -1 and no top-k."""
    keys = pa.table({"request_id": pa.array(rid, pa.string()), "position": pa.array(pos, pa.int32())})
    keys = keys.append_column("_i", pa.array(np.arange(len(rid))))
    ref = _int32_positions(reference.select(["request_id", "position"]))
    ref = ref.append_column("_r", pa.array(np.arange(ref.num_rows)))
    tok = _int32_positions(tokens.select(["request_id", "position", "token_id", "engine_logprob"]))
    on = ["request_id", "position"]
    got = keys.join(ref, on, join_type="inner").join(tok, on, join_type="inner").sort_by("_i")
    i = got.column("_i").to_numpy()
    at = got.column("_r").to_numpy()
    out = {"token": np.full(len(rid), -1, dtype=np.int64), "lp": np.full(len(rid), np.nan)}
    out["token"][i] = got.column("token_id").to_numpy(zero_copy_only=False)
    out["engine_lp"] = np.full(len(rid), np.nan)
    out["engine_lp"][i] = got.column("engine_logprob").to_numpy(zero_copy_only=False)
    out["lp"][i] = reference.column("ref_logprob").take(pa.array(at)).to_numpy(zero_copy_only=False)
    out["topk_ids"], out["topk_lps"] = [None] * len(rid), [None] * len(rid)
    ids = reference.column("ref_topk_ids").take(pa.array(at)).to_pylist()
    lps = reference.column("ref_topk_logprobs").take(pa.array(at)).to_pylist()
    for j, a, b in zip(i, ids, lps):
        out["topk_ids"][j], out["topk_lps"][j] = a, b
    return out


def decision_slack(divergent: float, floor: dict | None) -> float:
    """The logprob error an honest engine's decisions are allowed: the expected floor's (2 x 4 x its 99th
    percentile of logit error, at least 0.01), at most the divergent threshold; without a floor, that."""
    q99 = ((floor or {}).get("token") or {}).get("q99")
    return min(divergent, max(0.01, 8.0 * float(q99))) if q99 else divergent


def decision_keys(requests: pa.Table, trace: pa.Table | None, sampling: dict, reference_columns) -> pa.Table | None:
    """(request_id, position) of every decision `decision_test` would read the tokens and reference at
    (None when it would test nothing): the only rows the streamed analysis keeps for it."""
    if not _tested(sampling, reference_columns):
        return None
    d = _decisions(requests, trace)
    if d is None or d["draft"].size == 0:
        return None
    return pa.table(
        {"request_id": pa.array(d["request_id"], pa.string()), "position": pa.array(d["position"], pa.int32())}
    )


def _tested(sampling: dict, reference_columns) -> bool:
    t = float(sampling.get("temperature") or 0.0)
    return t > 0 and not (sampling.get("top_k") or 0) > 0 and "ref_topk_ids" in reference_columns


def decision_test(
    tokens: pa.Table,
    reference: pa.Table,
    requests: pa.Table,
    trace: pa.Table | None,
    sampling: dict,
    slack: float,
    alpha: float,
) -> tuple[dict, dict] | None:
    t = float(sampling.get("temperature") or 0.0)
    top_p = float(sampling.get("top_p") or 1.0)
    if not _tested(sampling, reference.column_names):
        return None
    d = _decisions(requests, trace)
    if d is None or d["draft"].size == 0:
        return None
    ref = _reference_at(tokens, reference, d["request_id"], d["position"])
    # the target the sampler saw is the reference's where the engine's logprob there agrees with it (a
    # position where it does not is judged by its logprob; no logprob returned: the reference's stands)
    agrees = ~(np.abs(ref["engine_lp"] - ref["lp"]) > slack)
    kept = d["kept"] & (ref["token"] == d["draft"]) & agrees  # a kept draft is the token emitted there
    err = 2.0 * slack / t
    bound = np.full(d["draft"].size, np.nan)
    for j in np.flatnonzero(kept | ~d["kept"]):
        ids, lps = ref["topk_ids"][j], ref["topk_lps"][j]
        if d["kept"][j]:
            lp = ref["lp"][j]
            if t == 1.0 or not ids:
                p_hi = math.exp(lp)
            else:
                terms = [x / t for x in lps] + ([] if d["draft"][j] in ids else [lp / t])
                top = max(terms)
                p_hi = math.exp(lp / t - top) / sum(math.exp(x - top) for x in terms)
            p_hi = p_hi / top_p * math.exp(err)
            bound[j] = min(1.0, p_hi / d["q"][j])
        elif agrees[j] and t <= 1.0 and top_p >= 1.0 and ids and int(d["draft"][j]) in ids:
            lp = lps[ids.index(int(d["draft"][j]))]
            bound[j] = 1.0 - min(1.0, math.exp((lp - 2.0 * slack) / t) / d["q"][j])
    tail = _recovered_tails(d, ref, agrees, t, top_p, slack)
    tested = np.isfinite(bound)
    n = int(tested.sum())
    if n == 0:
        return None
    found: dict = {}
    c = alpha / 2 / n  # half the run's alpha for single decisions, half for whole requests
    for j in np.flatnonzero(tested & (bound <= c)):
        rid, pos = str(d["request_id"][j]), int(d["position"][j])
        if rid not in found or pos < found[rid][0]:
            found[rid] = (pos, float(bound[j]), _said(d, j, bound[j]))
    # a request's decisions together: Fisher over each decision's p-value (its bound when under 1/2: the
    # rarer of its two outcomes happened; else 1) and each draw's tail
    pv = np.where(tested, np.where(bound < 0.5, bound, 1.0), np.nan)
    terms = {}
    for j in np.flatnonzero(tested | np.isfinite(tail)):
        rid = str(d["request_id"][j])
        terms.setdefault(rid, []).extend(x for x in (pv[j], tail[j]) if np.isfinite(x))
    c_req = alpha / 2 / max(len(terms), 1)
    worst = {}
    for j in np.flatnonzero(tested):
        rid = str(d["request_id"][j])
        if rid not in worst or pv[j] < pv[worst[rid]]:
            worst[rid] = j
    for rid, ps in terms.items():
        if rid in found or len(ps) < 2 or rid not in worst:
            continue
        p_req = fisher(ps)
        if p_req <= c_req:
            j = worst[rid]
            found[rid] = (
                int(d["position"][j]),
                p_req,
                f"the rejection sampler's {len(ps)} decisions and draws on this request have probability "
                f"{p_req:.3g} together under the reference's distribution (Fisher); the least likely: "
                + _said(d, j, bound[j]),
            )
    info = {
        "tested": n,
        "kept": int((tested & d["kept"]).sum()),
        "rejected_tested": int((tested & ~d["kept"]).sum()),
        "draws_tested": int(np.isfinite(tail).sum()),
        "threshold": c,
        "request_threshold": c_req,
        "smallest": float(bound[tested].min()),  # the least likely decision the run made
        "alpha": alpha,
        "requests": len(found),
        "rule": RULE,
    }
    return found, info


def _said(d: dict, j: int, b: float) -> str:
    what, verb = ("kept", "keeps") if d["kept"][j] else ("rejected", "rejects")
    pos = int(d["position"][j])
    return (
        f"the rejection sampler {what} draft {int(d['draft'][j])} at output position {pos} (draft "
        f"probability {d['q'][j]:.3g}), which the target {verb} with probability "
        f"at most {b:.3g} (the reference's distribution)"
    )


def _recovered_tails(d, ref, agrees, t: float, top_p: float, slack: float) -> np.ndarray:
    """Per rejected one-hot draft (q = 1) at temperature 1 without top-p: an upper bound on the chance an
    honest sampler draws, in its place, a token as improbable as the one emitted (its residual is the
    target with the draft left out: the tail below the token's p, over 1 - p(draft)). NaN elsewhere."""
    out = np.full(d["draft"].size, np.nan)
    if t != 1.0 or top_p < 1.0:
        return out
    up, down = math.exp(slack), math.exp(-slack)
    for j in np.flatnonzero(~d["kept"] & agrees & (d["q"] == 1.0) & (ref["token"] >= 0)):
        ids, lps = ref["topk_ids"][j], ref["topk_lps"][j]
        draft, token = int(d["draft"][j]), int(ref["token"][j])
        if not ids or token == draft:
            continue
        p_token = math.exp(ref["lp"][j]) * up
        known = draft in ids
        p_draft_hi = math.exp(lps[ids.index(draft)] if known else min(lps)) * up
        p_draft_lo = math.exp(lps[ids.index(draft)]) * down if known else 0.0
        above = sum(math.exp(x) * down for y, x in zip(ids, lps) if y != draft and math.exp(x) * down > p_token)
        rest = 1.0 - p_draft_hi  # the residual's mass, at least
        out[j] = min(1.0, max(0.0, 1.0 - p_draft_lo - above) / rest) if rest > 0 else 1.0
    return out


def fisher(ps: list[float]) -> float:
    """Fisher's combination of independent p-values: P(chi2 with 2k dof >= -2 sum ln p)."""
    k = len(ps)
    x = -sum(math.log(max(p, 1e-300)) for p in ps)  # half the chi-square statistic
    # survival of chi2(2k) at 2x: exp(-x) sum_{i<k} x^i / i!, in logs
    terms = [i * math.log(x) - math.lgamma(i + 1) - x for i in range(k)] if x > 0 else [0.0]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in terms))


def raise_decisions(summary: pa.Table, found: dict) -> pa.Table:
    """`summary` with the requests in `found` raised to `divergent` (a worse verdict stays) and their
    first divergence moved to the decision's position when earlier; column `spec_decision` says why."""
    ids = summary.column("request_id").to_pylist()
    verdict = summary.column("verdict").to_pylist()
    first = summary.column("first_divergence").to_pylist()
    why = [None] * len(ids)
    for i, rid in enumerate(ids):
        if rid not in found:
            continue
        pos, _, detail = found[rid]
        why[i] = detail
        if verdict[i] in ("clean", "noise"):
            verdict[i] = "divergent"
        if first[i] is None or pos < first[i]:
            first[i] = pos
    out = summary.set_column(
        summary.column_names.index("verdict"), "verdict", pa.array(verdict, summary.schema.field("verdict").type)
    )
    out = out.set_column(
        out.column_names.index("first_divergence"),
        "first_divergence",
        pa.array(first, summary.schema.field("first_divergence").type),
    )
    return out.append_column("spec_decision", pa.array(why, pa.string()))


def decision_signature(summary: pa.Table, crowded: np.ndarray | None = None) -> Feature | None:
    """`spec_decision_against_odds`, aligned to `summary`: the requests the decision test raised
    (`spec_decision` set); None when none. `crowded` (spec_features' sampled_spec_batch_over_2, same
    alignment) adds how many of them were sampled speculatively beside 2 or more other sequences."""
    if "spec_decision" not in summary.column_names:
        return None
    hit = pc.is_valid(summary.column("spec_decision")).to_numpy(zero_copy_only=False)
    if not hit.any():
        return None
    tail = ""
    if crowded is not None and len(crowded) == len(hit):
        tail = f"; {int((hit & crowded).sum())} of them in steps verifying drafts of > 2 sequences"
    return Feature(
        SIGNATURE,
        "bool",
        hit,
        "had a draft kept or rejected against the target's odds given the draft's own probability (the "
        "rejection sampler read another distribution than the target's and the draft's: another request's "
        f"draft probabilities, or another row's target){tail}",
    )
