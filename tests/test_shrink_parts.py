"""`lpf shrink`'s parts on their own (no engine runs): Zeller's ddmin, the signature of a lie, the
knob arguments a candidate runs with, the halfway rule for knobs, and the standalone reproducer's
template (what it imports, the sampling fields it mirrors)."""

from __future__ import annotations

import ast
import itertools
import random
from dataclasses import fields
from pathlib import Path

import pytest

from lpf.shrink.ddmin import ddmin, split
from lpf.shrink.search import midpoint
from lpf.shrink.signature import Signature, carries, mechanism_hypothesis, position_class, shows, signature_of


# -- ddmin ---------------------------------------------------------------------------------------
def counting(predicate):
    calls = []

    def test(subset):
        calls.append(tuple(subset))
        return predicate(subset)

    return test, calls


def one_minimal(result, predicate):
    return predicate(result) and all(not predicate(result[:i] + result[i + 1:]) for i in range(len(result)))


def test_split_covers_every_position_once_in_order():
    for n_items, n in itertools.product(range(1, 12), range(1, 14)):
        chunks = split(n_items, n)
        assert [i for c in chunks for i in c] == list(range(n_items))
        assert len(chunks) == min(n, n_items) and max(map(len, chunks)) - min(map(len, chunks)) <= 1


def test_ddmin_finds_the_two_items_that_matter_and_never_repeats_a_test():
    test, calls = counting(lambda s: {3, 7} <= set(s))
    assert ddmin(list(range(10)), test) == [3, 7]
    assert len(calls) == len(set(calls)), "a subset was tested twice"
    assert tuple(range(10)) not in calls, "the full set is the caller's to check"


@pytest.mark.parametrize("seed", range(20))
def test_ddmin_is_one_minimal_and_keeps_order(seed):
    rng = random.Random(seed)
    items = rng.sample(range(100), rng.randint(2, 40))
    needed = set(rng.sample(items, rng.randint(1, min(4, len(items)))))
    # plus any k further items (which ones does not matter, only how many), never more than there are
    k = rng.randint(0, min(3, len(items) - len(needed)))

    def predicate(s):
        return needed <= set(s) and len(s) >= len(needed) + k

    result = ddmin(items, predicate)
    assert one_minimal(result, predicate)
    assert result == [x for x in items if x in set(result)], "arrival order kept"


def test_ddmin_reports_every_reduction_and_keeps_the_best_when_the_test_gives_up():
    seen = []

    class Spent(Exception):
        pass

    calls = iter(range(1000))

    def test(s):
        if next(calls) >= 5:
            raise Spent
        return 4 in s

    with pytest.raises(Spent):
        ddmin(list(range(16)), test, on_reduce=seen.append)
    assert seen and all(4 in s for s in seen) and [len(s) for s in seen] == sorted((len(s) for s in seen), reverse=True)


def test_ddmin_empty_when_nothing_is_needed():
    assert ddmin([1, 2, 3], lambda s: True) == []
    assert ddmin([], lambda s: True) == []
    assert ddmin(["only"], lambda s: bool(s)) == ["only"]


# -- knobs toward the defaults -----------------------------------------------------------------------
def test_midpoint_moves_halfway_and_stays_between():
    assert midpoint(0.2, 64.0) == pytest.approx(3.58, rel=1e-2)  # geometric for positive sizes
    assert midpoint(6, 256) == 39
    assert midpoint(16, 64) == 32
    assert midpoint(1, 2) is None  # nothing strictly between two neighbouring integers
    assert midpoint(True, False) is None and midpoint("bfloat16", "float32") is None and midpoint(4, None) is None


