"""Per-request features of speculative decoding, from the trace's speculative columns (`schema.SPEC_TRACE`).

Contract: `spec_features(requests, trace) -> list[Feature]`, aligned to `requests` sorted by `seq` like
`features.request_features`; empty when the trace has no `num_draft_tokens` column or it is all null
(speculation off, engines that do not record it). Pure. A row on the verify path carries the slot that
path used and the tokens its state covered after the verify pass and after the rollback; the state a
request should keep covers num_computed_tokens + 1 + num_accepted_tokens. A wrong state counts only when
a later step of the request reads it (its last step's state is never read).
  prompt_on_verify_path       its prompt was prefilled on the verify path (a first step with nothing
                              computed ran as a verify: the decode kernel, the verify path's state index)
  state_kept_rejected_drafts  after a verify step that rejected drafts its state was not rolled back
                              (it covers the rejected drafts too), and a later step read it; in a run
                              where no verify step ever moved a state back (the engine does not roll back)
  state_rolled_back_wrong     its state was left at another position than its last accepted token (another
                              count than its own), and a later step read it: moved back from where the pass
                              ended, or left there in a run where verify steps do roll back (so a state left
                              where the pass ended is a wrong count too)
  sampled_spec_batch_over_2   its drafts went through the sampled rejection path (the one that reads the
                              draft probabilities) in a step where more than 2 sequences had drafts verified
                              (a batch whose rows a leaver can permute; `spec_sampled`, when the trace has it)
  speculated                  it had drafts verified (the broad condition the three above refine)
Each feature is left out when it holds for no request.

`spec_divergence(summary, requests, trace) -> Feature | None`, aligned to `summary` (the requests in
arrival order, with `first_divergence`), a signature placed where the request first went wrong (so a
clean request never carries it, and one that went wrong elsewhere does not either):
  diverged_at_first_spec_decode  its first divergent token was sampled by its first step after its prompt
                              was prefilled (prefill/extend steps, not the verify path: that is
                              prompt_on_verify_path), a decode-path step of a speculating engine: the
                              state the prefill handed over, read by the speculative decode kernels (vLLM
                              widens the Mamba state for K drafts and passes num_accepted_tokens on every
                              decode row, drafts or none: docs/bugs.md 22). Its phrase counts those steps
                              with drafts verified and without.
None without the speculative columns or when no request carries it. A row samples output positions
num_computed + num_scheduled - num_draft - prompt_length onwards, 1 + num_accepted of them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.feature import Feature
from lpf.analysis.verdicts import by_arrival

COLUMNS = (
    "request_id",
    "step",
    "phase",
    "num_computed_tokens",
    "num_scheduled_tokens",
    "num_draft_tokens",
    "num_accepted_tokens",
    "state_tokens_before_rollback",
    "state_tokens_after_rollback",
)
OPTIONAL = ("spec_sampled",)


def has_spec_columns(trace: pa.Table | None) -> bool:
    return (
        trace is not None
        and "num_draft_tokens" in trace.column_names
        and trace.column("num_draft_tokens").null_count < trace.num_rows
    )


def spec_features(requests: pa.Table, trace: pa.Table | None) -> list[Feature]:
    if not has_spec_columns(trace):
        return []
    req = by_arrival(requests)
    ids = req.column("request_id").to_pylist()
    index = {rid: i for i, rid in enumerate(ids)}
    rows = trace.filter(pc.invert(trace.column("preempted").fill_null(False)))
    cols = {c: rows.column(c).to_pylist() for c in COLUMNS}
    for c in OPTIONAL:
        cols[c] = rows.column(c).to_pylist() if c in rows.column_names else [None] * rows.num_rows
    speculating: dict[int, int] = {}  # step -> sequences with drafts verified in it
    for step, drafts in zip(cols["step"], cols["num_draft_tokens"]):
        if drafts:
            speculating[step] = speculating.get(step, 0) + 1
    last = {}
    for rid, step in zip(cols["request_id"], cols["step"]):
        last[rid] = max(step, last.get(rid, step))
    n = len(ids)
    on_verify, kept, wrong, spec, crowded = (np.zeros(n, dtype=bool) for _ in range(5))
    lengths: set[int] = set()
    misplaced: list[int] = []  # requests with a read-later verify row whose state is not where it should be
    rolls_back = False  # some verify step that rejected drafts moved its state back: the engine rolls back
    for k in range(rows.num_rows):
        i = index.get(cols["request_id"][k])
        if i is None or cols["phase"][k] != "verify":
            continue
        drafts, accepted = cols["num_draft_tokens"][k] or 0, cols["num_accepted_tokens"][k]
        if cols["num_computed_tokens"][k] == 0:
            on_verify[i] = True
            lengths.add(cols["num_scheduled_tokens"][k])
        if not drafts or accepted is None:
            continue
        spec[i] = True
        if cols["spec_sampled"][k] and speculating.get(cols["step"][k], 0) > 2:
            crowded[i] = True
        read_later = cols["step"][k] < last[cols["request_id"][k]]
        after, before = cols["state_tokens_after_rollback"][k], cols["state_tokens_before_rollback"][k]
        should = cols["num_computed_tokens"][k] + 1 + accepted
        if after is not None and accepted < drafts and after != before:
            rolls_back = True
        if read_later and after is not None and after != should:
            if after != before:  # moved, to another position than its own count's: a wrong rollback
                wrong[i] = True
            else:
                misplaced.append(i)
    # a state left where the verify pass ended is a skipped rollback only where the engine never rolls
    # back; where it does, that position is a rollback to another count than its own too
    for i in misplaced:
        (wrong if rolls_back else kept)[i] = True
    size = "/".join(str(x) for x in sorted(lengths)) or "1+K"
    feats = [
        Feature(
            "prompt_on_verify_path",
            "bool",
            on_verify,
            f"had a {size}-token (1+K) prompt prefilled on the verify path (the decode kernel and the verify "
            f"path's state slot)",
        ),
        Feature(
            "state_kept_rejected_drafts",
            "bool",
            kept,
            "kept a Mamba state covering rejected drafts (no rollback after a verify step), read by a later step",
        ),
        Feature(
            "state_rolled_back_wrong",
            "bool",
            wrong,
            "had their Mamba state rolled back to another position than their last accepted token (another "
            "accepted count than their own), read by a later step",
        ),
        Feature(
            "sampled_spec_batch_over_2",
            "bool",
            crowded,
            "were sampled speculatively in a batch of > 2 sequences (drafts verified by the sampled rejection "
            "path, which reads the draft probabilities, beside 2 or more other speculating requests)",
        ),
        Feature("speculated", "bool", spec, "had draft tokens verified (speculative decoding)"),
    ]
    return [f for f in feats if f.values.any()]


def _first_decode_rows(requests: pa.Table, trace: pa.Table) -> dict:
    """request id -> (first output position it sampled, how many, drafts) of its first step after a
    prompt prefilled off the verify path; requests whose prompt went through a verify row are left out.
    Rows in any order (a request's in step order, ties in trace order); preemption rows and requests
    the run does not have are skipped. Columns, not rows: per request the first row that ends its walk,
    a row past its prompt or a prompt row off the prefill/extend path, decides."""
    ids = requests.column("request_id")
    plens = prompt_lengths(requests)
    live = pc.invert(trace.column("preempted").fill_null(False)).to_numpy(zero_copy_only=False)
    req = row_requests(requests, trace.column("request_id"))

    def col(name: str) -> np.ndarray:
        return trace.column(name).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)

    def phase_in(*names: str) -> np.ndarray:
        return pc.is_in(trace.column("phase"), value_set=pa.array(names)).fill_null(False).to_numpy(False)

    keep = np.flatnonzero(live & (req >= 0))
    # a request's rows by step, ties in trace order (stable sorts); one int64 key when it fits (2x lexsort)
    step = col("step")[keep]
    lo = int(step.min()) if len(step) else 0
    span = int(step.max()) - lo + 1 if len(step) else 1
    if len(ids) * span < 1 << 62:
        order = keep[np.argsort(req[keep] * span + (step - lo), kind="stable")]
    else:
        order = keep[np.lexsort((step, req[keep]))]
    req = req[order]
    plen = plens.astype(np.int64)[req]
    computed = col("num_computed_tokens")[order]
    # a row past its prompt decides; a prompt row off the prefill/extend path ends the walk with nothing
    ends = (computed >= plen) | ~phase_in("prefill", "extend")[order]
    at = np.flatnonzero(ends)
    at = at[np.unique(req[at], return_index=True)[1]]  # each request's first such row
    rows = order[at]
    drafts = col("num_draft_tokens")[rows]
    first = computed[at] + col("num_scheduled_tokens")[rows] - drafts - plen[at]
    n = 1 + col("num_accepted_tokens")[rows]
    hit = (computed[at] >= plen[at]) & phase_in("decode", "verify")[rows] & (first >= 0)
    names = ids.take(pa.array(req[at][hit])).to_pylist()
    return dict(zip(names, zip(first[hit].tolist(), n[hit].tolist(), drafts[hit].tolist())))


def prompt_lengths(requests: pa.Table) -> np.ndarray:
    """Each request's prompt length, in the requests table's order."""
    return pc.list_value_length(requests.column("prompt_token_ids")).fill_null(0).to_numpy(zero_copy_only=False)


def row_requests(requests: pa.Table, request_ids) -> np.ndarray:
    """Each trace row's request as its index in `requests` (-1: a request the run does not have)."""
    return pc.index_in(request_ids, value_set=requests.column("request_id")).fill_null(-1).to_numpy(False)


def spec_divergence(summary: pa.Table, requests: pa.Table, trace: pa.Table | None) -> Feature | None:
    if not has_spec_columns(trace) or "num_accepted_tokens" not in trace.column_names:
        return None
    rows = _first_decode_rows(requests, trace)
    ids = summary.column("request_id").to_pylist()
    firsts = summary.column("first_divergence").to_pylist()
    hit = np.zeros(len(ids), dtype=bool)
    with_drafts = 0
    for i, (rid, fd) in enumerate(zip(ids, firsts)):
        row = rows.get(rid)
        if fd is None or row is None:
            continue
        first, n, drafts = row
        if first <= fd < first + n:
            hit[i] = True
            with_drafts += drafts > 0
    if not hit.any():
        return None
    k = int(pc.max(trace.column("num_draft_tokens")).as_py() or 0)
    n_hit = int(hit.sum())
    return Feature(
        "diverged_at_first_spec_decode",
        "bool",
        hit,
        f"first diverged at a token of their first decode step after the prefill, on the speculative decode "
        f"path (up to {k} drafts; {with_drafts} of those steps verified drafts, {n_hit - with_drafts} had none): "
        f"the speculative decode kernels read the state the prefill left",
    )
