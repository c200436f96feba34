"""The `openai` adapter against a misbehaving real HTTP server on 127.0.0.1 (tests/scripted_http.py).

One run sends one request per bad-input case, the case chosen by the prompt's second token id; the
server counts every attempt, so retries are checked where they happen. Every request must come back
recorded (an error or tokens), retries bounded, errors counted apart from verdicts, exit 2 when
nothing could be audited, and nothing may hang (per-attempt timeout and overall deadline).
"""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
import pytest

from conftest import write_prompts
from scripted_http import Reply, ScriptedServer, free_port

MODEL = "zoo:hybrid"
SERVED = "tiny-served"
SECRET = "sk-lpf-test-secret-9f3b"
OUT_IDS = [35, 36, 37, 38]  # "ABCD" in the zoo tokenizer (one token per character)

CASES = [
    "ok",
    "retry_after_429",
    "always_500",
    "503_then_ok",
    "garbage",
    "truncated_json",
    "short_body",
    "slow",
    "no_logprobs",
    "fewer_logprobs",
    "unmappable_strings",
    "string_tokens_ok",
    "count_mismatch",
    "id_outside_vocab",
    "nan_logprob",
    "auth_500",
]
CODE = {name: 100 + i for i, name in enumerate(CASES)}
CASE_OF = {v: k for k, v in CODE.items()}
MAX_RETRIES = 2


def _tokenizer():
    from lpf.core.model_specs import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(MODEL))


def completion_body(
    body: dict,
    *,
    token_form: str = "id",
    n_logprobs: int | None = None,
    tokens: list | None = None,
    completion_tokens: int | None = None,
    lp=-0.25,
) -> dict:
    """A /v1/completions answer in vLLM's shape for OUT_IDS (cut to max_tokens)."""
    tok = _tokenizer()
    ids = OUT_IDS[: body["max_tokens"]]
    if tokens is None:
        tokens = [f"token_id:{t}" if token_form == "id" else tok.decode([t]) for t in ids]
    values = [lp] * len(tokens) if n_logprobs is None else [lp] * n_logprobs
    top = [{tokens[i]: lp, ("token_id:40" if token_form == "id" else "F"): -3.0} for i in range(len(tokens))]
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "text": tok.decode(ids),
                "finish_reason": "length",
                "logprobs": {
                    "tokens": tokens,
                    "token_logprobs": values,
                    "top_logprobs": top,
                    "text_offset": list(range(len(tokens))),
                },
            }
        ],
        "usage": {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": completion_tokens or len(ids),
            "total_tokens": len(body["prompt"]) + len(ids),
        },
    }


def misbehave(server, path, body, attempt) -> Reply:
    if body is None or body.get("model") != SERVED:
        return Reply(
            404,
            {
                "error": {
                    "message": f"The model `{(body or {}).get('model')}` does not exist.",
                    "type": "NotFoundError",
                    "code": 404,
                }
            },
        )
    case = CASE_OF[body["prompt"][1]]
    if case == "retry_after_429" and attempt == 1:
        return Reply(429, {"error": {"message": "slow down"}}, headers={"Retry-After": "1"})
    if case == "always_500":
        return Reply(500, {"error": {"message": "engine exploded"}})
    if case == "auth_500":  # a gateway (LiteLLM's proxy) whose upstream key is missing
        message = (
            "litellm.AuthenticationError: AuthenticationError: OpenAIException - The api_key client option must be set"
        )
        return Reply(500, {"error": {"message": message}})
    if case == "503_then_ok" and attempt <= 2:
        return Reply(503, raw=b"<html>busy</html>")
    if case == "garbage":
        return Reply(200, raw=b"<<<not json at all>>>")
    if case == "truncated_json":
        return Reply(200, raw=json.dumps(completion_body(body)).encode()[:57])
    if case == "short_body":
        return Reply(200, raw=b'{"choices": [', truncate=True)
    if case == "slow":
        return Reply(200, completion_body(body), delay=5.0)
    if case == "no_logprobs":
        reply = completion_body(body)
        reply["choices"][0]["logprobs"] = None
        return Reply(200, reply)
    if case == "fewer_logprobs":
        return Reply(200, completion_body(body, n_logprobs=2))
    if case == "unmappable_strings":
        return Reply(200, completion_body(body, tokens=["@@no-such-token@@"] * 4))
    if case == "string_tokens_ok":
        return Reply(200, completion_body(body, token_form="text"))
    if case == "count_mismatch":
        return Reply(200, completion_body(body, completion_tokens=9))
    if case == "id_outside_vocab":
        return Reply(
            200, completion_body(body, tokens=["token_id:35", "token_id:999999", "token_id:36", "token_id:37"])
        )
    if case == "nan_logprob":
        return Reply(200, raw=json.dumps(completion_body(body)).replace("-0.25", "NaN", 1).encode())
    return Reply(200, completion_body(body))


