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

from lpf.experiments.shrink.ddmin import ddmin, split
from lpf.experiments.shrink.search import midpoint
from lpf.experiments.shrink.signature import (
    Signature,
    carries,
    mechanism_hypothesis,
    position_class,
    shows,
    signature_of,
)


# -- ddmin ---------------------------------------------------------------------------------------
def counting(predicate):
    calls = []

    def test(subset):
        calls.append(tuple(subset))
        return predicate(subset)

    return test, calls


def one_minimal(result, predicate):
    return predicate(result) and all(not predicate(result[:i] + result[i + 1 :]) for i in range(len(result)))


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


def test_command_sh_is_rendered_from_the_spec_and_parses_back_to_it(tmp_path):
    """command.sh's `lpf audit` line (`spec.audit_command`, for people) is the same audit: `lpf audit`'s
    own parser and spec builder turn it back into an equal AuditSpec (knobs with a named flag, booleans
    as --no-..., a repeatable drill twice, the rest as -E; rescore settings and pinned thresholds)."""
    from click import Context

    from lpf.cli.audit_spec import build_audit_spec
    from lpf.cli.run import audit
    from lpf.core.sampling import SamplingParams
    from lpf.pipeline.rescore import RescoreSettings
    from lpf.pipeline.spec import AuditSpec, RunSpec, audit_command

    options = {
        "cache_mb": 0.2,
        "max_num_batched_tokens": 6,
        "enable_chunked_prefill": False,
        "block_size": 4,
        "inject": "stale-state,offset-wrap:14",
        "dtype": "bfloat16",
        "threads": 2,
    }
    spec = AuditSpec(
        run=RunSpec(
            model="tiny:hybrid",
            workload="w.jsonl",
            out=tmp_path / "r",
            engine_options=options,
            sampling=SamplingParams(temperature=0.7, max_tokens=9, seed=3, ignore_eos=True),
        ),
        rescore=RescoreSettings(dtype="float64", device="auto"),
        thresholds={"clean_abs_diff": 0.002},
    )
    args = audit_command(spec)
    assert args[args.index("--cache-mb") + 1] == "0.2" and "--no-enable-chunked-prefill" in args
    assert args.count("--inject") == 2 and "-E" in args and "--ignore-eos" in args
    ctx = audit.make_context("audit", list(args))
    try:
        back = build_audit_spec({k: v for k, v in ctx.params.items() if k not in ("spec_file", "as_json", "fail_on")})
    finally:
        Context.close(ctx)
    assert back == spec
    assert back.run.engine_options == options and back.thresholds == {"clean_abs_diff": 0.002}


