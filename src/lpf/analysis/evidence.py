"""What a server's answers say beyond their tokens: inconsistent answers, failed attempts, a dying server.

Contract (pure: the requests table and the per-request summary in, plain data out):
- `apply_inconsistency(summary, requests) -> summary`: an answer kept with an `inconsistency` that
  was scored and disagrees with the reference beyond the clean threshold (verdict `noise`) gets at
  least `divergent`: a server that contradicts itself and the reference is not merely noisy (not
  when its only reasons are `EXPLAINED`: `logprobs_missing`, tokens sent without a logprob, which the
  verdicts judge from the tokens, `lpf.analysis.absent`). The summary gains an `inconsistency` column
  (null when consistent).
- `evidence(requests, summary) -> dict`, findings.json's `evidence`:
    inconsistent  {n, by_reason {KIND: count}, scored, flagged, requests [ids, at most 50]}
    failed        {n, sent (an attempt reached the server and failed), never_sent (no attempt ever
                  left: refused, circuit open, deadline), in_process (engines without attempts)}
    attempts      {n, retries, by_status {"200": k, "500": k, "none": k}}
    server_died   null, or {t, first_error, n_in_flight, in_flight [ids, at most 50], common {...},
                  sentence}: the server answered, then stopped answering for good (only refused or
                  unsent attempts after its last answer); the requests whose attempts were in flight
                  at the first failure after that last answer are the first suspects, with what
                  they have in common (prompt length against the run's, arrival index).
Inconsistency reasons are `KIND: detail` items joined by "; " (`lpf.adapters.remote.Problems`).
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.verdicts import by_arrival

MAX_LISTED = 50
# inconsistencies the analysis judges itself: tokens sent without a logprob (llama-server's partial UTF-8
# characters) are judged from their tokens (`absent`), recorded here, and raise no verdict
EXPLAINED = frozenset({"logprobs_missing"})
_KIND = re.compile(r"(?:^|; )([a-z_]+): ")


def reason_kinds(text: str | None) -> list[str]:
    """The KINDs of an inconsistency text ('token_count: ...; logprob: ...' -> [token_count, logprob])."""
    return _KIND.findall(text) if text else []


def apply_inconsistency(summary: pa.Table, requests: pa.Table) -> pa.Table:
    req = by_arrival(requests)
    if "inconsistency" in req.column_names:
        inc = req.column("inconsistency")
    else:
        inc = pa.nulls(req.num_rows, pa.string())
    # the summary is aligned to the requests in arrival order (`summarize_requests`)
    verdict = summary.column("verdict")
    raise_to = pc.and_(pc.is_valid(inc), pc.equal(verdict, "noise"))
    if pc.any(raise_to).as_py():  # an answer whose only departure is logprobs it left out contradicts nothing
        said = pa.array([t is not None and not set(reason_kinds(t)) <= EXPLAINED for t in inc.to_pylist()])
        raise_to = pc.and_(raise_to, said)
    if pc.any(raise_to).as_py():
        summary = summary.set_column(
            summary.column_names.index("verdict"), "verdict", pc.if_else(raise_to, pa.scalar("divergent"), verdict)
        )
    return summary.append_column("inconsistency", inc)


def _attempt_rows(req: pa.Table) -> dict[str, np.ndarray] | None:
    """Every attempt as flat numpy columns (+ `row`: the request's row in `req`), None when none;
    `error` stays an Arrow array (only the first failure's is read)."""
    if "attempts" not in req.column_names:
        return None
    col = req.column("attempts").combine_chunks()
    flat = pc.list_flatten(col)
    if len(flat) == 0:
        return None
    out = {
        "row": pc.list_parent_indices(col).to_numpy(zero_copy_only=False).astype(np.int64),
        "error": pc.struct_field(flat, "error"),
        "sent": pc.struct_field(flat, "sent").fill_null(False).to_numpy(zero_copy_only=False).astype(bool),
        "status": pc.struct_field(flat, "status").fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64),
    }
    for name in ("t_start", "t_end"):
        out[name] = np.asarray(pc.struct_field(flat, name).to_numpy(zero_copy_only=False), dtype=np.float64)
    return out


def evidence(requests: pa.Table, summary: pa.Table) -> dict:
    req = by_arrival(requests)
    n = req.num_rows
    ids = req.column("request_id")
    inc = req.column("inconsistency") if "inconsistency" in req.column_names else pa.nulls(n, pa.string())
    verdict = summary.column("verdict")
    has_inc = pc.is_valid(inc).to_numpy(zero_copy_only=False)
    kinds = Counter(k for t in pc.drop_null(inc).to_pylist() if t for k in set(reason_kinds(t)))
    scored = pc.is_in(verdict, value_set=pa.array(["clean", "noise", "divergent", "corrupt"])).to_numpy(
        zero_copy_only=False
    )
    flagged = pc.is_in(verdict, value_set=pa.array(["divergent", "corrupt"])).to_numpy(zero_copy_only=False)
    out = {
        "inconsistent": {
            "n": int(has_inc.sum()),
            "by_reason": dict(sorted(kinds.items())),
            "scored": int((has_inc & scored).sum()),
            "flagged": int((has_inc & flagged).sum()),
            "requests": sorted(ids.filter(pa.array(has_inc)).to_pylist())[:MAX_LISTED],
        }
    }

    errors = req.column("error").is_valid().to_numpy(zero_copy_only=False)
    att = _attempt_rows(req)
    any_sent = np.zeros(n, dtype=bool)
    any_attempt = np.zeros(n, dtype=bool)
    if att is not None:
        np.logical_or.at(any_sent, att["row"], att["sent"])
        any_attempt[att["row"]] = True
    out["failed"] = {
        "n": int(errors.sum()),
        "sent": int((errors & any_sent).sum()),
        "never_sent": int((errors & any_attempt & ~any_sent).sum()),
        "in_process": int((errors & ~any_attempt).sum()),
    }
    if att is None:
        out["attempts"] = {"n": 0, "retries": 0, "by_status": {}}
        out["server_died"] = None
        return out
    codes, freq = np.unique(att["status"], return_counts=True)
    by_status = Counter()
    for s, c in zip(codes.tolist(), freq.tolist()):
        by_status["none" if s < 0 else str(int(s))] += int(c)
    out["attempts"] = {
        "n": int(att["row"].size),
        "retries": int(att["row"].size - any_attempt.sum()),
        "by_status": dict(sorted(by_status.items())),
    }
    out["server_died"] = _server_death(req, ids, att)
    return out


def _server_death(req: pa.Table, ids, att: dict) -> dict | None:
    answered = att["status"] >= 0  # any HTTP answer: the server was alive then (even a 4xx)
    alive = answered & (att["status"] < 500)
    unreachable = ~att["sent"]
    last_alive = float(att["t_end"][alive].max()) if alive.any() else -np.inf
    after = att["t_end"] > last_alive
    if not (unreachable & after).any() or not answered.any():
        return None  # it never stopped answering, or it never answered at all (a wrong port, not a death)
    # the first sign of death: a sent attempt failing after the last good answer (a 5xx, a broken
    # connection, a timeout); when there is none, the first refused connection
    sent_failed = att["sent"] & ~alive & after
    pool = sent_failed if sent_failed.any() else (unreachable & after)
    first = np.flatnonzero(pool)[np.argmin(att["t_end"][pool])]
    t_death = float(att["t_end"][first])
    eps = 1e-3
    in_flight_att = att["sent"] & (att["t_start"] <= t_death + eps) & (att["t_end"] >= t_death - eps) & ~alive
    started = np.full(req.num_rows, np.inf)  # each suspect's earliest in-flight attempt: their arrival order
    np.minimum.at(started, att["row"][in_flight_att], att["t_start"][in_flight_att])
    rows = np.flatnonzero(np.isfinite(started))
    order = rows[np.argsort(started[rows], kind="stable")]
    plen = pc.list_value_length(req.column("prompt_token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    seq = req.column("seq").to_numpy().astype(np.int64)
    common = _common(plen, seq, order)
    first_error = att["error"][int(first)].as_py()
    listed = ids.take(pa.array(order, pa.int64())).to_pylist()
    sentence = (
        f"the server stopped answering after {len(listed)} request(s) were in flight "
        f"(first failure: {first_error})" + (f"; {common['sentence']}" if common.get("sentence") else "") + "."
    )
    return {
        "t": t_death,
        "first_error": first_error,
        "n_in_flight": int(len(listed)),
        "in_flight": listed[:MAX_LISTED],
        "common": common,
        "sentence": sentence,
    }


def _common(plen: np.ndarray, seq: np.ndarray, rows: np.ndarray) -> dict:
    """What the suspects share: their prompt lengths against the run's (how many are among its
    longest), their arrival indices."""
    if rows.size == 0:
        return {}
    k = rows.size
    longest = np.argsort(-plen, kind="stable")[:k]
    n_longest = int(np.isin(rows, longest).sum())
    sp = plen[rows]
    c = {
        "prompt_length": {
            "min": int(sp.min()),
            "max": int(sp.max()),
            "median": float(np.median(sp)),
            "run_median": float(np.median(plen)),
        },
        "among_longest": n_longest,
        "seq": {"min": int(seq[rows].min()), "max": int(seq[rows].max())},
    }
    words = [
        f"prompt length {c['prompt_length']['min']}..{c['prompt_length']['max']} tokens "
        f"(run median {c['prompt_length']['run_median']:g})"
    ]
    if n_longest:
        words.append(f"{n_longest} of them among the run's {k} longest prompts")
    words.append(f"arrival #{c['seq']['min']}..#{c['seq']['max']}")
    c["sentence"] = ", ".join(words)
    return c
