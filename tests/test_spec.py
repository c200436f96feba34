"""`AuditSpec`: one typed value for everything an audit needs, to and from JSON, validated on
construction, written to RUN/spec.json and run again with `lpf audit --spec`."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from conftest import write_prompts
from lpf.core.errors import LpfError
from lpf.core.sampling import SamplingParams
from lpf.pipeline.rescore import RayOptions, RescoreSettings
from lpf.pipeline.spec import AnalysisSpec, AuditSpec, RunSpec, with_run


def _spec(tmp_path, **run) -> AuditSpec:
    return AuditSpec(
        run=RunSpec(out=tmp_path / "r", model="tiny:hybrid", **run),
        rescore=RescoreSettings(dtype="float64", token_budget=512, ray=RayOptions()),
        analysis=AnalysisSpec(calibrate=True, attribution=False),
        thresholds={"clean_abs_diff": 0.01},
    )


def test_json_round_trip_frozen_and_closed(tmp_path):
    spec = _spec(
        tmp_path,
        engine_options={"max_num_seqs": "4", "enable_chunked_prefill": "off"},
        sampling=SamplingParams(temperature=0.5, max_tokens=7),
    )
    assert spec.run.engine_options == {"max_num_seqs": 4, "enable_chunked_prefill": False}  # typed by the engine
    back = AuditSpec.model_validate_json(spec.to_json())
    assert back == spec and back.to_json() == spec.to_json()
    doc = json.loads(spec.to_json())
    assert set(doc) == {"version", "run", "rescore", "analysis", "thresholds"}
    assert doc["run"]["sampling"]["temperature"] == 0.5 and doc["rescore"]["ray"]["actors"] == 1
    with pytest.raises(ValidationError):
        spec.run = None  # frozen
    for path in ((), ("run",), ("run", "sampling"), ("rescore", "ray"), ("analysis",)):
        d = json.loads(spec.to_json())
        target = d
        for key in path:
            target = target[key]
        target["bogus"] = 1
        with pytest.raises(ValidationError):
            AuditSpec.model_validate(d)
    # a changed copy is validated again; identity leaves out where it goes
    moved = with_run(spec, out=tmp_path / "elsewhere")
    assert moved.identity() == spec.identity() and moved != spec


def test_what_the_engine_or_the_analysis_would_refuse_is_refused_on_construction(tmp_path):
    with pytest.raises(LpfError, match="max_num_seqs must be >= 1"):
        _spec(tmp_path, engine_options={"max_num_seqs": 0})
    with pytest.raises(LpfError, match="did you mean 'block_size'"):
        _spec(tmp_path, engine_options={"blok_size": 8})
    with pytest.raises(LpfError, match="unknown engine"):
        _spec(tmp_path, engine="no-such-engine")
    with pytest.raises(LpfError, match="unknown threshold"):
        AuditSpec(run=RunSpec(out=tmp_path / "r"), thresholds={"clean_abs": 1.0})
    with pytest.raises(LpfError, match="temperature must be >= 0"):
        AuditSpec.model_validate_json(json.dumps({"run": {"out": "x", "sampling": {"temperature": -1}}}))


def test_a_run_keeps_its_spec_and_lpf_audit_spec_runs_it_again(lpf_cli, tmp_path):
    work = write_prompts(tmp_path / "w.jsonl", [{"id": f"p{i}", "prompt": f"K{i}:V{i}|K{i}|"} for i in range(2)])
    first = tmp_path / "first"
    r = lpf_cli(
        "run",
        "--model",
        "tiny:hybrid",
        "--workload",
        work,
        "--max-tokens",
        3,
        "--max-num-seqs",
        2,
        "-E",
        "block_size=8",
        "--out",
        first,
    )
    assert r.code == 0, r.err
    stored = AuditSpec.model_validate_json((first / "spec.json").read_text())
    assert stored.run.out == first and stored.run.engine_options == {"max_num_seqs": 2, "block_size": 8}
    assert stored.run.sampling.max_tokens == 3 and stored.rescore == AuditSpec.model_fields["rescore"].default
    # the same run elsewhere from the spec alone (the same tokens), audited this time
    again = tmp_path / "again"
    r = lpf_cli("audit", "--spec", first / "spec.json", "--out", again, "--json", "--fail-on", "never")
    assert r.code == 0, r.err
    b = json.loads(r.out)
    assert b["n_requests"] == 2 and b["counts"]["clean"] == 2, b["counts"]  # tiny:hybrid is its own reference
    from lpf.run.store import RunDir

    outputs = [
        {r["request_id"]: r["output_token_ids"] for r in RunDir.open(d).read("requests").to_pylist()}
        for d in (first, again)
    ]
    assert outputs[0] == outputs[1]
    assert AuditSpec.model_validate_json((again / "spec.json").read_text()).identity() == stored.identity()
    run_id = json.loads((again / "manifest.json").read_text())["run_id"]
    # rerunning a spec on its own directory finishes it (nothing left: the same run, analysed again)
    (again / "findings.json").unlink()
    r = lpf_cli("audit", "--spec", again / "spec.json", "--fail-on", "never")
    assert r.code == 0, r.err
    assert json.loads((again / "manifest.json").read_text())["run_id"] == run_id
    assert json.loads((again / "findings.json").read_text())["counts"] == b["counts"]
    # a spec holds every setting; a directory holding another audit is not overwritten
    r = lpf_cli("audit", "--spec", first / "spec.json", "--max-tokens", 4, "--out", tmp_path / "x")
    assert r.code == 2 and "drop --max-tokens" in r.err and not (tmp_path / "x").exists()
    other = with_run(stored, sampling=SamplingParams(max_tokens=2), out=again)
    (tmp_path / "other.json").write_text(other.to_json())
    r = lpf_cli("audit", "--spec", tmp_path / "other.json")
    assert r.code == 2 and "holds another audit" in r.err
    (tmp_path / "bad.json").write_text('{"run": {"out": "y", "engine": "builtin", "turbo": true}}')
    r = lpf_cli("audit", "--spec", tmp_path / "bad.json")
    assert r.code == 2 and "not an audit spec" in r.err and len(r.err.strip().splitlines()) == 1
