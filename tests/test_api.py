"""The Python API (`import lpf`): cheap to import, `lpf.compare` on a real engine's outputs, `lpf.audit`
matching `lpf audit`, `Findings.check`'s message, the peer's rule on hand-built tables, bad input as LpfError.

The engine is the built-in one through its adapter (`engine_outputs.builtin_outputs`), the model the trained
zoo:hybrid on zoo:oracle prompts (its answers are confident: an answer delivered to the wrong request is
improbable under that request's prompt). The three tests that run the engine and load the reference are
marked slow (20 s here at load 3, 55 s at load 13); the rest take ~6 s.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from conftest import write_prompts
from engine_outputs import builtin_outputs, workload_prompts

import lpf
from lpf.analysis.mechanisms import UNEXPLAINED
from lpf.analysis.peer_rule import first_mismatch_topk, summarize

MODEL = "zoo:hybrid"


def test_import_lpf_loads_nothing_heavy():
    code = (
        "import sys, lpf; lpf.Findings; lpf.FindingsCheckFailed; lpf.LpfError; "
        "print(sorted(m for m in ('torch', 'transformers', 'pyarrow', 'pydantic', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert {"audit", "compare", "Reference", "Findings", "AuditSpec", "LpfError"} <= set(dir(lpf))
    with pytest.raises(AttributeError):
        lpf.nothing_here  # noqa: B018


# -- the peer's rule, on tables built by hand ------------------------------------------------------------
def _tables(rows):
    """rows: (request_id, position, engine token, engine top-k, reference top-1, reference top-k)."""
    tokens = pa.table(
        {
            "request_id": [r[0] for r in rows],
            "position": pa.array([r[1] for r in rows], pa.int32()),
            "token_id": pa.array([r[2] for r in rows], pa.int32()),
            "engine_topk_ids": pa.array([r[3] for r in rows], pa.list_(pa.int32())),
        }
    )
    reference = pa.table(
        {
            "request_id": [r[0] for r in reversed(rows)],  # another order: the rule joins on (id, position)
            "position": pa.array([r[1] for r in reversed(rows)], pa.int32()),
            "ref_top1_id": pa.array([r[4] for r in reversed(rows)], pa.int32()),
            "ref_topk_ids": pa.array([r[5] for r in reversed(rows)], pa.list_(pa.int32())),
        }
    )
    return tokens, reference


def test_first_mismatch_topk_is_vllms_rule():
    rows = [
        # equal throughout: passes, no mismatch
        ("same", 0, 5, [5, 6], 5, [5, 6]),
        ("same", 1, 7, [7, 1], 7, [7, 1]),
        # a near tie at position 1: each token in the other's top-k, passes; a later, wilder mismatch is
        # never looked at (the sequences have diverged)
        ("tie", 0, 5, [5, 6], 5, [5, 6]),
        ("tie", 1, 8, [8, 9], 9, [9, 8]),
        ("tie", 2, 100, [100], 3, [3, 4]),
        # the engine's token is outside the reference's top-k: fails at position 0
        ("out", 0, 42, [42, 5], 5, [5, 6]),
        # the reference's token is outside the engine's top-k: fails too (both directions are checked)
        ("other-side", 0, 6, [6, 1], 5, [5, 6]),
        # no engine top-k: only the reference side can be checked, and it holds
        ("no-topk", 0, 6, [], 5, [5, 6]),
    ]
    got = {r["request_id"]: r for r in first_mismatch_topk(*_tables(rows))}
    assert got["same"] == {"request_id": "same", "passed": True, "position": None}
    assert got["tie"]["passed"] and got["tie"]["position"] == 1
    assert not got["out"]["passed"] and not got["out"]["engine_in_reference_topk"]
    assert got["out"]["reference_in_engine_topk"] is True
    assert not got["other-side"]["passed"] and got["other-side"]["engine_in_reference_topk"]
    assert got["other-side"]["reference_in_engine_topk"] is False
    assert got["no-topk"]["passed"] and got["no-topk"]["reference_in_engine_topk"] is None
    s = summarize(list(got.values()))
    assert (s["n_requests"], s["n_failed"], s["n_mismatched"]) == (5, 2, 4) and set(s["failed"]) == {
        "out",
        "other-side",
    }


# -- outputs in and bad input out -------------------------------------------------------------------------
def test_outputs_in_every_shape_read_the_same():
    from lpf.api.outputs import read_outputs

    vllm_shape = [
        {
            "prompt_token_ids": [1, 2],
            "token_ids": [7, 8],
            "logprobs": [{"7": -0.1, "9": -2.5}, {"3": -0.5, "8": -1.0}],  # JSON's string keys
        }
    ]
    (o,) = read_outputs(vllm_shape)
    assert o.request_id == "r00000" and o.output_token_ids == [7, 8] and o.logprobs == [-0.1, -1.0]
    assert o.topk_ids == [[7, 9], [3, 8]] and o.topk_logprobs == [[-0.1, -2.5], [-0.5, -1.0]]
    columns = {
        "request_id": ["a"],
        "prompt_token_ids": [np.array([1, 2])],
        "output_token_ids": [np.array([7, 8])],
        "logprobs": [np.array([-0.1, -1.0])],
    }
    arrow = pa.table(columns | {"prompt_token_ids": [[1, 2]], "output_token_ids": [[7, 8]], "logprobs": [[-0.1, -1.0]]})
    assert read_outputs(columns) == read_outputs(arrow)
    assert read_outputs(columns)[0].logprobs == [-0.1, -1.0]


@pytest.mark.parametrize(
    "outputs, message",
    [
        ([], "no requests to compare"),
        ([{"prompt_token_ids": [1], "output_token_ids": [2, 3], "logprobs": [-1.0]}], "1 logprobs for 2 output tokens"),
        ([{"prompt_token_ids": [1], "output_token_ids": [2]}], "no logprobs"),
        ([{"prompt_token_ids": [], "output_token_ids": [2], "logprobs": [-1.0]}], "an empty prompt"),
        ([{"prompt_token_ids": [1], "output_token_ids": [2], "logprobs": [{"5": -1.0}]}], "no entry for the sampled"),
        ([{"prompt_token_ids": ["x"], "output_token_ids": [2], "logprobs": [-1.0]}], "a list of token ids"),
        (
            [{"request_id": "a", "prompt_token_ids": [1], "output_token_ids": [2], "logprobs": [-1.0]}] * 2,
            "given twice",
        ),
        (42, "expected a list of per-request records"),
    ],
)
def test_bad_outputs_are_one_line_errors(outputs, message):
    from lpf.api.outputs import read_outputs

    with pytest.raises(lpf.LpfError, match=message) as e:
        read_outputs(outputs)
    assert "\n" not in str(e.value)


def test_bad_settings_are_lpf_errors_before_anything_is_written(tmp_path):
    with pytest.raises(lpf.LpfError, match="did you mean 'builtin'"):
        lpf.audit(engine="bultin", out=tmp_path / "a")
    with pytest.raises(lpf.LpfError, match="max_tokens must be >= 1"):
        lpf.audit(max_tokens=0, out=tmp_path / "b")
    with pytest.raises(lpf.LpfError, match="no setting 'max_token'.*did you mean 'max_tokens'"):
        lpf.audit(max_token=4, out=tmp_path / "c")
    with pytest.raises(lpf.LpfError, match="unknown fault 'stale-stat' \\(did you mean 'stale-state'"):
        lpf.audit(inject="stale-stat", out=tmp_path / "d")
    with pytest.raises(lpf.LpfError, match="rule='nope'"):
        lpf.compare([], reference=MODEL, rule="nope")
    with pytest.raises(lpf.LpfError, match="dtype='float64'"):
        lpf.Reference(MODEL, dtype="float64")
    with pytest.raises(lpf.LpfError):
        lpf.Reference("tiny:no-such-model")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "reference, kw, said",
    [
        ("self", {}, "reference='self' re-scores on the audited server, and lpf.compare has outputs"),
        ("http://127.0.0.1:1/v1", {}, "needs --reference-model NAME"),
        ("http://127.0.0.1:1/v1", {"reference_model": "M"}, "give model= (the local copy of the served model"),
        ("http://u:p@h:1/v1", {"reference_model": "M", "model": MODEL}, "--reference must not carry credentials"),
        (MODEL, {"reference_model": "M"}, "--reference-model goes with --reference http(s)://... or self"),
        (MODEL, {"model": MODEL}, "local_model (model=) goes with an http(s):// or vllm: reference"),
        ("vllm:" + MODEL, {"reference_option": ["max_num_seqs=4"]}, "scores one sequence at a time unless"),
    ],
)
def test_compare_takes_the_audits_reference_strings_and_refuses_what_cannot_apply(tmp_path, reference, kw, said):
    """`lpf.compare`'s reference is built by the audit's rescore stage: its forms and its one-line refusals."""
    outputs = [{"request_id": "a", "prompt_token_ids": [1, 2], "output_token_ids": [3], "logprobs": [-1.0]}]
    with pytest.raises(lpf.LpfError, match=re.escape(said)) as e:
        lpf.compare(outputs, reference=reference, out=tmp_path / "run", **kw)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


# -- lpf.compare on a real engine's outputs ----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_run():
    prompts = workload_prompts(MODEL, "zoo:oracle", 24)
    return builtin_outputs(MODEL, prompts, max_tokens=12)


@pytest.fixture(scope="module")
def reference():
    return lpf.Reference(MODEL)


@pytest.mark.slow  # an engine run and a reference load
def test_a_clean_engine_passes_and_its_run_directory_is_a_run(engine_run, reference, tmp_path, lpf_cli):
    outputs, trace, _, description = engine_run
    f = reference.compare(outputs, out=tmp_path / "c", rule="first-mismatch-topk", trace=trace, engine=description)
    assert f.verdict == "clean" and f.counts["clean"] == f.n_requests == 24 and not f.flagged
    assert f.rule is not None and f.rule.passed and f.rule.n_requests == 24
    assert f.check() is f and f.report == tmp_path / "c" / "report.html" and f.report.is_file()
    assert {r.verdict for r in f.requests()} == {"clean"} and [r.seq for r in f.requests()] == list(range(24))
    # the directory is a run like any other: lpf's commands read it
    r = lpf_cli("query", tmp_path / "c", "SELECT count(*) AS n FROM requests")
    assert r.code == 0 and "24" in r.out
    r = lpf_cli("analyze", tmp_path / "c", "--json", "--fail-on", "divergent", "--no-attribution")
    assert r.code == 0, r.err
    assert json.loads((tmp_path / "c" / "findings.json").read_text())["verdict"] == "clean"


@pytest.mark.slow  # an engine run and a reference load
def test_compare_dtype_names_the_engines_dtype(engine_run, tmp_path):
    """`lpf.compare(..., dtype="float32")` as the docs spell it judges against the float32/float32 floor, not the
    lenient floor of an engine of unknown dtype."""
    outputs = engine_run[0][:2]
    f = lpf.compare(outputs, reference=MODEL, dtype="float32", out=tmp_path / "d")
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["engine"]["options"]["dtype"] == "float32"
    assert f.run_test["floor_pair"] == "float32/float32"  # (without the fix: bfloat16/float32, the lenient one)


@pytest.mark.slow  # an engine run and a reference load
def test_answers_delivered_to_the_wrong_requests_fail_the_check(engine_run, reference, tmp_path):
    """Two requests' outputs (tokens and the logprobs the engine computed for them) handed back crossed, as
    the swap-outputs drill does: lpf flags exactly those two, and check() says so in a test log's words."""
    outputs, _, _, _ = engine_run
    crossed = [dict(o) for o in outputs]
    a, b = next(
        (i, j)
        for i in range(24)
        for j in range(i + 1, 24)
        if outputs[i]["output_token_ids"][:3] != outputs[j]["output_token_ids"][:3]
    )
    for key in ("output_token_ids", "logprobs", "topk_ids", "topk_logprobs"):
        crossed[a][key], crossed[b][key] = outputs[b][key], outputs[a][key]
    f = reference.compare(crossed, out=tmp_path / "x", rule="first-mismatch-topk")
    assert {r.request_id for r in f.flagged} == {outputs[a]["request_id"], outputs[b]["request_id"]}
    with pytest.raises(lpf.FindingsCheckFailed) as e:
        f.check(fail_on="divergent")
    msg = str(e.value)
    lines = msg.splitlines()
    assert lines[0].startswith(f"lpf verdict: {f.verdict} (24 requests: 22 clean") and isinstance(
        e.value, AssertionError
    )
    assert f"{f.flagged[0].request_id}: {f.flagged[0].verdict}, first divergence at token" in msg
    assert "top mechanism:" in msg and f"run directory: {tmp_path / 'x'}" in msg and "report.html" in msg
    assert f.rule.n_failed <= 2 and f"peer rule first-mismatch-topk: {f.rule.n_failed} of 24" in msg
    assert e.value.findings.run_dir == tmp_path / "x"
    f.check(fail_on="never", fail_on_rule=False)  # a level nothing reaches passes
    with pytest.raises(lpf.LpfError, match="fail_on='bad'"):
        f.check(fail_on="bad")


