"""What the run knows about a lie: the requests its trace names, and the knob its top hypothesis names.

Contract (pure: a trace table and findings data in, plain data out):
- `trace_suspects(trace, target_id) -> {request_id: why}`: the requests the engine's trace ties to
  the target's state: who held the target's first state slot before it (the last SLOT_HOLDERS
  distinct occupants before its first step), who wrote or published the prefix-cache block it
  resumed from (`resume_writer`, `resume_publisher`, on any of its rows), and who shared its first
  step. Ids are requests' (`request_of`: a cancelled first attempt counts as its request). The
  target itself is never a suspect; an empty dict without a trace or without the target.
- `named_moves(hypotheses, options_cls, current) -> (what, [{knob: value}]) | None`: the knob moves
  that make what the first-ranked hypothesis names (`FEATURE_MOVES`, by knob role). A one-token first
  step on a slot another request freed (stale state) is a step budget of 1 with one sequence and one
  state slot, or of 2 beside one decode with at most 2 sequences and 2 slots (the pool is FIFO: a
  slot is reused only after every slot was handed out, so a few requests need a pool that small;
  the `state_slots` part is left out on an engine without that knob); short prefill chunks are a
  budget of 1-4; recycled slots are one or two sequences (and slots) at a time; fewer slots a
  smaller cache; a resume from a truncated state, chunks ending inside Mamba blocks (an odd budget
  below a block); a 1+K-token prompt prefilled on the verify path after another one, one sequence at a
  time (the null slot they share carries the earlier one's state); a batch of 3-4 sequences for a count
  applied after the batch's permutation, or for a sampled request verified against another row's draft
  probabilities; one sequence at a time for a resume from a checkpoint a verify step saved (its writer
  done before the resume starts), and for a prefix-cache hit (its writer a step ahead of its reader: a
  request never hits a block written in its own step). None when the hypothesis names none the engine has.
The shrink (`search`) tries the suspects before its blind search, at the original knobs and then
at each named move.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from lpf.core.knobs import knob_with_role

SLOT_HOLDERS = 2

# hypothesis feature -> (what makes it, the knob moves that make it: {role: value}, tried in order)
# state_slots: the slot pool is FIFO (a slot is reused once every slot was handed out), so a few
# requests reach a used slot only in a pool as small as the requests that run at once; an engine
# without that knob gets the rest of the move
ONE_TOKEN_ON_A_USED_SLOT = (
    "a one-token first step on a slot another request freed",
    (
        {"step_budget": 1, "concurrency": 1, "state_slots": 1},
        {"step_budget": 2, "concurrency": 2, "state_slots": 2},
        {"step_budget": 2, "concurrency": 2},
        {"step_budget": 1, "concurrency": 1},
        {"step_budget": 3, "concurrency": 2},
    ),
)
OPTIONAL_ROLES = ("state_slots",)
SMALL_CHUNKS = ("short prefill chunks", ({"step_budget": 2}, {"step_budget": 1}, {"step_budget": 4}))
# a state from mid-block hashed as the block's end: one request's own chunks end inside blocks when its
# whole step is smaller than a block; odd budgets divide no block size (multiples of 16), so a chunk
# crosses each boundary instead of landing on it
CHUNKS_INSIDE_BLOCKS = (
    "prefill chunks that end inside a Mamba block",
    ({"step_budget": 7}, {"step_budget": 5}, {"step_budget": 3}),
)
FEATURE_MOVES = {
    "first_decode_uncomputed": ONE_TOKEN_ON_A_USED_SLOT,  # a one-token first step runs as a decode
    "first_phase_decode": ONE_TOKEN_ON_A_USED_SLOT,
    "admitted_as_decode": ONE_TOKEN_ON_A_USED_SLOT,  # the same trap at a readmission after a preemption
    "first_step_one_token": ONE_TOKEN_ON_A_USED_SLOT,
    "first_slot_used_before": (
        "slots recycled at once",
        (
            {"concurrency": 1, "state_slots": 1},
            {"concurrency": 2, "state_slots": 2},
            {"concurrency": 1},
            {"concurrency": 2},
        ),
    ),
    "chunked_prefill": SMALL_CHUNKS,
    "n_prefill_chunks": SMALL_CHUNKS,
    "short_resumed_chunk": SMALL_CHUNKS,
    "resumed_truncated_state": CHUNKS_INSIDE_BLOCKS,
    "max_state_slot": ("fewer state slots", ({"cache_size": 0.5}, {"cache_size": 0.25})),  # a share of the cache
    # speculative decoding: a 1+K-token prompt reads the null slot an earlier one wrote on the verify path
    # (admitted in separate steps: one sequence at a time keeps every prompt whole and in arrival order);
    # a count applied after the persistent batch's permutation needs a leaver and two rows behind it
    "prompt_on_verify_path": (
        "1+K-token prompts verified one after another (the null slot carried over)",
        ({"concurrency": 1}, {"concurrency": 2}),
    ),
    # a resume from a checkpoint a verify step saved: its writer must be done before the resume is admitted
    "resumed_overshot_state": ("the checkpoint's writer finished before the resume", ({"concurrency": 1},)),
    # a prefix-cache hit reads blocks an earlier request wrote, and a request never hits a block written in its
    # own step: one sequence at a time puts the writer a step ahead of its reader, with no other request to
    # hold the reader back (without it, lpf shrink kept three 1-token requests filling max_num_seqs 4 so the
    # reader was admitted a step after the writer)
    "prefix_cache_hit": ("the prefix's writer a step ahead of its reader", ({"concurrency": 1},)),
    "state_rolled_back_wrong": (
        "a batch of 3-4 sequences whose rows a leaver permutes",
        ({"concurrency": 3}, {"concurrency": 4}),
    ),
    # a rejection sampler reading another row's draft probabilities: the same permutation, sampled
    "spec_decision_against_odds": (
        "a batch of 3-4 sequences whose rows a leaver permutes",
        ({"concurrency": 3}, {"concurrency": 4}),
    ),
}


def request_of(trace_id: str) -> str:
    """The request a trace row's id belongs to: a cancelled first attempt (`ID~attempt0`, the built-in
    engine's aborted-then-resent prefill) is its request's."""
    return trace_id.split("~attempt", 1)[0]


def trace_suspects(trace: pa.Table | None, target_id: str) -> dict[str, str]:
    if trace is None or trace.num_rows == 0:
        return {}
    mine = trace.filter(pc.equal(trace.column("request_id"), target_id))
    if mine.num_rows == 0:
        return {}
    mine = mine.sort_by("step")
    first = mine.slice(0, 1).to_pylist()[0]
    out: dict[str, str] = {}
    slot = first.get("state_slot")
    if slot is not None and slot >= 0:
        before = trace.filter(
            pc.and_(pc.equal(trace.column("state_slot"), slot), pc.less(trace.column("step"), first["step"]))
        )
        before = before.sort_by([("step", "descending")])
        for rid in before.column("request_id").to_pylist():
            if len({r for r, w in out.items() if w.startswith("held")}) >= SLOT_HOLDERS:
                break
            if request_of(rid) != target_id:  # the target's own cancelled attempt is not a suspect
                out.setdefault(request_of(rid), f"held its state slot {slot} before it")
    for rid, why in _resume_sources(trace, target_id).items():
        out.setdefault(rid, why)
    mates = trace.filter(pc.equal(trace.column("step"), first["step"])).column("request_id").to_pylist()
    for rid in mates:
        if request_of(rid) != target_id:
            out.setdefault(request_of(rid), "shared its first step")
    return out


def _rows(trace: pa.Table, columns) -> dict[str, list]:
    return {c: trace.column(c).to_pylist() if c in trace.column_names else [None] * trace.num_rows for c in columns}


def _verify_slot_users(trace: pa.Table, target_id: str) -> dict[str, str]:
    """The last SLOT_HOLDERS requests whose verify step used the slot the target's first verify step used."""
    if "verify_state_slot" not in trace.column_names:
        return {}
    t = _rows(trace.sort_by([("step", "ascending")]), ("request_id", "step", "verify_state_slot"))
    mine = [(st, slot) for r, st, slot in zip(*t.values()) if r == target_id and slot is not None]
    if not mine:
        return {}
    first, slot = mine[0]
    out: dict[str, str] = {}
    for r, st, s in reversed(list(zip(*t.values()))):
        if st < first and s == slot and request_of(r) != target_id and len(out) < SLOT_HOLDERS:
            out.setdefault(request_of(r), f"last used the state slot {slot} its first verify step read")
    return out