# -- the signature --------------------------------------------------------------------------------------
HYPS = [
    {
        "feature": "seq",
        "split": {"op": ">=", "value": 46},
        "sentence": "46/46 flagged requests had arrival index >= 46; ...",
    },
    {
        "feature": "first_decode_uncomputed",
        "sentence": "7/7 corrupt requests started with a decode step while num_computed_tokens was 0; 0/93 clean ones did.",
    },
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
    assert note is None and sig == Signature(
        "corrupt",
        "first-token",
        "first_decode_uncomputed",
        None,
        "started with a decode step while num_computed_tokens was 0",
    )
    assert Signature.from_dict(sig.to_dict()) == sig
    assert "first_decode_uncomputed" in sig.describe()
    assert shows(sig, {"verdict": "corrupt", "first_divergence": 0}, True) == (
        True,
        "corrupt at position 0, with first_decode_uncomputed",
    )
    assert not shows(sig, {"verdict": "corrupt", "first_divergence": 2}, True)[0], "another place in the output"
    assert not shows(sig, {"verdict": "divergent", "first_divergence": 0}, True)[0], "another verdict"
    assert shows(sig, {"verdict": "corrupt", "first_divergence": 0}, False) == (
        False,
        "corrupt at position 0, without first_decode_uncomputed",
    )
    assert shows(sig, None, None) == (False, "missing from the run")
    # a target that does not carry the run's top mechanism is judged without it, and that is said
    plain, note = signature_of(row, HYPS[1], False)
    assert plain.feature is None and "does not describe this request" in note


# -- the standalone reproducer's template ------------------------------------------------------------
TEMPLATE = Path(__file__).resolve().parents[1] / "src" / "lpf" / "experiments" / "shrink" / "repro_script.py"


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
    # lpf_vllm_trace: the plugin in vLLM's own Python that holds vLLM's drills, never lpf itself
    assert others - set(sys.stdlib_module_names) == {"torch", "transformers", "vllm", "lpf_vllm_trace"}


def test_the_reproducer_mirrors_lpfs_sampling_fields():
    """The built-in engine reads its sampling parameters by attribute; the script's copy must not drift."""
    from lpf.core.sampling import SamplingParams
    from lpf.experiments.shrink import repro_script

    assert [f.name for f in fields(repro_script.Sampling)] == [f.name for f in fields(SamplingParams)]
    assert repro_script.Sampling(temperature=0).greedy and not repro_script.Sampling(temperature=0.7).greedy


# -- the plan, judged by a rule instead of an engine ------------------------------------------------
class RuleJudge:
    """Stands in for the engine runs so the plan's order can be checked alone: `lies(config)` says
    whether a configuration shows the lie (deterministic, one run each)."""

    deterministic, tries = True, 1

    def __init__(self, lies):
        self.lies, self.configs = lies, []

    def judge(self, cid, config, every_try=False, on_try=lambda t: None):
        self.configs.append(config)
        ok = bool(self.lies(config))
        t = {"dir": f"candidates/{cid}-1", "lie": ok, "seen": "corrupt" if ok else "clean"}
        on_try(t)
        return ok, [t]


def test_the_plan_cuts_the_target_before_ddmin_so_a_schedule_bound_lie_shrinks(tmp_path):
    """vLLM offline queues every request at once, so the target gets its one token of budget only in
    the original's exact schedule (every earlier request, original lengths): no subset keeps it. A
    one-token prompt is one token whatever runs, and then the lie needs only a recycled sequence (at
    least max_num_seqs=4 requests before it). The plan cuts the target before ddmin, so the shrink
    ends at 5 requests in 27 judgements instead of 137 (most of them subsets that cannot lie)."""
    from lpf.experiments.shrink.config import Member, Source
    from lpf.experiments.shrink.search import Shrink
    from lpf.experiments.shrink.state import State

    t = 30
    source = Source(
        path=tmp_path,
        manifest={"engine": {"options": {"max_num_seqs": 4, "inject": "stale-state"}}},
        findings={},
        summary=[],
        prompts={s: tuple(range(1, 41)) for s in range(t + 10)},
        ids={s: f"r{s}" for s in range(t + 10)},
        expected={},
        max_tokens={s: 16 for s in range(t + 10)},
        defaults={"max_num_seqs": None, "inject": ""},
    )

    def lies(config):
        if config.knob_dict.get("max_num_seqs") != 4:
            return False
        target, before = config.member(t), [m for m in config.members if m.seq < t]
        if target.prompt_len == 1:
            return len(before) >= 4
        return before == [Member(s, 40, 16) for s in range(t)]  # the original schedule, and only it

    judge = RuleJudge(lies)
    state = State.open(tmp_path / "shrink", {"source_run_id": "x", "target": "r30", "tries": 1, "need": 1}, {}, 60)
    doc = Shrink(source, t, judge, state).run()
    assert doc["status"] == "done" and doc["runs_used"] == 0  # runs are the judge's to count; this one has none
    minimal = source.config(doc["minimal"]["config"])
    assert len(minimal.members) == 5 and minimal.member(t) == Member(t, 1, 1)
    assert all((m.prompt_len, m.max_tokens) == (1, 1) for m in minimal.members if m.seq != t)
    assert minimal.knob_dict["max_num_seqs"] == 4, "the default lets every request run at once: no recycled slot"
    assert len(judge.configs) <= 30, len(judge.configs)  # 27; ddmin before the cuts: 137
    # the path: a starting point with every earlier request, then the target's cuts, before any ddmin
    phases = [c["phase"] for c in doc["candidates"] if c["id"] in doc["path"]]
    assert phases[:3] == ["requests", "lengths", "lengths"] and phases.index("requests", 1) > 2


def test_the_vllm_reproducer_exits_2_when_the_plugin_did_not_arm_its_drill(monkeypatch, capsys):
    """With the drill off, vLLM runs its fixed code, and a clean result would say nothing about the
    lie: repro.py stops with exit 2 when lpf-vllm-trace is missing, or installed but not recording."""
    import sys

    from lpf.experiments.shrink import repro_script

    monkeypatch.setitem(sys.modules, "lpf_vllm_trace", None)  # not installed in this Python
    with pytest.raises(SystemExit) as e:
        repro_script.check_drill("stale-state")
    assert e.value.code == 2 and "lpf-vllm-trace, which is not installed in this Python" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "lpf_vllm_trace")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "plugins" / "vllm-trace"))
    monkeypatch.delenv("LPF_VLLM_TRACE_DIR", raising=False)
    import lpf_vllm_trace

    lpf_vllm_trace.register()  # off: nothing to record into
    with pytest.raises(SystemExit) as e:
        repro_script.check_drill("stale-state")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "did not arm the stale-state drill: the plugin is off (LPF_VLLM_TRACE_DIR" in err, err


