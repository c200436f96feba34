"""`lpf locate`'s pure parts, fast: which computations a request depends on (the built-in engine's
state slots and KV rows), op-by-op alignment (relative errors, floors, the first departure in token
then execution order, the derived attention scores), op naming, and the refusals (an HTTP engine,
a run without findings, a position outside the outputs) as one line and exit 2."""

from __future__ import annotations

import json

import pytest

from lpf.locate import align
from lpf.locate.depends import Dependencies, Node
from lpf.locate.ops import Activations, merged_order, split_op

STRIDE, BS = 100, 4


def node(step, rid, decode=False, zero=None, read=None, write=None, start=0, end=1, table=(0,)):
    return Node(step, rid, decode, zero, read, write, start, end, tuple(table))


def test_a_stale_read_depends_on_the_slot_s_previous_owner_and_nothing_else():
    # step 1: A prefills in slot 0 (offset 0); step 2: B prefills in slot 1; step 3: A decodes;
    # step 4: A is gone, C is admitted to slot 0 as a 1-token "decode" (no zeroing: stale-state)
    steps = [
        [node(1, "A", write=0, end=3, table=(0,))],
        [node(2, "B", write=100, end=3, table=(1,))],
        [node(3, "A", decode=True, read=0, write=0, start=3, end=4, table=(0,))],
        [node(4, "C", decode=True, read=0, write=0, start=0, end=1, table=(2,))],
    ]
    deps = Dependencies(steps, STRIDE, BS)
    c = deps.nodes[(4, "C")]
    assert deps.state_writers(c) == [(3, "A")]
    assert deps.closure([(4, "C")]) == {(4, "C"), (3, "A"), (1, "A")}  # B's steps are never needed


def test_zeroing_ends_the_dependency_and_an_unwritten_region_reads_zeros():
    steps = [
        [node(1, "A", write=0, end=2)],
        [node(2, "C", decode=True, zero=0, read=0, write=0, table=(1,))],
        [node(3, "D", decode=True, read=300, write=300, table=(2,))],
    ]
    deps = Dependencies(steps, STRIDE, BS)
    assert deps.state_writers(deps.nodes[(2, "C")]) == [None]  # zeroed before the read: not A's
    assert deps.state_writers(deps.nodes[(3, "D")]) == [None]  # never written
    assert deps.closure([(2, "C")]) == {(2, "C")}


def test_a_wrapped_write_is_seen_by_whoever_reads_the_region_it_hit():
    # W's prefill state lands at offset 150 (half in slot 1, half in slot 2); V then decodes from slot 1
    steps = [
        [node(1, "V", write=100, end=2, table=(0,))],
        [node(2, "W", write=150, end=2, table=(1,))],
        [node(3, "V", decode=True, read=100, write=100, start=2, end=3, table=(0,))],
    ]
    deps = Dependencies(steps, STRIDE, BS)
    v = deps.nodes[(3, "V")]
    assert deps.state_writers(v) == [(2, "W"), (1, "V")]  # W overwrote the slot's upper half, V's own the rest
    assert (2, "W") in deps.closure([(3, "V")])


def test_within_a_step_decodes_read_before_any_decode_writes_and_after_every_prefill():
    steps = [
        [
            node(1, "P", write=0, end=2, table=(0,)),  # a prefill whose state goes to slot 0 ...
            node(1, "D", decode=True, read=0, write=0, start=5, end=6, table=(1, 2)),
        ]
    ]  # ... read by a decode
    deps = Dependencies(steps, STRIDE, BS)
    assert deps.state_writers(deps.nodes[(1, "D")]) == [(1, "P")]


def test_a_shared_kv_block_makes_its_other_writer_a_dependency():
    # a double-freed block 5: X wrote positions 0..3 into it, then Y (holding it too) reads it
    steps = [
        [node(1, "X", end=4, table=(5,))],
        [node(2, "Y", end=3, table=(5,))],
        [node(3, "Y", decode=True, start=3, end=4, table=(5,))],
    ]
    deps = Dependencies(steps, STRIDE, BS)
    assert deps.kv_writers(deps.nodes[(2, "Y")]) == set()  # Y rewrote rows 0..2 before reading them
    assert deps.kv_writers(deps.nodes[(3, "Y")]) == {(2, "Y")}  # its own rows 0..2, its own row 3 just written
    steps[1] = [node(2, "Y", end=2, table=(5,))]  # Y computed only positions 0..1: row 2 is still X's
    deps = Dependencies(steps, STRIDE, BS)
    assert (1, "X") in deps.kv_writers(deps.nodes[(3, "Y")])