@pytest.mark.slow  # an engine run and a reference load
def test_audit_returns_what_lpf_audit_writes(tmp_path):
    from lpf.zoo import registry

    workload = write_prompts(tmp_path / "w.jsonl", registry.workload_items("oracle", seed=1, n=16))
    f = lpf.audit(
        engine="builtin",
        model=MODEL,
        workload=str(workload),
        max_tokens=8,
        out=tmp_path / "a",
        attribution=False,
        rule="first-mismatch-topk",
    )
    raw = json.loads((tmp_path / "a" / "findings.json").read_text())
    assert f.verdict == raw["verdict"] == "clean" and f.n_requests == raw["n_requests"] > 0
    assert f.counts == raw["counts"] and f.rule.passed and raw["peer_rule"]["n_failed"] == 0
    spec = json.loads((tmp_path / "a" / "spec.json").read_text())
    assert spec["run"]["sampling"]["max_tokens"] == 8 and spec["analysis"]["attribution"] is False
    # the same spec again finishes (here: re-analyses) the same directory instead of refusing it
    again = lpf.audit(lpf.AuditSpec.model_validate(spec), rule="first-mismatch-topk")
    assert again.counts == f.counts


def test_findings_read_per_request_mechanisms_when_the_analysis_writes_them(tmp_path):
    """findings.json as the analysis writes it with per-request mechanisms (`flagged[i]["mechanism"]`) and their
    coverage (`mechanisms`): each request keeps its own, the message names it where it is not the top one;
    without them every flagged request gets the top hypothesis."""
    raw = {
        "verdict": "corrupt",
        "n_requests": 10,
        "errors": 0,
        "counts": {"clean": 7, "noise": 0, "divergent": 1, "corrupt": 2},
        "flagged": [
            {
                "request_id": "a",
                "seq": 3,
                "verdict": "corrupt",
                "first_divergence": 0,
                "max_abs_logprob_diff": 9.0,
                "mechanism": {"feature": "first_decode_uncomputed", "sentence": "s1", "rank": 1},
            },
            {
                "request_id": "b",
                "seq": 5,
                "verdict": "corrupt",
                "first_divergence": 2,
                "max_abs_logprob_diff": 7.0,
                "mechanism": {"feature": "slot_offset_over_wrap", "sentence": "s2", "rank": 2},
            },
            {
                "request_id": "c",
                "seq": 6,
                "verdict": "divergent",
                "first_divergence": 4,
                "max_abs_logprob_diff": 1.0,
                # as lpf.analysis.mechanisms writes a request no hypothesis explains
                "mechanism": {"feature": None, "sentence": UNEXPLAINED, "rank": None},
            },
        ],
        "hypotheses": [
            {"feature": "first_decode_uncomputed", "sentence": "s1"},
            {"feature": "slot_offset_over_wrap", "sentence": "s2"},
        ],
        "mechanisms": {
            "covered": [
                {"feature": "first_decode_uncomputed", "sentence": "s1", "n": 1},
                {"feature": "slot_offset_over_wrap", "sentence": "s2", "n": 1},
            ],
            "unexplained": 1,
            "n_flagged": 3,
        },
    }
    (tmp_path / "findings.json").write_text(json.dumps(raw))
    f = lpf.Findings.load(tmp_path)
    mech = {r.request_id: r.mechanism.feature for r in f.flagged}
    assert mech == {"a": "first_decode_uncomputed", "b": "slot_offset_over_wrap", "c": None}
    assert f.report is None and f.rule is None and f.coverage["n_flagged"] == 3
    assert f.failing("corrupt") and not f.failing("never")
    with pytest.raises(lpf.FindingsCheckFailed) as e:
        f.check(fail_on="corrupt")
    lines = str(e.value).splitlines()
    assert lines[0] == "lpf verdict: corrupt (10 requests: 7 clean, 1 divergent, 2 corrupt)"
    assert lines[1] == "worst requests (2 of 3 flagged):"  # the ones at or above fail_on
    assert lines[2] == "  a: corrupt, first divergence at token 0, max |logprob diff| 9"
    assert (
        lines[3] == "  b: corrupt, first divergence at token 2, max |logprob diff| 7; mechanism: slot_offset_over_wrap"
    )
    assert lines[4] == "top mechanism: first_decode_uncomputed: s1"
    assert lines[5] == "mechanisms of the 3 flagged: first_decode_uncomputed 1, slot_offset_over_wrap 1, 1 unexplained"
    assert lines[-1] == f"run directory: {tmp_path}"
    with pytest.raises(lpf.FindingsCheckFailed) as e:
        f.check(fail_on="divergent")
    # spelled as the analysis spells it, never "mechanism: None"
    assert (
        f"  c: divergent, first divergence at token 4, max |logprob diff| 1; {UNEXPLAINED}" in str(e.value).splitlines()
    )
    assert "None" not in str(e.value)
    with pytest.raises(lpf.LpfError, match="has no findings.json"):
        lpf.Findings.load(tmp_path / "nowhere")