def _prompts(tmp_path, cases):
    return write_prompts(
        tmp_path / "cases.jsonl", [{"id": c, "prompt_token_ids": [1, CODE[c], 20 + i]} for i, c in enumerate(cases)]
    )


def _audit(lpf_cli, url, prompts, out, *extra):
    return lpf_cli(
        "audit",
        "--engine",
        "openai",
        "--base-url",
        url,
        "--model",
        SERVED,
        "--reference",
        MODEL,
        "--workload",
        prompts,
        "--max-tokens",
        4,
        "--out",
        out,
        "--fail-on",
        "never",
        "--json",
        "-E",
        f"max_retries={MAX_RETRIES}",
        "-E",
        "backoff_s=0.05",
        "-E",
        "timeout_s=1",
        *extra,
    )


def _requests(out):
    return {r["request_id"]: r for r in pq.read_table(out / "requests").to_pylist()}


@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_every_bad_answer_is_recorded_with_its_error_and_retries_are_bounded(lpf_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("LPF_TEST_API_KEY", SECRET)
    out = tmp_path / "run"
    with ScriptedServer(misbehave) as server:
        r = _audit(lpf_cli, server.url + "/v1", _prompts(tmp_path, CASES), out, "--api-key-env", "LPF_TEST_API_KEY")
    assert r.code == 0, r.err
    reqs = _requests(out)
    assert len(reqs) == len(CASES)  # nothing dropped
    err = {rid.removesuffix("-r0"): row["error"] for rid, row in reqs.items()}
    # no_logprobs: kept tokens only (its text re-encoded, checked against usage), its logprobs null
    good = {"ok", "retry_after_429", "503_then_ok", "string_tokens_ok", "no_logprobs"}
    # answers that fail a consistency check are evidence: kept as returned, with the reason
    kept = {
        "count_mismatch": "token_count: the server counts 9 completion tokens but returned 4 with logprobs",
        "nan_logprob": "logprob: logprob at position 0 is nan, not a log-probability",
    }
    assert {c for c, e in err.items() if e is None} == good | set(kept)
    for case, reason in kept.items():
        row = reqs[f"{case}-r0"]
        assert row["inconsistency"] == reason and row["output_token_ids"] == OUT_IDS, row
    assert all(reqs[f"{c}-r0"]["inconsistency"] is None for c in good)
    expect = {
        "always_500": "gave up after 3 attempts: HTTP 500: engine exploded",
        "garbage": "not valid JSON",
        "truncated_json": "not valid JSON",
        "short_body": "gave up after 3 attempts: connection broken",
        "slow": "gave up after 3 attempts: no complete answer within 1 s",
        "fewer_logprobs": "2 logprobs for 4 tokens",
        "unmappable_strings": "does not map back to one token id",
        "id_outside_vocab": "token id 999999 at position 1 is not in the model's vocabulary",
        "auth_500": "HTTP 500 from",
    }
    for case, fragment in expect.items():
        assert fragment in err[case], (case, err[case])

    # retries counted where they happen: the server
    def posts(case):
        return server.attempts(lambda p: p.body and p.body["prompt"][1] == CODE[case])

    assert len(posts("always_500")) == MAX_RETRIES + 1
    # an authentication failure, even as a 500, is not retried and says how to pass the key
    assert len(posts("auth_500")) == 1
    assert "authentication failed" in err["auth_500"] and "--api-key-env NAME" in err["auth_500"]
    assert "\n" not in err["auth_500"]
    assert len(posts("slow")) == MAX_RETRIES + 1
    assert len(posts("short_body")) == MAX_RETRIES + 1
    assert len(posts("503_then_ok")) == 3
    assert len(posts("garbage")) == len(posts("no_logprobs")) == len(posts("unmappable_strings")) == 1
    nolp_rows = [t for t in pq.read_table(out / "tokens").to_pylist() if t["request_id"] == "no_logprobs-r0"]
    assert [t["token_id"] for t in nolp_rows] == OUT_IDS and all(t["engine_logprob"] is None for t in nolp_rows)
    first, second = posts("retry_after_429")
    assert second.t - first.t >= 0.95  # Retry-After: 1 honoured
    # bounded: the attempts counted above, not the wall time (the audit also rescores; a loaded machine took 35 s)

    # the successful ones hold exactly what the server sent
    tokens = pq.read_table(out / "tokens").to_pylist()
    ok_rows = [t for t in tokens if t["request_id"] == "string_tokens_ok-r0"]
    assert [t["token_id"] for t in ok_rows] == OUT_IDS and all(t["engine_logprob"] == -0.25 for t in ok_rows)
    assert ok_rows[0]["engine_topk_ids"] == [35, 40]

    # every attempt is on its request: what the server answered, and when
    a500 = reqs["always_500-r0"]["attempts"]
    assert [(a["attempt"], a["sent"], a["status"]) for a in a500] == [(i, True, 500) for i in range(MAX_RETRIES + 1)]
    assert all(a["error"] == "HTTP 500: engine exploded" and a["t_end"] >= a["t_start"] for a in a500)
    assert [a["status"] for a in reqs["503_then_ok-r0"]["attempts"]] == [503, 503, 200]
    assert reqs["503_then_ok-r0"]["attempts"][-1]["error"] is None
    (garbage,) = reqs["garbage-r0"]["attempts"]
    assert garbage["status"] == 200 and "not valid JSON" in garbage["error"]
    (fewer,) = reqs["fewer_logprobs-r0"]["attempts"]
    assert fewer["status"] == 200 and "2 logprobs for 4 tokens" in fewer["error"]  # the parse failure is on the attempt

    findings = json.loads(r.out)
    assert findings["errors"] == len(CASES) - len(good) - len(kept)
    # the failures in one line, grouped by shape (nine shapes of one each: three shown), with a hint
    said = " ".join(r.err.split())
    assert f"requests failed ({findings['errors']} of {len(CASES)}): 1 x answer is not valid JSON" in said, said
    assert "6 more in 6 other shapes (hint: answers took longer than -E timeout_s" in said, said
    assert sum(findings["counts"].values()) == len(good) + len(kept)
    ev = findings["evidence"]
    assert ev["inconsistent"] == {
        "n": 2,
        "by_reason": {"logprob": 1, "token_count": 1},
        "scored": 2,
        "flagged": 2,
        "requests": sorted(f"{c}-r0" for c in kept),
    }
    # a NaN logprob can never be clean: the kept answer is scored and flagged
    verdict = {f["request_id"]: f["verdict"] for f in findings["flagged"]}
    assert verdict.get("nan_logprob-r0") in ("divergent", "corrupt")
    # an answer without logprobs, in a run whose other answers had them, is judged from its tokens alone
    # (`lpf.analysis.absent`): this server's tokens are ones the reference finds improbable
    assert verdict.get("no_logprobs-r0") in ("divergent", "corrupt")
    assert findings["judged"]["no_logprob"] == 4

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"]["options"]["api_key_env"] == "LPF_TEST_API_KEY"
    assert manifest["engine"]["options"]["served_model"] == SERVED
    assert manifest["engine"]["client"]["retries"]["retries"] >= 2 * MAX_RETRIES + 3
    assert set(manifest["engine"]["token_identity"]) == {"server", "tokenizer"}
    assert all(p.headers.get("Authorization") == f"Bearer {SECRET}" for p in server.posts)
    for f in out.rglob("*"):  # the key reaches the server and nothing else
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_unknown_model_name_fails_every_request_and_exits_2(lpf_cli, tmp_path):
    out = tmp_path / "run"
    with ScriptedServer(misbehave) as server:
        r = lpf_cli(
            "audit",
            "--engine",
            "openai",
            "--base-url",
            server.url + "/v1",
            "--model",
            "not-served",
            "--reference",
            MODEL,
            "--workload",
            _prompts(tmp_path, ["ok"]),
            "--out",
            out,
        )
    assert r.code == 2
    assert "nothing could be audited" in r.err
    findings = json.loads((out / "findings.json").read_text())
    assert findings["verdict"] == "error" and findings["errors"] == 1  # never "clean" when nothing was scored
    (row,) = _requests(out).values()
    assert "HTTP 404" in row["error"] and "does not exist" in row["error"]
    assert len(server.posts) == 1  # a 404 is not retried


def test_server_dying_mid_run_keeps_what_finished_and_fails_the_rest_fast(lpf_cli, tmp_path):
    answered = []

    def dies_after_three(server, path, body, attempt):
        if len(answered) >= 3:
            server.stop_soon()
            return Reply(drop=True)
        answered.append(body["prompt"][2])
        return Reply(200, completion_body(body))

    cases = ["ok"] * 12
    prompts = write_prompts(
        tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt_token_ids": [1, CODE["ok"], 20 + i]} for i in range(len(cases))]
    )
    out = tmp_path / "run"
    with ScriptedServer(dies_after_three) as server:
        r = _audit(lpf_cli, server.url + "/v1", prompts, out, "-E", "concurrency=1")
    assert r.code == 0, r.err
    reqs = _requests(out)
    assert len(reqs) == 12
    done = [rid for rid, row in reqs.items() if row["error"] is None]
    assert len(done) == 3
    failed = [row["error"] for row in reqs.values() if row["error"] is not None]
    assert all("cannot connect" in e or "connection broken" in e or "refused" in e for e in failed), failed
    assert any(e.startswith("not sent: the server refused") for e in failed)  # circuit breaker: no retry storm


def test_connection_refused_everywhere_exits_2_quickly(lpf_cli, tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = _audit(lpf_cli, f"http://127.0.0.1:{free_port()}/v1", _prompts(tmp_path, ["ok", "garbage", "slow"]), out)
    assert r.code == 2 and "nothing could be audited" in r.err
    assert all("cannot connect" in row["error"] or "refused" in row["error"] for row in _requests(out).values())
    assert time.monotonic() - t0 < 30


@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_overall_deadline_ends_a_hung_server(lpf_cli, tmp_path):
    def hangs(server, path, body, attempt):
        return Reply(200, completion_body(body), delay=60)

    out = tmp_path / "run"
    with ScriptedServer(hangs) as server:
        t0 = time.monotonic()
        r = _audit(
            lpf_cli,
            server.url + "/v1",
            _prompts(tmp_path, ["ok", "slow"]),
            out,
            "-E",
            "timeout_s=30",
            "-E",
            "deadline_s=2",
        )
        elapsed = time.monotonic() - t0
    assert r.code == 2
    assert all("deadline of 2 s" in row["error"] for row in _requests(out).values())
    assert elapsed < 30  # the deadline ended it, not the 30 s timeout or the 60 s hang (loose: a loaded machine)


def test_a_strict_server_that_refuses_the_token_id_field_gets_string_tokens_checked(lpf_cli, tmp_path):
    def strict(server, path, body, attempt):
        if "return_tokens_as_token_ids" in body:
            return Reply(
                400,
                {
                    "error": {
                        "message": "Unrecognized request argument supplied: return_tokens_as_token_ids",
                        "type": "invalid_request_error",
                    }
                },
            )
        return Reply(200, completion_body(body, token_form="text"))

    out = tmp_path / "run"
    with ScriptedServer(strict) as server:
        r = _audit(lpf_cli, server.url + "/v1", _prompts(tmp_path, ["ok", "garbage"]), out)
    assert r.code == 0, r.err
    assert all(row["error"] is None for row in _requests(out).values())
    e = json.loads((out / "manifest.json").read_text())["engine"]
    assert e["token_identity"] == ["tokenizer"] and e["return_tokens_as_token_ids"] is False
    asked = [p for p in server.posts if "return_tokens_as_token_ids" in p.body]
    assert 1 <= len(asked) <= 2  # refused at most once per request in flight, then never asked again


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "pass --base-url"),
        (["--base-url", "ftp://x"], "must be an http(s)"),
        (["--base-url", "http://user:pw@127.0.0.1:1/v1"], "must not carry credentials"),
        (["--base-url", "http://127.0.0.1:1/v1", "--api-key-env", "LPF_SURELY_UNSET_VAR"], "not set or empty"),
        (["--base-url", "http://127.0.0.1:1/v1", "-E", "max_retries=-1"], "max_retries must be >= 0"),
        (["--base-url", "http://127.0.0.1:1/v1", "-E", "colour=red"], "unknown engine option 'colour'"),
    ],
)
def test_bad_openai_options_are_one_line_errors_before_anything_is_written(lpf_cli, tmp_path, args, message):
    out = tmp_path / "run"
    r = lpf_cli(
        "audit", "--engine", "openai", "--model", MODEL, "--workload", _prompts(tmp_path, ["ok"]), "--out", out, *args
    )
    assert r.code == 2 and message in r.err, r.err
    assert "Traceback" not in r.err
    assert not out.exists()


def test_served_name_needs_a_local_reference(lpf_cli, tmp_path):
    r = lpf_cli(
        "audit",
        "--engine",
        "openai",
        "--base-url",
        "http://127.0.0.1:1/v1",
        "--model",
        "remote-name",
        "--workload",
        _prompts(tmp_path, ["ok"]),
        "--out",
        tmp_path / "run",
    )
    assert r.code == 2 and "pass --reference DIR" in r.err
