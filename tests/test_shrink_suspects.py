"""`lpf.experiments.shrink.suspects`: the requests a trace ties to the target, and the knob its top
hypothesis names. Pure unit tests on hand-made trace tables (the end-to-end shrinks are in
test_shrink and bench/bugs.py)."""

import pyarrow as pa

from lpf.adapters.builtin import BuiltinEngine
from lpf.experiments.shrink.suspects import named_moves, request_of, trace_suspects


def trace(rows):
    cols = ("step", "request_id", "state_slot", "resume_writer", "resume_publisher")
    return pa.table(
        {c: [r.get(c) for r in rows] for c in cols},
        schema=pa.schema(
            [
                ("step", pa.int64()),
                ("request_id", pa.string()),
                ("state_slot", pa.int32()),
                ("resume_writer", pa.string()),
                ("resume_publisher", pa.string()),
            ]
        ),
    )


ROWS = [
    {"step": 0, "request_id": "a", "state_slot": 0},
    {"step": 1, "request_id": "a", "state_slot": 0},
    {"step": 1, "request_id": "b", "state_slot": 1},
    {"step": 2, "request_id": "c", "state_slot": 0},
    {"step": 2, "request_id": "p~attempt0", "state_slot": 2},
    {"step": 3, "request_id": "far", "state_slot": 0},
    {"step": 4, "request_id": "t", "state_slot": 0, "resume_writer": "w", "resume_publisher": "p~attempt0"},
    {"step": 4, "request_id": "mate", "state_slot": 3},
    {"step": 5, "request_id": "t", "state_slot": 0},
    {"step": 6, "request_id": "later", "state_slot": 0},
]


def test_the_suspects_are_the_slots_last_holders_the_resume_provenance_and_the_first_step_mates():
    got = trace_suspects(trace(ROWS), "t")
    assert got == {
        "far": "held its state slot 0 before it",
        "c": "held its state slot 0 before it",
        "w": "wrote the state it resumed from",
        "p": "published the block hash it resumed from",
        "mate": "shared its first step",
    }
    assert "a" not in got and "later" not in got and "t" not in got  # two holders back, after it, itself


def test_the_targets_own_cancelled_attempt_on_its_slot_is_not_a_suspect():
    rows = [
        {"step": 0, "request_id": "c", "state_slot": 0},
        {"step": 1, "request_id": "t~attempt0", "state_slot": 0},
        {"step": 2, "request_id": "t", "state_slot": 0},
    ]
    assert trace_suspects(trace(rows), "t") == {"c": "held its state slot 0 before it"}


def test_no_trace_or_no_target_names_nobody():
    assert trace_suspects(None, "t") == {} and trace_suspects(trace(ROWS), "nobody") == {}
    assert request_of("x~attempt0") == "x" and request_of("x") == "x"


def test_the_moves_the_top_hypothesis_names():
    knobs = {"max_num_batched_tokens": 32, "cache_mb": 3.0, "max_num_seqs": 16}
    one_token = [{"feature": "first_decode_uncomputed"}, {"feature": "first_slot_used_before"}]
    what, moves = named_moves(one_token, BuiltinEngine.Options, knobs)
    assert "one-token first step" in what
    # the slot cap first: the built-in pool is FIFO, a few requests reach a used slot only in a pool that small
    assert moves == [
        {"max_num_batched_tokens": 1, "max_num_seqs": 1, "max_state_slots": 1},
        {"max_num_batched_tokens": 2, "max_num_seqs": 2, "max_state_slots": 2},
        {"max_num_batched_tokens": 2, "max_num_seqs": 2},
        {"max_num_batched_tokens": 1, "max_num_seqs": 1},
        {"max_num_batched_tokens": 3, "max_num_seqs": 2},
    ]
    assert named_moves([{"feature": "max_state_slot"}], BuiltinEngine.Options, knobs)[1] == [
        {"cache_mb": 1.5},
        {"cache_mb": 0.75},
    ]
    # a move that changes nothing is left out
    assert named_moves([{"feature": "first_slot_used_before"}], BuiltinEngine.Options, {**knobs, "max_num_seqs": 1})[
        1
    ] == [{"max_num_seqs": 1, "max_state_slots": 1}, {"max_num_seqs": 2, "max_state_slots": 2}, {"max_num_seqs": 2}]
    # a truncated state hashed as a boundary: odd budgets below a 16-token block end each chunk inside one
    what, moves = named_moves([{"feature": "resumed_truncated_state"}], BuiltinEngine.Options, knobs)
    assert "inside a Mamba block" in what
    assert moves == [{"max_num_batched_tokens": 7}, {"max_num_batched_tokens": 5}, {"max_num_batched_tokens": 3}]
    assert named_moves([{"feature": "resumed_from_aborted_publisher"}], BuiltinEngine.Options, knobs) is None
    assert named_moves([], BuiltinEngine.Options, knobs) is None
