"""The `openai` adapter against two ways real servers refuse lpf, on 127.0.0.1 (tests/scripted_http.py).

- A server whose request-id middleware accepts only UUIDs answers any other `X-Request-Id` with 400 and
  an empty body (what refused every request of a real audit): lpf sends a UUID by default, records it
  on the attempt, and keeps its own request ids in the run; `-E request_id_header=lpf` brings the
  failure back (one post per request, the grouped error line and the hint); `=none` sends no header.
- A server that refuses token-id prompts with HTTP 500 and a pydantic validation error ("Input should
  be a valid string"): the refusal is not retried; `-E prompt=auto` falls back to text prompts and the
  audit passes; `-E prompt=ids` fails every request at once with one line: one error shape (the
  message quotes each request's own prompt, the shape does not) and the hint to try `-E prompt=text`.
Plus the pure parts: error shapes, and a vLLM trace's UUID-named rows mapped back to the run's ids.
"""

from __future__ import annotations

import json
import re
import uuid

import pyarrow.parquet as pq
import pytest

from conftest import write_prompts
from scripted_http import Reply, ScriptedServer

MODEL = "zoo:hybrid"
SERVED = "tiny-served"
OUT_IDS = [35, 36, 37, 38]  # "ABCD" in the zoo tokenizer
N = 12
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _tokenizer():
    from lpf.core.model_specs import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(MODEL))


def _answer(body: dict) -> dict:
    """A /v1/completions answer (vLLM's shape, ids as `token_id:N`) for a prompt of ids or text."""
    tok = _tokenizer()
    prompt = body["prompt"]
    n_prompt = len(prompt) if isinstance(prompt, list) else len(tok.encode(prompt))
    ids = OUT_IDS[: body["max_tokens"]]
    tokens = [f"token_id:{t}" for t in ids]
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "text": tok.decode(ids),
                "finish_reason": "length",
                "logprobs": {
                    "tokens": tokens,
                    "token_logprobs": [-0.25] * len(ids),
                    "top_logprobs": [{t: -0.25} for t in tokens],
                    "text_offset": list(range(len(ids))),
                },
            }
        ],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)},
    }


