"""Whose answer is this? Plan and judge the re-scoring of flagged outputs under other requests' prompts.

Contract (pure: tables in, plain data out; the scoring itself is `lpf.pipeline.attribute`):
- `plan(requests, summary, max_flagged, max_candidates, small_run) -> list[dict]`: for each flagged
  request (divergent, corrupt; worst first, at most `max_flagged`), the requests it could have
  received an answer from: those in flight at an overlapping time (`t_submit`..`t_finish`), or every
  request when the run has at most `small_run` requests or the flagged one has no timestamps; one candidate per
  distinct prompt (rollouts of one prompt would score alike), never its own prompt, nor one sharing
  at least half of its prompt (and 16 tokens) as a common prefix (a prefix cache hands such requests the same state:
  a wrong state of the shared part makes the output likelier under either prompt, so a likeness there
  says nothing about crossed answers), the nearest arrivals first, at most `max_candidates`. Each entry: {request_id, candidates, same_prompt
  {candidate: [other requests with that prompt]}}.
- `judge(plans, scores, own, lost) -> list[dict]`: `scores` holds (request_id, candidate_id, n_tokens,
  logprob_sum) of each flagged output under each candidate's prompt, `own` maps a request to the
  logprob sum of its output under its own prompt (the reference scores), `lost` names the requests
  that did not get a right answer themselves (flagged or failed). A flagged request is attributed
  to its best candidate when the log-likelihood gain g = best - own makes chance implausible,
  p = n_candidates * exp(-g) < MAX_P (by Markov's inequality a prompt cannot make a sample of
  another prompt's distribution e^g times likelier with probability above e^-g; the candidate count
  is a Bonferroni factor), and no other candidate comes within MIN_MARGIN nats of it. Two prompts
  that explain the output alike (their answers coincide) are told apart only by who lost an answer:
  a request that got its own right answer cannot also have given it away, so when exactly one of
  the near-tied candidates is in `lost`, it is the one; otherwise nothing is claimed. `typical` (the
  median per-token reference logprob of the run's clean outputs under their own prompts, when known):
  a crossed answer is an honest sample of its source's prompt, so under that prompt it must fit about
  as well as clean outputs fit theirs, within FIT_SLACK nats per token; a wrong output that another
  prompt merely explains less badly than its own (a state gone wrong produces such garbage) is no
  crossed answer, however large its gain over its own prompt.
- `hypotheses(attributed, n_flagged, n_other) -> list[dict]`: each attribution as a hypothesis in
  the shape of `hypotheses.rank_hypotheses` ("request X received the answer meant for request Y",
  with the gain), for `merge_ranked` to rank with the others.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from lpf.analysis.verdicts import SEVERITY, by_arrival

MAX_P = 1e-3
MIN_MARGIN = 3.0  # nats between the best candidate prompt and the runner-up
FIT_SLACK = 2.0  # nats per token a crossed answer may fit its source's prompt worse than clean outputs fit theirs
FEATURE = "answer_of_other_request"


def plan(
    requests: pa.Table, summary: pa.Table, max_flagged: int = 32, max_candidates: int = 16, small_run: int = 64
) -> list[dict]:
    req = by_arrival(requests)
    ids = req.column("request_id").to_pylist()
    prompts = [tuple(p) for p in req.column("prompt_token_ids").to_pylist()]
    ts = req.column("t_submit").cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
    tf = req.column("t_finish").cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
    timed = np.isfinite(ts) & np.isfinite(tf)
    # the summary is aligned to the requests in arrival order (`summarize_requests`)
    verdict = summary.column("verdict").to_pylist()
    worst = summary.column("max_abs_logprob_diff").fill_null(0.0).to_numpy(zero_copy_only=False)
    n_out = summary.column("n_output_tokens").to_numpy(zero_copy_only=False)
    flagged = sorted(
        (i for i, v in enumerate(verdict) if v in ("divergent", "corrupt") and n_out[i]),
        key=lambda i: (-SEVERITY[verdict[i]], -worst[i], i),
    )
    out = []
    for i in flagged[:max_flagged]:
        if req.num_rows <= small_run or not timed[i]:
            pool = np.arange(req.num_rows)
        else:  # in flight at an overlapping time
            pool = np.flatnonzero(timed & (ts <= tf[i]) & (tf >= ts[i]))
        # nearest arrivals first: a crossed answer comes from a request served alongside
        key = np.abs(ts[pool] - ts[i]) if timed[i] and np.isfinite(ts[pool]).all() else np.abs(pool - i)
        pool = pool[np.argsort(key, kind="stable")]
        chosen, same = [], {}
        by_prompt: dict[tuple, str] = {}
        for j in pool.tolist():
            if j == i or prompts[j] == prompts[i] or _shares_most(prompts[i], prompts[j]):
                continue
            rep = by_prompt.get(prompts[j])
            if rep is not None:
                same.setdefault(rep, []).append(ids[j])
                continue
            if len(chosen) < max_candidates:
                by_prompt[prompts[j]] = ids[j]
                chosen.append(ids[j])
        if chosen:
            out.append(
                {"request_id": ids[i], "candidates": chosen, "same_prompt": {c: same[c] for c in chosen if c in same}}
            )
    return out


SHARED_PREFIX_MIN = 16  # tokens: the shortest common prefix a prefix cache hands out (a block)


def _shares_most(own: tuple, other: tuple) -> bool:
    """Whether `other` starts with at least half of `own`, and at least SHARED_PREFIX_MIN tokens of it."""
    need = max(SHARED_PREFIX_MIN, (len(own) + 1) // 2)
    return len(own) >= need and len(other) >= need and other[:need] == own[:need]


def judge(
    plans: list[dict],
    scores: pa.Table,
    own: dict[str, float],
    lost: set[str] = frozenset(),
    typical: float | None = None,
) -> list[dict]:
    got: dict[tuple[str, str], tuple[int, float]] = {}
    for r in scores.to_pylist():
        got[(r["request_id"], r["candidate_id"])] = (r["n_tokens"], r["logprob_sum"])
    out = []
    for p in plans:
        rid = p["request_id"]
        base = own.get(rid)
        if base is None or not math.isfinite(base):
            continue
        tried = [(c, got[(rid, c)]) for c in p["candidates"] if (rid, c) in got]
        if not tried:
            continue
        tried.sort(key=lambda t: -t[1][1])
        near = [t for t in tried if t[1][1] >= tried[0][1][1] - MIN_MARGIN]
        if len(near) > 1:
            near = [t for t in near if t[0] in lost or any(o in lost for o in p["same_prompt"].get(t[0], []))]
            if len(near) != 1:
                continue  # which request it was is unclear: claim nothing
        best, (n_tok, best_sum) = near[0]
        if typical is not None and best_sum / max(n_tok, 1) < typical - FIT_SLACK:
            continue  # no prompt makes it a plausible answer: not crossed, just wrong
        gain = best_sum - base
        others = [t[1][1] for t in tried if t[0] != best]
        runner_up = max(others) - base if others else -math.inf
        # a negative gain (the best prompt explains it worse than its own) is p = 1, not an overflow
        p_value = min(1.0, len(tried) * math.exp(-min(max(gain, 0.0), 700.0)))
        if p_value >= MAX_P:
            continue
        out.append(
            {
                "request_id": rid,
                "source_request_id": best,
                "gain_nats": gain,
                "gain_per_token": gain / max(n_tok, 1),
                "n_tokens": n_tok,
                "n_candidates": len(tried),
                "runner_up_gain_nats": runner_up if math.isfinite(runner_up) else None,
                "same_prompt": p["same_prompt"].get(best, []),
                "p_value": p_value,
            }
        )
    return out


def hypotheses(attributed: list[dict], n_flagged: int, n_other: int) -> list[dict]:
    out = []
    for a in attributed:
        also = f" (or {', '.join(a['same_prompt'][:3])}, which share its prompt)" if a["same_prompt"] else ""
        sentence = (
            f"request {a['request_id']} received the answer meant for request {a['source_request_id']}{also}: "
            f"its {a['n_tokens']} output tokens are {a['gain_nats']:.1f} nats ({a['gain_per_token']:.2f} per "
            f"token) more likely under that request's prompt than under its own (best of "
            f"{a['n_candidates']} requests in flight at an overlapping time)."
        )
        out.append(
            {
                "feature": FEATURE,
                "sentence": sentence,
                "request_id": a["request_id"],
                "source_request_id": a["source_request_id"],
                "gain_nats": a["gain_nats"],
                "flagged_with": 1,
                "flagged_total": n_flagged,
                "clean_with": 0,
                "clean_total": n_other,
                "p_value": a["p_value"],
                "score": float(min(300.0, -math.log10(max(a["p_value"], 1e-300)))),
            }
        )
    return out


def merge_ranked(*groups: list[dict]) -> list[dict]:
    """Hypotheses from several sources in one ranking, best score first (stable), ranks renumbered."""
    merged = [h for g in groups for h in g]
    merged.sort(key=lambda h: -h["score"])
    return [{**h, "rank": i + 1} for i, h in enumerate(merged)]
