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
  below a block). None when the hypothesis names none the engine has.
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
    for col, why in (
        ("resume_writer", "wrote the state it resumed from"),
        ("resume_publisher", "published the block hash it resumed from"),
    ):
        if col in mine.column_names:
            for rid in mine.column(col).drop_null().to_pylist():
                if request_of(rid) != target_id:
                    out.setdefault(request_of(rid), why)
    mates = trace.filter(pc.equal(trace.column("step"), first["step"])).column("request_id").to_pylist()
    for rid in mates:
        if request_of(rid) != target_id:
            out.setdefault(request_of(rid), "shared its first step")
    return out


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