def test_sweep_shrink_and_conformance_refuse_an_out_they_cannot_resume(tmp_path):
    """One rule (`cells.read_out_doc`) for the three commands that resume from their --out: a file, or
    their document not being JSON, is a one-line error."""
    from lpf.experiments.conformance.matrix import check_out as conformance_out
    from lpf.core.errors import LpfError
    from lpf.experiments.shrink.state import State
    from lpf.experiments.sweep import check_out as sweep_out

    (tmp_path / "file").write_text("x")
    opens = {
        "sweep.json": lambda out: sweep_out(out, {"knobs": [], "specs_sha256": ""}),
        "shrink.json": lambda out: State.open(out, {"source_run_id": "x", "target": "t", "tries": 1, "need": 1}, {}, 1),
        "conformance.json": lambda out: conformance_out(out, {}),
    }
    for name, open_out in opens.items():
        with pytest.raises(LpfError, match="is a file, not a directory"):
            open_out(tmp_path / "file")
        (tmp_path / name).mkdir()
        (tmp_path / name / name).write_text("{not json")
        with pytest.raises(LpfError, match=f"{name} is unreadable: move it away"):
            open_out(tmp_path / name)


@pytest.mark.parametrize("suspects", [{2, 3, 5, 6, 8}, {7, 8, 9}], ids=["moves-unseen", "suspects-reproduce"])
def test_the_top_hypothesis_moves_come_back_on_ddmins_minimum_only_when_unseen_among_suspects(tmp_path, suspects):
    """unaligned-chunk-hashed's shape: at the run's 48 tokens a step the lie needs three requests of the
    target's group (7, 8, 9) together; at 5 tokens a step (the truncated-state move) it needs only its
    writer (9), and only when no more than its group runs beside it (others share the steps). When the
    trace's suspects lack the writer, the moves fail there, come back once on ddmin's 4-request minimum,
    reproduce, and ddmin ends at 2 requests; when the suspects reproduce at the run's knobs, the moves
    were never needed and cost no run on the minimum."""
    from lpf.experiments.shrink.config import Source
    from lpf.experiments.shrink.search import Shrink
    from lpf.experiments.shrink.state import State

    t, knobs = 10, {"max_num_batched_tokens": 48, "enable_prefix_caching": True, "inject": "unaligned-chunk-hashed"}
    source = Source(
        path=tmp_path,
        manifest={"engine": {"name": "builtin", "options": knobs}},
        findings={"hypotheses": [{"feature": "resumed_truncated_state"}]},
        summary=[],
        prompts={s: tuple(range(1, 41)) for s in range(15)},
        ids={s: f"r{s}" for s in range(15)},
        expected={},
        max_tokens={s: 8 for s in range(15)},
        defaults={"max_num_batched_tokens": 256, "enable_prefix_caching": False, "inject": ""},
    )
    source.suspects = lambda seq: {s: "named by the trace" for s in suspects}

    def lies(config):
        budget, others = config.knob_dict.get("max_num_batched_tokens"), {m.seq for m in config.members} - {t}
        if budget == 48:
            return {7, 8, 9} <= others
        return budget == 5 and 9 in others and others <= {7, 8, 9}

    judge = RuleJudge(lies)
    state = State.open(tmp_path / "shrink", {"source_run_id": "x", "target": "r10", "tries": 1, "need": 1}, {}, 60)
    doc = Shrink(source, t, judge, state).run()
    minimal = source.config(doc["minimal"]["config"])
    on_minimum = [c for c in doc["candidates"] if "requests ddmin left" in c["step"]]
    if suspects == {7, 8, 9}:
        assert not on_minimum and {m.seq for m in minimal.members} == {7, 8, 9, t}
        assert minimal.knob_dict["max_num_batched_tokens"] == 48
    else:
        assert [c["status"] for c in on_minimum] == ["gone", "reproduces"]  # 7 tokens a step, then 5
        assert {m.seq for m in minimal.members} == {9, t} and minimal.knob_dict["max_num_batched_tokens"] == 5