def _prompts(tmp_path):
    words = ["ABC", "BCD", "CDE", "DEF", "EFG", "FGH", "GHI", "HIJ", "IJK", "JKL", "KLM", "LMN"]
    return write_prompts(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": w} for i, w in enumerate(words[:N])])


def _audit(lpf_cli, server, prompts, out, *extra):
    return lpf_cli(
        "audit",
        *("--engine", "openai", "--base-url", server.url + "/v1", "--model", SERVED, "--reference", MODEL),
        *("--workload", prompts, "--max-tokens", 4, "--out", out, "--fail-on", "never", "--json"),
        *("-E", "max_retries=4", "-E", "backoff_s=0.01", "-E", "concurrency=4", *extra),
    )


def _requests(out):
    return {r["request_id"]: r for r in pq.read_table(out / "requests").to_pylist()}


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def _rid(post) -> str | None:
    return {k.lower(): v for k, v in post.headers.items()}.get("x-request-id")


def uuid_only(server, path, body, attempt) -> Reply:
    with server.lock:  # this post: the latest with this body (bodies differ by prompt)
        rid = _rid(next(p for p in reversed(server.posts) if p.body == body))
    if rid is not None and not _UUID.match(rid):
        return Reply(400, raw=b"")  # the middleware: no reason given
    return Reply(200, _answer(body))


@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_a_server_that_takes_only_uuid_request_ids(lpf_cli, tmp_path):
    prompts = _prompts(tmp_path)
    with ScriptedServer(uuid_only) as server:
        r = _audit(lpf_cli, server, prompts, tmp_path / "uuid")
        sent = [_rid(p) for p in server.posts]
    assert r.code == 0, r.err
    assert len(sent) == N and all(_UUID.match(s or "") for s in sent) and len(set(sent)) == N  # one post each
    reqs = _requests(tmp_path / "uuid")
    assert sorted(reqs) == sorted(f"q{i}-r0" for i in range(N)) and all(x["error"] is None for x in reqs.values())
    # each attempt records the id the server was told: the map from the server's names back to the run's
    assert sorted(a["sent_id"] for x in reqs.values() for a in x["attempts"]) == sorted(sent)
    f = json.loads(r.out)
    assert f["errors"] == 0 and f["n_requests"] == N
    (told,) = [a["sent_id"] for a in reqs["q0-r0"]["attempts"]]
    shown = lpf_cli("inspect", tmp_path / "uuid", "q0-r0")
    assert shown.code == 0 and f"sent as {told}" in " ".join(shown.out.split()), shown.out  # the server's name

    with ScriptedServer(uuid_only) as server:
        r = _audit(lpf_cli, server, prompts, tmp_path / "lpf-ids", "-E", "request_id_header=lpf")
        posts = len(server.posts)
    assert r.code == 2, r.err
    line = _error_line(r.err)
    assert posts == N  # a 400 is not retried: no storm
    assert f"every request failed ({N} of {N}): {N} x HTTP 400 from " in line and "(empty body)" in line, line
    assert "try -E request_id_header=none" in line, line

    with ScriptedServer(uuid_only) as server:
        r = _audit(lpf_cli, server, prompts, tmp_path / "none", "-E", "request_id_header=none")
        assert r.code == 0, r.err
        assert len(server.posts) == N and all(_rid(p) is None for p in server.posts)
    assert all(a["sent_id"] is None for x in _requests(tmp_path / "none").values() for a in x["attempts"])


def refuses_token_ids(server, path, body, attempt) -> Reply:
    """A server whose validation error about the prompt comes back as HTTP 500 (not a 4xx)."""
    if isinstance(body["prompt"], list):
        return Reply(
            500,
            {
                "error": {
                    "message": "1 validation error for CompletionRequest\nprompt\n  Input should be a valid string "
                    f"[type=string_type, input_value={body['prompt']}, input_type=list]",
                    "type": "InternalServerError",
                    "code": 500,
                }
            },
        )
    return Reply(200, _answer(body))


@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_a_server_that_refuses_token_id_prompts_with_a_500(lpf_cli, tmp_path):
    prompts = _prompts(tmp_path)
    with ScriptedServer(refuses_token_ids) as server:
        r = _audit(lpf_cli, server, prompts, tmp_path / "auto")
        as_ids = [p for p in server.posts if isinstance(p.body["prompt"], list)]
        total = len(server.posts)
    assert r.code == 0, r.err
    assert 1 <= len(as_ids) <= 4  # those in flight when the first refusal came back (concurrency 4)
    assert total == N + len(as_ids)  # each refused once, never retried as ids, then sent as text
    reqs = _requests(tmp_path / "auto")
    assert all(x["error"] is None for x in reqs.values())
    refused = [a for x in reqs.values() for a in x["attempts"] if a["status"] == 500]
    assert len(refused) == len(as_ids)
    engine = json.loads((tmp_path / "auto" / "manifest.json").read_text())["engine"]
    assert engine["prompt_form"] == "text" and any("refused token-id prompts" in n for n in engine["notes"])
    assert json.loads(r.out)["errors"] == 0

    with ScriptedServer(refuses_token_ids) as server:
        r = _audit(lpf_cli, server, prompts, tmp_path / "ids", "-E", "prompt=ids")
        posts = len(server.posts)
    assert r.code == 2, r.err
    assert posts == N  # a deterministic refusal is not retried (it was 5 attempts per request)
    line = _error_line(r.err)
    # one shape: every request's error quotes its own prompt ids, the shape leaves them out
    assert f"every request failed ({N} of {N}): {N} x HTTP 500 from " in line, line
    assert "Input should be a valid string" in line and line.count("try -E prompt=text") == 1, line
    assert all(
        x["attempts"][0]["status"] == 500 and len(x["attempts"]) == 1 for x in _requests(tmp_path / "ids").values()
    )


def test_errors_group_by_shape_with_ids_and_numbers_out():
    from lpf.analysis.error_shapes import group, hint, summary

    ids = [f"oracle-0-{i:05d}-recall-r0" for i in range(490)] + ["p1-r0", "p2-r0"]
    errors = [
        f"HTTP 400 from http://h:1/v1/completions: request {rid} took {i}.5 ms" for i, rid in enumerate(ids[:490])
    ]
    errors += ["gave up after 5 attempts: HTTP 503: busy", None]
    g = group(errors, ids)
    assert [x["n"] for x in g] == [490, 1] and g[0]["example"] == errors[0]
    assert g[0]["shape"] == "HTTP # from http://h:#/v#/completions: request <request> took # ms"
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    assert len(group([f"id {a} refused", f"id {b} refused"])) == 1  # UUIDs are ids too
    assert summary(errors, ids).startswith("490 x HTTP 400 from http://h:1/v1/completions: request oracle-0-00000")
    assert hint("HTTP 500 from u: x; the server refuses token-id prompts: try -E prompt=text").startswith(
        "try -E prompt"
    )
    assert hint("engine exploded") is None


def test_a_vllm_trace_named_by_uuids_maps_back_to_the_runs_ids():
    from lpf.adapters.client_behaviour import cancel_record
    from lpf.adapters.vllm_trace import sent_names, served_ids

    u = [str(uuid.uuid4()) for _ in range(5)]
    requests = [
        {"request_id": "a-r0", "attempts": [{"error": None, "sent_id": u[0]}]},
        # a 503, then the answer: the kept attempt is the second
        {
            "request_id": "b-r0",
            "attempts": [{"error": "HTTP 503: busy", "sent_id": u[1]}, {"error": None, "sent_id": u[2]}],
        },
        {"request_id": "c-r0", "attempts": []},  # a cancelled first send, then the answer
    ]
    cancel_record(requests[2]["attempts"], 0.0, 0.1, 5, sent_id=u[3])
    requests[2]["attempts"].append({"error": None, "sent_id": u[4]})
    kept = {"a-r0": 0, "b-r0": 1, "c-r0": 0}
    names = sent_names(requests, kept)
    assert names == {u[0]: "a-r0", u[1]: "b-r0~retry0", u[2]: "b-r0", u[3]: "c-r0~attempt0", u[4]: "c-r0"}
    vllm = [f"cmpl-{x}-0-{'abcd1234'}" for x in u] + ["cmpl-someone-else-0-12345678"]
    got = served_ids(vllm, kept, names)
    assert got == {f"cmpl-{x}-0-abcd1234": names[x] for x in u}