def _wrong_count_step(trace: pa.Table, target_id: str) -> dict[str, str]:
    """Who shared the target's first verify step that left its state at another position than its last
    accepted token, and the last requests that left the batch before that step."""
    cols = ("request_id", "step", "num_computed_tokens", "num_draft_tokens", "num_accepted_tokens")
    cols += ("state_tokens_after_rollback",)
    if any(c not in trace.column_names for c in cols):
        return {}
    t = _rows(trace, cols)
    rows = list(zip(*(t[c] for c in cols)))
    wrong = [
        st
        for r, st, done, drafts, acc, after in rows
        if r == target_id and drafts and acc is not None and after is not None and after != done + 1 + acc
    ]
    if not wrong:
        return {}
    step = min(wrong)
    out: dict[str, str] = {}
    for r, st, _, drafts, _, _ in rows:
        if st == step and drafts and request_of(r) != target_id:
            out.setdefault(request_of(r), f"shared the verify step {step} that left its state wrong")
    mine = {st for r, st, *_ in rows if r == target_id and st < step}
    last = _last_steps(rows)
    beside = {request_of(r) for r, st, *_ in rows if st in mine}
    left = sorted((s, r) for r, s in last.items() if r in beside and s < step and r != target_id)
    for s, r in left[-SLOT_HOLDERS:]:
        out.setdefault(r, f"{LEFT} at step {s}, before the verify step {step} (its row refilled)")
    return out


