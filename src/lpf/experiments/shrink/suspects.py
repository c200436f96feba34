"""What the run knows about a lie: the requests its trace names, and the knob its top hypothesis names.

Contract (pure: a trace table and findings data in, plain data out):
- `trace_suspects(trace, target_id) -> {request_id: why}`: the requests the engine's trace ties to
  the target's state: who held the target's first state slot before it (the last SLOT_HOLDERS
  distinct occupants before its first step), who wrote or published the prefix-cache block it
  resumed from (`resume_writer`, `resume_publisher`, on any of its rows), and who shared its first
  step. Ids are requests' (`request_of`: a cancelled first attempt counts as its request). The
  target itself is never a suspect; an empty dict without a trace or without the target.
- `named_knob(hypotheses, options_cls) -> (knob, role, [values]) | None`: the engine knob the
  first-ranked hypothesis points at, with the values to try first. A one-token first step is made by
  the step budget: the smallest budgets that leave a new request one token beside one or a few
  running ones (2, then 3, 4). A request that started on a slot another had used, or resumed a
  state another wrote, recycles sooner in a smaller cache (role cache_size: half, then a quarter).
  None when the hypothesis names no knob the engine has.
The shrink (`search`) tries the suspects before its blind search and the named knob right after.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from lpf.core.knobs import knob_with_role

SLOT_HOLDERS = 2

# hypothesis feature -> the knob role that makes (or unmakes) it
FEATURE_ROLE = {
    "first_step_one_token": "step_budget",
    "chunked_prefill": "step_budget",
    "n_prefill_chunks": "step_budget",
    "short_resumed_chunk": "step_budget",
    "first_decode_uncomputed": "step_budget",  # a one-token first step runs as a decode
    "first_phase_decode": "step_budget",
    "first_slot_used_before": "cache_size",
    "max_state_slot": "cache_size",
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
        before = trace.filter(pc.and_(pc.equal(trace.column("state_slot"), slot),
                                      pc.less(trace.column("step"), first["step"])))
        before = before.filter(pc.not_equal(before.column("request_id"), target_id)).sort_by([("step", "descending")])
        for rid in before.column("request_id").to_pylist():
            if len({r for r, w in out.items() if w.startswith("held")}) >= SLOT_HOLDERS:
                break
            out.setdefault(request_of(rid), f"held its state slot {slot} before it")
    for col, why in (("resume_writer", "wrote the state it resumed from"),
                     ("resume_publisher", "published the block hash it resumed from")):
        if col in mine.column_names:
            for rid in mine.column(col).drop_null().to_pylist():
                if request_of(rid) != target_id:
                    out.setdefault(request_of(rid), why)
    mates = trace.filter(pc.equal(trace.column("step"), first["step"])).column("request_id").to_pylist()
    for rid in mates:
        if request_of(rid) != target_id:
            out.setdefault(request_of(rid), "shared its first step")
    return out


def named_knob(hypotheses: list[dict] | None, options_cls, current: dict) -> tuple[str, str, list] | None:
    """`current`: the knob values of the configuration being shrunk (values equal to them are left out)."""
    for h in (hypotheses or [])[:1]:
        role = FEATURE_ROLE.get(h.get("feature"))
        name = knob_with_role(options_cls, role) if role else None
        if name is None or name not in current:
            return None
        value = current[name]
        if role == "step_budget":
            values = [2, 3, 4]
        elif isinstance(value, (int, float)) and value > 0:
            values = [type(value)(value / 2), type(value)(value / 4)]
        else:
            return None
        values = [v for v in values if v != value and v > 0]
        return (name, role, values) if values else None
    return None
