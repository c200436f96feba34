"""`lpf.experiments.shrink.suspects`: the requests a trace ties to the target, and the knob its top
hypothesis names. Pure unit tests on hand-made trace tables (the end-to-end shrinks are in
test_shrink and bench/bugs.py)."""

import pyarrow as pa

from lpf.adapters.builtin import BuiltinEngine
from lpf.experiments.shrink.suspects import leaver, named_moves, narrow_suspects, request_of, trace_suspects


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


SPEC_COLS = [
    ("step", pa.int64()),
    ("request_id", pa.string()),
    ("state_slot", pa.int32()),
    ("num_computed_tokens", pa.int32()),
    ("num_draft_tokens", pa.int32()),
    ("num_accepted_tokens", pa.int32()),
    ("verify_state_slot", pa.int32()),
    ("state_tokens_after_rollback", pa.int32()),
]


def spec_trace(rows):
    return pa.table({c: [r.get(c) for r in rows] for c, _ in SPEC_COLS}, schema=pa.schema(SPEC_COLS))


def test_a_prompt_on_the_verify_path_names_the_last_users_of_the_slot_it_read():
    # 9 is the null slot: every 1+K-token prompt prefilled on the verify path reads and writes it
    rows = [
        {"step": 1, "request_id": "old", "state_slot": 0, "verify_state_slot": 9},
        {"step": 2, "request_id": "a", "state_slot": 1, "verify_state_slot": 9},
        {"step": 2, "request_id": "other", "state_slot": 2, "verify_state_slot": 2},  # its own slot: not 9
        {"step": 3, "request_id": "b", "state_slot": 3, "verify_state_slot": 9},
        {"step": 4, "request_id": "t", "state_slot": 4, "verify_state_slot": 9},
        {"step": 4, "request_id": "same-step", "state_slot": 5, "verify_state_slot": 9},
        {"step": 5, "request_id": "after", "state_slot": 6, "verify_state_slot": 9},
    ]
    got = narrow_suspects(spec_trace(rows), "t", "prompt_on_verify_path")
    assert got == {r: "last used the state slot 9 its first verify step read" for r in ("b", "a")}
    assert narrow_suspects(spec_trace(rows), "t", "first_decode_uncomputed") == {}  # not a spec mechanism
    assert narrow_suspects(None, "t", "prompt_on_verify_path") == {}


def test_a_wrong_count_names_its_verify_step_and_the_last_leavers_before_it():
    def v(step, rid, done, drafts, acc, after):
        return dict(step=step, request_id=rid, num_computed_tokens=done, num_draft_tokens=drafts,
                    num_accepted_tokens=acc, state_tokens_after_rollback=after)  # fmt: skip

    rows = [
        v(1, "t", 10, 2, 1, 12),  # right: 10 + 1 + 1
        v(1, "gone1", 10, 0, None, None),
        v(1, "gone2", 10, 2, 0, 11),
        v(1, "gone3", 10, 0, None, None),
        v(2, "gone3", 11, 0, None, None),
        v(3, "t", 12, 2, 0, 15),  # wrong: should cover 13
        v(3, "mate", 12, 2, 2, 13),  # wrong too, but only the target's step matters
        v(3, "plain", 12, 0, None, None),  # no drafts in that step: not the count's donor
        v(4, "t", 15, 0, None, None),
    ]
    got = narrow_suspects(spec_trace(rows), "t", "state_rolled_back_wrong")
    assert got == {
        "mate": "shared the verify step 3 that left its state wrong",
        "gone2": "left the batch at step 1, before the verify step 3 (its row refilled)",
        "gone3": "left the batch at step 2, before the verify step 3 (its row refilled)",
    }
    assert [r for r, why in got.items() if leaver(why)] == ["gone2", "gone3"]  # the shrink cuts these to one token


def test_a_decision_against_odds_names_its_crowded_sampled_step_and_the_last_leavers_before_it():
    def v(step, rid, drafts, sampled=True):
        return dict(step=step, request_id=rid, num_draft_tokens=drafts, spec_sampled=sampled if drafts else None)

    rows = [
        v(1, "gone1", 2), v(1, "gone2", 2), v(1, "a", 2),
        v(2, "gone2", 2), v(2, "a", 2), v(2, "t", 0),  # t's prefill; gone1 left after step 1
        v(3, "t", 2), v(3, "a", 2),  # only 2 speculating: no permuted read of 3+ rows
        v(4, "t", 2), v(4, "a", 2), v(4, "b", 2), v(4, "plain", 0),  # the first crowded sampled step
        v(5, "t", 2), v(5, "a", 2), v(5, "b", 2),
    ]  # fmt: skip
    trace = pa.Table.from_pylist(rows)
    got = narrow_suspects(trace, "t", "spec_decision_against_odds")
    assert got == {
        "a": "shared the sampled verify step 4",
        "b": "shared the sampled verify step 4",
        "gone1": "left the batch at step 1, before the verify step 4 (its row refilled)",
        "gone2": "left the batch at step 2, before the verify step 4 (its row refilled)",
    }
    greedy = pa.Table.from_pylist([{**r, "spec_sampled": False if r["num_draft_tokens"] else None} for r in rows])
    assert narrow_suspects(greedy, "t", "spec_decision_against_odds") == {}  # greedy never reads q


def test_the_spec_hypotheses_name_one_sequence_at_a_time_and_a_small_permuted_batch():
    knobs = {"max_num_seqs": 8, "speculative": "ngram:8"}
    what, moves = named_moves([{"feature": "prompt_on_verify_path"}], BuiltinEngine.Options, knobs)
    assert "null slot" in what and moves == [{"max_num_seqs": 1}, {"max_num_seqs": 2}]
    what, moves = named_moves([{"feature": "state_rolled_back_wrong"}], BuiltinEngine.Options, knobs)
    assert moves == [{"max_num_seqs": 3}, {"max_num_seqs": 4}]
    what, moves = named_moves([{"feature": "spec_decision_against_odds"}], BuiltinEngine.Options, knobs)
    assert "permutes" in what and moves == [{"max_num_seqs": 3}, {"max_num_seqs": 4}]
    assert named_moves([{"feature": "resumed_overshot_state"}], BuiltinEngine.Options, knobs)[1] == [
        {"max_num_seqs": 1}
    ]


def test_a_prefix_cache_hit_names_the_blocks_writer_and_one_sequence_at_a_time():
    """A request never hits a block written in its own step: the writer and the reader, one sequence at a time, is
    the whole repro (the kv prefix-cache drills shrank to 5 requests without it: three 1-token fillers held the
    reader a step behind the writer at max_num_seqs 4)."""
    assert narrow_suspects(trace(ROWS), "t", "prefix_cache_hit") == {
        "w": "wrote the state it resumed from",
        "p": "published the block hash it resumed from",
    }
    what, moves = named_moves([{"feature": "prefix_cache_hit"}], BuiltinEngine.Options, {"max_num_seqs": 4})
    assert "writer a step ahead of its reader" in what and moves == [{"max_num_seqs": 1}]
    assert named_moves([{"feature": "prefix_cache_hit"}], BuiltinEngine.Options, {"max_num_seqs": 1}) is None