def test_knob_args_are_the_inverse_of_engine_knobs():
    from lpf.adapters.builtin import BuiltinOptions
    from lpf.cli.common import engine_knobs, knob_args, parse_audit_args

    options = {"cache_mb": 0.2, "max_num_batched_tokens": 6, "enable_chunked_prefill": False, "block_size": 4,
               "inject": "stale-state,offset-wrap:14", "dtype": "bfloat16", "threads": 2}
    args = knob_args(options)
    assert args[:2] == ["--cache-mb", "0.2"] and "--no-enable-chunked-prefill" in args
    assert args.count("--inject") == 2 and "-E" in args
    back = BuiltinOptions.parse(engine_knobs(parse_audit_args(args, "test")))
    assert {k: getattr(back, k) for k in options} == options


# -- the signature --------------------------------------------------------------------------------------
HYPS = [
    {"feature": "seq", "split": {"op": ">=", "value": 46}, "sentence": "46/46 flagged requests had arrival index >= 46; ..."},
    {"feature": "first_decode_uncomputed",
     "sentence": "7/7 corrupt requests started with a decode step while num_computed_tokens was 0; 0/93 clean ones did."},
]


def test_position_classes_and_the_mechanism_hypothesis():
    assert [position_class(p) for p in (0, 1, 9, None)] == ["first-token", "later", "later", None]
    assert mechanism_hypothesis(HYPS)["feature"] == "first_decode_uncomputed", "arrival index is what a shrink changes"
    assert mechanism_hypothesis(HYPS[:1]) is None and mechanism_hypothesis([]) is None
    assert carries(27.0, {"op": ">=", "value": 27}) and not carries(26.0, {"op": ">=", "value": 27})
    assert not carries(float("nan"), {"op": "<=", "value": 3}) and not carries(None, None) and carries(True, None)


def test_signature_of_a_target_and_what_shows_it():
    row = {"verdict": "corrupt", "first_divergence": 0}
    sig, note = signature_of(row, HYPS[1], True)
    assert note is None and sig == Signature("corrupt", "first-token", "first_decode_uncomputed", None,
                                             "started with a decode step while num_computed_tokens was 0")
    assert Signature.from_dict(sig.to_dict()) == sig
    assert "first_decode_uncomputed" in sig.describe()
    assert shows(sig, {"verdict": "corrupt", "first_divergence": 0}, True) == (True, "corrupt at position 0, with first_decode_uncomputed")
    assert not shows(sig, {"verdict": "corrupt", "first_divergence": 2}, True)[0], "another place in the output"
    assert not shows(sig, {"verdict": "divergent", "first_divergence": 0}, True)[0], "another verdict"
    assert shows(sig, {"verdict": "corrupt", "first_divergence": 0}, False) == (False, "corrupt at position 0, without first_decode_uncomputed")
    assert shows(sig, None, None) == (False, "missing from the run")
    # a target that does not carry the run's top mechanism is judged without it, and that is said
    plain, note = signature_of(row, HYPS[1], False)
    assert plain.feature is None and "does not describe this request" in note


# -- the standalone reproducer's template ------------------------------------------------------------
TEMPLATE = Path(__file__).resolve().parents[1] / "src" / "lpf" / "shrink" / "repro_script.py"


def test_the_reproducer_imports_only_the_engine_transformers_and_the_standard_library():
    import sys

    found = set()
    for node in ast.walk(ast.parse(TEMPLATE.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module)
    lpf = {m for m in found if m.split(".")[0] == "lpf"}
    assert lpf and all(m.startswith("lpf.builtin.") for m in lpf), lpf
    others = {m.split(".")[0] for m in found} - {"lpf"}
    assert others - set(sys.stdlib_module_names) == {"torch", "transformers", "vllm"}


def test_the_reproducer_mirrors_lpfs_sampling_fields():
    """The built-in engine reads its sampling parameters by attribute; the script's copy must not drift."""
    from lpf.sampling import SamplingParams
    from lpf.shrink import repro_script

    assert [f.name for f in fields(repro_script.Sampling)] == [f.name for f in fields(SamplingParams)]
    assert repro_script.Sampling(temperature=0).greedy and not repro_script.Sampling(temperature=0.7).greedy
