"""Prompt logprobs (the prefill path), audited apart from the outputs.

The built-in engine and hf return them (`--prompt-logprobs`), the reference scores them in the same
pass, and analysis keeps them apart: clean on zoo:hybrid in float32 with prompts split into 16-token
chunks; the lost-chunk-state drill (an extend step starts from a zero state) is flagged exactly at the
first prompt position computed after the chunk boundary where its ground truth says it struck, and the
shape says the divergence jumps at a chunk boundary. Through `lpf serve` the same three ways a
client asks (OpenAI echo + logprobs, vLLM's prompt_logprobs field, SGLang logprob_start_len=0).
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from conftest import write_prompts

MODEL = "zoo:hybrid"


@pytest.fixture(scope="module")
def prompts12(tmp_path_factory, prompts_200):
    lines = prompts_200.read_text().splitlines()[:12]
    return write_prompts(tmp_path_factory.mktemp("prompt") / "p12.jsonl", [json.loads(x) for x in lines])


def _prompt_rows(out):
    req = pq.read_table(out / "requests").to_pylist()
    return req, sum(len(r["prompt_token_ids"]) - 1 for r in req)


def test_builtin_prompt_logprobs_are_clean_and_kept_apart(lpf_cli, tmp_path, prompts12):
    out = tmp_path / "run"
    r = lpf_cli(
        "audit",
        "--model",
        MODEL,
        "--workload",
        prompts12,
        "--max-tokens",
        6,
        "--prompt-logprobs",
        "--max-num-batched-tokens",
        16,
        "--out",
        out,
        "--json",
    )
    assert r.code == 0, r.err
    f = json.loads(r.out)
    req, want = _prompt_rows(out)
    assert pq.read_table(out / "prompt_tokens").num_rows == want == pq.read_table(out / "prompt_reference").num_rows
    assert json.loads((out / "manifest.json").read_text())["sampling"]["prompt_logprobs"] is True
    p = f["prompt"]
    assert f["verdict"] == "clean" and p["verdict"] == "clean" and p["counts"]["clean"] == len(req)
    assert p["metrics"]["abs_logprob_diff"]["max"] < 1e-3 and p["n_scored_tokens"] == want
    summary = pq.read_table(out / "summary.parquet")
    assert {"prompt_verdict", "prompt_first_divergence", "prompt_max_abs_logprob_diff"} <= set(summary.column_names)
    assert "prompt positions: clean" in r.err
    # the streamed analysis judges the prompt positions too (their step reads their tables whole): the same findings
    written = []
    for flag in ("--no-stream", "--stream"):
        r = lpf_cli("analyze", out, flag, "--no-attribution", "--fail-on", "never")
        assert r.code == 0, r.err
        written.append((out / "findings.json").read_bytes())
    assert written[0] == written[1] and "prompt" in json.loads(written[1])


def test_lost_chunk_state_is_flagged_where_it_starts(lpf_cli, tmp_path, prompts12):
    out = tmp_path / "drill"
    r = lpf_cli(
        "audit",
        "--model",
        MODEL,
        "--workload",
        prompts12,
        "--max-tokens",
        6,
        "--prompt-logprobs",
        "--max-num-batched-tokens",
        16,
        "--inject",
        "lost-chunk-state",
        "--out",
        out,
        "--json",
        "--fail-on",
        "divergent",
    )
    assert r.code == 1, r.err  # the run verdict takes the prompt verdicts in
    f = json.loads(r.out)
    faults = pq.read_table(out / "faults").to_pylist()
    # ground truth: the first chunk boundary (num_computed_tokens of the first extend) of each struck request
    first_boundary = {}
    for row in sorted(faults, key=lambda x: x["step"]):
        assert row["fault"] == "lost-chunk-state"
        first_boundary.setdefault(row["request_id"], int(row["detail"].split("position ")[1].split()[0]))
    summary = {s["request_id"]: s for s in pq.read_table(out / "summary.parquet").to_pylist()}
    flagged = {s for s, row in summary.items() if row["prompt_verdict"] == "divergent"}
    assert flagged and flagged <= set(first_boundary)  # nothing the drill did not touch is flagged
    for rid in flagged:  # the prompt position computed first after the boundary: boundary + 1
        assert summary[rid]["prompt_first_departure"] == first_boundary[rid] + 1, rid
    shape = f["prompt"]["shape"]
    assert shape["chunk_boundary"]["jumps_at_chunk_boundary"] and shape["chunk_boundary"]["source"] == "trace"
    assert shape["sentence"].startswith("jumps at a chunk boundary")
    # requests never chunked (prompt within one 16-token step) are untouched, prompt and output
    untouched = set(summary) - set(first_boundary)
    assert all(summary[rid]["prompt_verdict"] == "clean" for rid in untouched)


def test_hf_engine_returns_prompt_logprobs(lpf_cli, tmp_path, prompts12):
    out = tmp_path / "hf"
    r = lpf_cli(
        "audit",
        "--engine",
        "hf",
        "--model",
        MODEL,
        "--workload",
        prompts12,
        "--max-tokens",
        6,
        "--prompt-logprobs",
        "--out",
        out,
        "--json",
    )
    assert r.code == 0, r.err
    f = json.loads(r.out)
    _, want = _prompt_rows(out)
    assert f["prompt"]["verdict"] == "clean" and f["prompt"]["n_scored_tokens"] == want


def test_an_engine_without_prompt_logprobs_is_refused_in_one_line(lpf_cli, tmp_path, prompts12, monkeypatch):
    from lpf.adapters.builtin import BuiltinEngine

    monkeypatch.setattr(BuiltinEngine, "supports_prompt_logprobs", False)
    r = lpf_cli("run", "--model", MODEL, "--workload", prompts12, "--prompt-logprobs", "--out", tmp_path / "run")
    assert r.code == 2 and "cannot return prompt logprobs" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "run").exists()


def test_the_ray_executor_refuses_a_run_with_prompt_logprobs(lpf_cli, tmp_path, prompts12):
    pytest.importorskip("ray")
    out = tmp_path / "run"
    r = lpf_cli("run", "--model", MODEL, "--workload", prompts12, "--max-tokens", 2, "--prompt-logprobs", "--out", out)
    assert r.code == 0, r.err
    before = (out / "manifest.json").read_text()
    r = lpf_cli("rescore", out, "--executor", "ray")
    assert r.code == 2 and "--executor local" in r.err and "Traceback" not in r.err
    assert (out / "manifest.json").read_text() == before and not list(out.glob("reference/*.parquet"))  # untouched


def test_an_orphaned_prompt_reference_part_is_dropped_on_open(tmp_path):
    import pyarrow as pa

    from lpf.run import schema
    from lpf.run.store import RunDir

    run = RunDir.create(tmp_path / "r", {"run_id": "x"})
    row = {
        "request_id": "a",
        "position": 1,
        "ref_logprob": -1.0,
        "ref_rank": 1,
        "ref_entropy": 0.5,
        "ref_top1_id": 3,
        "ref_top1_logprob": -1.0,
        "ref_topk_ids": [3],
        "ref_topk_logprobs": [-1.0],
    }
    table = pa.Table.from_pylist([row], schema=schema.REFERENCE)
    run.append_reference(table, table)
    assert [p.name for p in run.parts("prompt_reference")] == [p.name for p in run.parts("reference")]
    pq.write_table(table, run.path / "prompt_reference" / "part-000001.parquet")  # a crash before its reference part
    assert len(RunDir.open(run.path).parts("prompt_reference")) == 1


@pytest.mark.slow
def test_lpf_serve_returns_the_engines_prompt_logprobs_three_ways(lpf_cli, tmp_path, prompts12):
    from lpf.serve.process import served

    with served("--model", MODEL, "--max-num-batched-tokens", "16") as s:
        runs = {
            "echo": ("openai", s.base_url + "/v1", []),
            "field": ("openai", s.base_url + "/v1", ["-E", "prompt_logprobs=field"]),
            "sglang": ("sglang", s.base_url, []),
        }
        results = {
            name: lpf_cli(
                "audit",
                "--engine",
                engine,
                "--base-url",
                url,
                "--model",
                MODEL,
                "--workload",
                prompts12,
                "--max-tokens",
                6,
                "--prompt-logprobs",
                *extra,
                "--out",
                tmp_path / name,
                "--json",
            )
            for name, (engine, url, extra) in runs.items()
        }
    for name, r in results.items():
        assert r.code == 0, (name, r.err)
        f = json.loads(r.out)
        _, want = _prompt_rows(tmp_path / name)
        assert f["prompt"]["verdict"] == "clean" and f["prompt"]["n_scored_tokens"] == want, name
        assert f["errors"] == 0 and not f["evidence"]["inconsistent"]["n"], name
