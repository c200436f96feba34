"""A run's own `workload.jsonl` is a workload: audit, then run again with it (issue 39: it was refused
with "unknown field(s) text"); the second run sends the same prompts, text kept beside the ids. The
audit's terminal summary also says the floors' unit (nats of logit error, not |logprob diff|)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from conftest import write_prompts


def test_a_runs_workload_jsonl_feeds_back_as_its_workload(lpf_cli, tmp_path):
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "t", "prompt": "K1=A7,K2=B3|K2|", "expected": "B3"},
            {"id": "ids", "prompt_token_ids": [1, 40, 41, 42]},
            {"id": "short", "prompt": "ABC", "max_tokens": 2},
        ],
    )
    first = tmp_path / "first"
    common = ["--model", "zoo:hybrid", "--max-tokens", 8, "--ignore-eos"]  # enough tokens for the run test
    r = lpf_cli("audit", "--workload", prompts, "--out", first, "--fail-on", "never", *common)
    assert r.code == 0, r.err
    # (issue 39, beside it) the run test's floors say their unit: not the |logprob diff| printed above them
    said = " ".join(r.err.split())
    assert "observed floor" in said and "floors are in nats of logit error" in said, r.err
    stored = first / "workload.jsonl"
    assert any("text" in json.loads(line) for line in stored.read_text().splitlines())  # what was refused

    again = tmp_path / "again"
    r = lpf_cli("run", "--workload", stored, "--out", again, *common)
    assert r.code == 0, r.err
    assert (again / "workload.jsonl").read_bytes() == stored.read_bytes()  # ids, text, expected, max_tokens
    cols = ["request_id", "prompt_token_ids", "output_token_ids"]
    a = sorted(pq.read_table(first / "requests", columns=cols).to_pylist(), key=lambda x: x["request_id"])
    b = sorted(pq.read_table(again / "requests", columns=cols).to_pylist(), key=lambda x: x["request_id"])
    assert a == b  # greedy, same seed: the same requests and answers

    # text that another tokenizer's ids came from is refused in one line, never re-tokenized silently
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "prompt_token_ids": [1, 2, 3], "text": "ABC"}) + "\n")
    r = lpf_cli("run", "--workload", bad, "--out", tmp_path / "bad", *common)
    assert r.code == 2 and "tokenize to other ids" in r.err and "Traceback" not in r.err, r.err
