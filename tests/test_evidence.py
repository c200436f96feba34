"""Evidence a server returned is never thrown away: a dying server's in-flight requests become the first
suspects, "sent and failed" stays apart from "never sent", and runs that can hold or complete nothing
exit 2 with one line.

The dying server re-creates what vLLM 0.32's OpenAI server does when its engine core dies (read in
`.venv-vllm/.../vllm/entrypoints/serve/exception_handling/handlers/vllm_error.py`): every request in
flight is answered HTTP 500 with `EngineDeadError`'s message ("EngineCore encountered an issue. See
stack trace (above) for the root cause.") and `terminate_if_errored` makes uvicorn exit, so later
connections are refused. Here a long prompt kills it, as in the issue's stress run.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import write_prompts
from scripted_http import Reply, ScriptedServer, free_port
from test_openai_adapter import CODE, MODEL, SERVED, completion_body

DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
LONG = 60  # the poison prompt's length; the others have 3 tokens


@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_a_dying_server_names_the_requests_in_flight_and_keeps_what_it_said(lpf_cli, tmp_path):
    dead = threading.Event()

    def dies_on_a_long_prompt(server, path, body, attempt):
        if dead.is_set():
            return Reply(500, DEAD)
        if len(body["prompt"]) >= LONG:
            time.sleep(0.4)  # the others keep arriving and wait in the engine with it
            dead.set()
            server.stop_soon()
            return Reply(500, DEAD)
        for _ in range(12):  # served slowly: what is in flight when the engine dies gets the 500
            if dead.wait(0.05):
                return Reply(500, DEAD)
        return Reply(200, completion_body(body))

    items = [{"id": f"q{i:02d}", "prompt_token_ids": [1, CODE["ok"], 20 + i]} for i in range(30)]
    items[10] = {"id": "poison", "prompt_token_ids": [1, CODE["ok"]] + [21] * (LONG - 2)}
    out = tmp_path / "run"
    with ScriptedServer(dies_on_a_long_prompt) as server:
        r = lpf_cli(
            "audit",
            "--engine",
            "openai",
            "--base-url",
            server.url + "/v1",
            "--model",
            SERVED,
            "--reference",
            MODEL,
            "--workload",
            write_prompts(tmp_path / "p.jsonl", items),
            "--max-tokens",
            4,
            "--out",
            out,
            "--fail-on",
            "never",
            "--json",
            "-E",
            "concurrency=4",
            "-E",
            "max_retries=2",
            "-E",
            "backoff_s=0.05",
            "-E",
            "timeout_s=5",
            "--no-attribution",
        )
    assert r.code == 0, r.err
    reqs = {row["request_id"]: row for row in pq.read_table(out / "requests").to_pylist()}
    assert len(reqs) == 30
    ok = [k for k, v in reqs.items() if v["error"] is None]
    failed = {k: v for k, v in reqs.items() if v["error"] is not None}
    assert ok and failed and "poison-r0" in failed
    sent = {k for k, v in failed.items() if any(a["sent"] for a in v["attempts"])}
    never = set(failed) - sent
    # the ones that reached the dying server keep its own words, even though their retries were refused
    answered = {k for k in sent if any(a["status"] == 500 for a in failed[k]["attempts"])}
    assert "poison-r0" in answered and len(answered) >= 2
    for k in sent:
        words = "EngineCore encountered an issue" if k in answered else "connection broken"
        assert failed[k]["error"].startswith("sent and failed (") and words in failed[k]["error"], failed[k]["error"]
    for k in never:
        assert all(not a["sent"] and a["status"] is None for a in failed[k]["attempts"]), failed[k]["attempts"]
        assert failed[k]["error"].startswith(("not sent", "gave up")), failed[k]["error"]

    f = json.loads(r.out)
    ev = f["evidence"]
    assert ev["failed"] == {"n": len(failed), "sent": len(sent), "never_sent": len(never), "in_process": 0}
    died = ev["server_died"]
    assert died is not None and "EngineCore encountered an issue" in died["first_error"]
    # the first suspects: the requests the server held when it died (answered 500 then), the long prompt among them
    held = {k for k, v in failed.items() if v["attempts"][0]["status"] == 500}
    assert held <= set(died["in_flight"]) <= sent and "poison-r0" in held and 1 < died["n_in_flight"] <= 4
    assert died["common"]["among_longest"] >= 1 and died["common"]["prompt_length"]["max"] == LONG
    assert "in flight" in died["sentence"] and "longest prompts" in died["sentence"]


def test_lpf_run_against_a_dead_port_exits_2_with_one_line(lpf_cli, tmp_path):
    items = [{"id": f"q{i}", "prompt_token_ids": [1, 20 + i]} for i in range(5)]
    out = tmp_path / "run"
    r = lpf_cli(
        "run",
        "--engine",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{free_port()}/v1",
        "--served-model",
        SERVED,
        "--model",
        MODEL,
        "--workload",
        write_prompts(tmp_path / "p.jsonl", items),
        "--out",
        out,
        "-E",
        "max_retries=1",
        "-E",
        "backoff_s=0.01",
    )
    assert r.code == 2, r.err
    line = [ln for ln in r.err.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "every request failed (5 of 5)" in line[0] and "cannot connect" in line[0], r.err
    assert "Traceback" not in r.err
    assert pq.read_table(out / "requests").num_rows == 5  # what happened is still recorded


def test_a_cache_that_holds_no_request_is_refused_before_the_engine_starts(lpf_cli, tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = lpf_cli("run", "--cache-mb", "0.0001", "--out", out)
    assert r.code == 2 and "can hold no request" in r.err and "raise --cache-mb" in r.err, r.err
    assert not out.exists() and time.monotonic() - t0 < 30


def test_timing_features_follow_their_definitions():
    from lpf.analysis.timing import timing_features

    # a at 0..10, b at 1..2, c at 1.0005..3 (same burst as b), d at 5..6; b retried once after a 500
    att = [lambda **k: {"attempt": 0, "sent": True, "status": 200, "error": None, **k}]
    reqs = pa.table(
        {
            "request_id": ["a", "b", "c", "d"],
            "seq": [0, 1, 2, 3],
            "t_submit": [0.0, 1.0, 1.0005, 5.0],
            "t_finish": [10.0, 2.0, 3.0, 6.0],
            "t_first_token": [None] * 4,
            "attempts": [
                [att[0](t_start=0.0, t_end=10.0)],
                [
                    att[0](status=500, error="HTTP 500: x", t_start=1.0, t_end=1.2),
                    att[0](attempt=1, t_start=1.5, t_end=2.0),
                ],
                [att[0](t_start=1.0005, t_end=3.0)],
                [att[0](t_start=5.0, t_end=6.0)],
            ],
        }
    )
    f = {x.name: x.values for x in timing_features(reqs)}
    assert f["concurrency_at_arrival"].tolist() == [0, 1, 2, 1]
    assert f["arrival_rank"].tolist() == [0, 0, 1, 0]
    assert f["retries"].tolist() == [0, 1, 0, 0]
    assert np.allclose(f["queue_wait"], [0, 0.5, 0, 0])
    assert f["server_errors_nearby"].tolist() == [1, 1, 1, 0]  # b's 500 ended while a, b and c were in flight
    assert "time_to_first_token" not in f  # no engine here recorded a first-token time


def _att_tables(n_flagged_ok: bool = True):
    reqs = pa.table(
        {
            "request_id": ["x", "y", "z", "w", "v"],
            "seq": [0, 1, 2, 3, 4],
            "prompt_token_ids": [[1, 2], [1, 3], [1, 4], [1, 3], [1, 9]],
            "t_submit": [0.0, 0.1, 0.2, 0.3, 50.0],
            "t_finish": [1.0, 1.1, 1.2, 1.3, 51.0],
        }
    )
    summary = pa.table(
        {
            "request_id": ["x", "y", "z", "w", "v"],
            "verdict": ["corrupt", "divergent", "clean", "clean", "clean"],
            "max_abs_logprob_diff": [9.0, 5.0, 0.0, 0.0, 0.0],
            "n_output_tokens": [4, 4, 4, 4, 4],
        }
    )
    return reqs, summary


def test_attribution_plans_overlapping_distinct_prompts_and_judges_by_gain():
    from lpf.analysis import attribution

    reqs, summary = _att_tables()
    plans = {p["request_id"]: p for p in attribution.plan(reqs, summary, small_run=2)}
    # v never overlapped anyone; y and w share a prompt (one candidate, the other listed with it)
    assert plans["x"]["candidates"] == ["y", "z"] and plans["x"]["same_prompt"] == {"y": ["w"]}
    assert plans["y"]["candidates"] == ["x", "z"]  # never its own prompt (w's)
    scores = pa.table(
        {
            "request_id": ["x", "x", "y", "y"],
            "candidate_id": ["y", "z", "x", "z"],
            "n_tokens": [4, 4, 4, 4],
            "logprob_sum": [-2.0, -30.0, -25.0, -24.0],
        }
    )
    own = {"x": -40.0, "y": -26.0}
    found = attribution.judge(list(plans.values()), scores, own, lost={"x", "y"})
    assert [(a["request_id"], a["source_request_id"]) for a in found] == [("x", "y")]  # y: gain 2 nats is chance
    assert found[0]["gain_nats"] == 38.0 and found[0]["same_prompt"] == ["w"]
    hyp = attribution.hypotheses(found, 2, 3)[0]
    assert hyp["sentence"].startswith("request x received the answer meant for request y (or w")
    assert hyp["p_value"] == 2 * np.exp(-38.0)
    # two prompts that explain the output alike: only the one that lost its own answer can be the source
    tie = pa.table(
        {"request_id": ["x", "x"], "candidate_id": ["y", "z"], "n_tokens": [4, 4], "logprob_sum": [-2.0, -2.5]}
    )
    assert [a["source_request_id"] for a in attribution.judge([plans["x"]], tie, own, lost={"x", "y"})] == ["y"]
    assert attribution.judge([plans["x"]], tie, own, lost={"x"}) == []  # neither lost one: claim nothing