def acts(side, values: dict[str, dict[int, list[float]]]) -> Activations:
    a = Activations(side, "float32")
    for op, rows in values.items():
        for p, v in rows.items():
            a.put(op, p, v)
    return a


def test_relative_errors_treat_zero_rows_and_size_mismatches_honestly():
    a = acts("engine", {"L0.state_in": {0: [0.0, 0.0], 1: [3.0, 4.0]}, "L0.q": {0: [1.0, 2.0]}})
    b = acts("reference", {"L0.state_in": {0: [0.0, 0.0], 1: [0.0, 0.0]}, "L0.q": {0: [1.0, 2.0, 3.0]}})
    errs, mismatched = align.rel_errors(a, b)
    assert errs["L0.state_in"] == {0: 0.0, 1: 1.0}  # zero vs zero agrees; a state against zero is 100% off
    assert "L0.q" in mismatched and "L0.q" not in errs


def test_the_first_departure_is_the_earliest_token_then_the_earliest_op():
    order = ["L0.norm", "L0.in_proj", "L1.q"]
    errs = {
        "L0.norm": {0: 0.0, 1: 0.0, 2: 0.0},
        "L0.in_proj": {0: 0.0, 1: 0.0, 2: 0.5},
        "L1.q": {0: 0.0, 1: 0.3, 2: 0.9},
    }
    floors = {op: 1e-3 for op in order}
    first = align.first_departure(errs, floors, order)
    assert (first["op"], first["position"]) == ("L1.q", 1)  # a later op, but an earlier token
    errs["L0.in_proj"][1] = 0.01
    assert align.first_departure(errs, floors, order)["op"] == "L0.in_proj"  # same token: execution order
    assert align.first_departure(errs, {op: 10.0 for op in order}, order) is None


def test_floors_follow_the_gold_s_growth_and_the_engine_s_dtype():
    growth = align.growth({"L0.x": {0: 10 * align.EPS["float32"]}, "L5.y": {0: 0.0}})
    f32 = align.floors(growth, "float32", ["L0.x", "L5.y"])
    assert f32["L0.x"] == pytest.approx(10 * f32["L5.y"])
    assert align.floors(growth, "bfloat16", ["L0.x"])["L0.x"] > 1e4 * f32["L0.x"]


def test_derived_scores_are_a_softmax_over_the_context_and_sit_after_v():
    q = {0: [1.0, 0.0], 1: [0.0, 1.0]}
    k = {0: [1.0, 0.0], 1: [0.0, 1.0]}
    a = acts("engine", {"L1.q": q, "L1.k": k, "L1.v": k, "L1.attn_out": q})
    align.add_scores(a, {1: (1, 1, 2, 1.0)})
    s1 = a.get("L1.scores")[1]
    assert s1.shape == (2,) and s1.sum() == pytest.approx(1.0) and s1[1] > s1[0]
    assert a.get("L1.scores")[0].tolist() == [1.0]
    assert a.order.index("L1.scores") == a.order.index("L1.v") + 1


def test_op_names_and_merged_order():
    assert split_op("L3.shared.q") == (3, "shared.q") and split_op("logits") == (None, "logits")
    assert merged_order(["a", "b", "d"], ["a", "c", "d", "e"]) == ["a", "c", "b", "d", "e"]


# -- refusals through the command line ------------------------------------------------------------
def _run_dir(tmp_path, engine: str):
    from lpf.run.store import RunDir

    run = RunDir.create(
        tmp_path / engine,
        {
            "engine": {"name": engine, "options": {}},
            "model": {"spec": "zoo:hybrid"},
            "workload": {"n": 1},
            "sampling": {},
        },
    )
    return run.path


def test_an_http_engine_is_refused_in_one_line(lpf_cli, tmp_path):
    r = lpf_cli("locate", _run_dir(tmp_path, "openai"))
    assert r.code == 2 and len(r.err.strip().splitlines()) <= 3, r.err
    assert "capture hook inside its forward pass" in " ".join(r.err.split())


def test_a_run_without_findings_or_a_bad_position_is_refused(lpf_cli, tmp_path):
    run = _run_dir(tmp_path, "builtin")
    r = lpf_cli("locate", run)
    assert r.code == 2 and "lpf analyze" in r.err
    (run / "findings.json").write_text(json.dumps({"flagged": []}))
    r = lpf_cli("locate", run)
    assert r.code == 2 and "nothing to locate" in " ".join(r.err.split())
    assert lpf_cli("locate", tmp_path / "missing").code == 2