def _last_steps(rows) -> dict[str, int]:
    """request -> the last step it ran in (rows: (request_id, step, ...) tuples)."""
    last: dict[str, int] = {}
    for r, st, *_ in rows:
        last[request_of(r)] = max(last.get(request_of(r), -1), st)
    return last


def _permuted_sampled_step(trace: pa.Table, target_id: str) -> dict[str, str]:
    """Who shared the target's first sampled verify step beside 2 or more other speculating requests
    after a request had left the batch (its rows permuted), and the last requests that left before it
    (any: the target may have arrived after them, into a batch they had permuted)."""
    cols = ("request_id", "step", "num_draft_tokens", "spec_sampled")
    if any(c not in trace.column_names for c in cols):
        return {}
    t = _rows(trace, cols)
    rows = list(zip(*(t[c] for c in cols)))
    speculating: dict[int, int] = {}
    for _, st, drafts, _ in rows:
        if drafts:
            speculating[st] = speculating.get(st, 0) + 1
    last = _last_steps(rows)
    first_left = min((s for r, s in last.items() if r != target_id), default=None)
    steps = [
        st
        for r, st, drafts, sampled in rows
        if r == target_id and drafts and sampled and speculating[st] > 2 and first_left is not None and st > first_left
    ]
    if not steps:
        return {}
    step = min(steps)
    out: dict[str, str] = {}
    for r, st, drafts, _ in rows:
        if st == step and drafts and request_of(r) != target_id:
            out.setdefault(request_of(r), f"shared the sampled verify step {step}")
    # the rows were permuted by whoever left last before it (the target may have arrived after them)
    left = sorted((s, r) for r, s in last.items() if s < step and r != target_id)
    for s, r in left[-SLOT_HOLDERS:]:
        out.setdefault(r, f"{LEFT} at step {s}, before the verify step {step} (its row refilled)")
    return out


LEFT = "left the batch"  # a narrow suspect whose leaving permuted the batch (`leaver`)


def leaver(why: str) -> bool:
    """Is this narrow suspect one whose leaving permuted the batch (the shrink cuts it to one token)?"""
    return why.startswith(LEFT)


def _resume_sources(trace: pa.Table, target_id: str) -> dict[str, str]:
    mine = trace.filter(pc.equal(trace.column("request_id"), target_id))
    out: dict[str, str] = {}
    for col, why in (
        ("resume_writer", "wrote the state it resumed from"),
        ("resume_publisher", "published the block hash it resumed from"),
    ):
        if col in mine.column_names:
            for rid in mine.column(col).drop_null().to_pylist():
                if request_of(rid) != target_id:
                    out.setdefault(request_of(rid), why)
    return out


# first-ranked hypothesis feature -> the few requests its mechanism ties to the target
NARROW = {
    "prompt_on_verify_path": _verify_slot_users,
    "state_rolled_back_wrong": _wrong_count_step,
    "resumed_overshot_state": _resume_sources,
    "prefix_cache_hit": _resume_sources,  # who wrote and published the blocks the hit reused
    "spec_decision_against_odds": _permuted_sampled_step,
}


def narrow_suspects(trace: pa.Table | None, target_id: str, feature: str | None) -> dict[str, str]:
    if trace is None or trace.num_rows == 0 or feature not in NARROW:
        return {}
    return NARROW[feature](trace, target_id)


def named_moves(hypotheses: list[dict] | None, options_cls, current: dict) -> tuple[str, list[dict]] | None:
    """(what the moves make, [{knob: value}, ...]) for the first-ranked hypothesis, or None. `current`:
    the knob values of the configuration being shrunk; a cache_size entry is a share of its value;
    moves that change nothing, or name a knob the engine lacks, are left out."""
    top = (hypotheses or [None])[0]
    if not top or top.get("feature") not in FEATURE_MOVES:
        return None
    what, moves = FEATURE_MOVES[top["feature"]]
    out = []
    for move in moves:
        knobs = {}
        for role, value in move.items():
            name = knob_with_role(options_cls, role)
            if name is None and role in OPTIONAL_ROLES:
                continue
            if name is None or (name not in current and name not in options_cls.model_fields):
                break
            if role == "cache_size":
                value = round(float(current[name]) * value, 3)
            knobs[name] = value
        else:
            # a knob the run did not record (it predates the knob) is at the engine's default
            now = {k: current.get(k, options_cls.model_fields[k].default) for k in knobs}
            if any(now[k] != v for k, v in knobs.items()) and knobs not in out:
                out.append(knobs)
    return (what, out) if out else None
