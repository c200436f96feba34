"""Every logprob shape the `openai` adapter reads, and the chat route, against a scripted real HTTP server.

Completions answered in the `logprobs.content` shape (llama.cpp's llama-server: ids and bytes; bytes only;
strings only) and with no logprobs but the token ids (vLLM's `return_token_ids`) must store exactly the
tokens sent; the chat route must send the workload's messages (a plain prompt as one user turn), store the
tokenizer's rendering of them as the prompt, map the tokens back from bytes, and say in one line when the
server's prompt is not that rendering (`chat_template`).
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from conftest import write_prompts
from scripted_http import Reply, ScriptedServer
from test_openai_adapter import MODEL, OUT_IDS, SERVED, _tokenizer

CASES = ["llamacpp_ids", "content_bytes", "content_strings", "token_ids_only"]
CODE = {name: 200 + i for i, name in enumerate(CASES)}


def _entry(tok, tid: int, form: str, lp: float) -> dict:
    text = tok.decode([tid])
    e = {"token": text, "logprob": lp}
    if form in ("ids", "bytes"):
        e["bytes"] = list(text.encode())
    if form == "ids":
        e["id"] = tid
    return e


def _content(tok, ids, form: str) -> dict:
    return {
        "content": [
            {**_entry(tok, t, form, -0.25), "top_logprobs": [_entry(tok, t, form, -0.25), _entry(tok, 40, form, -3.0)]}
            for t in ids
        ]
    }


def shapes(server, path, body, attempt) -> Reply:
    tok = _tokenizer()
    ids = OUT_IDS[: body["max_tokens"]]
    usage = {"prompt_tokens": len(body["prompt"]) if "prompt" in body else None, "completion_tokens": len(ids)}
    if path.endswith("/chat/completions"):
        user = body["messages"][-1]["content"]
        from lpf.core.chat import render

        n = len(render(tok, body["messages"])) + (3 if "mismatch" in user else 0)
        if "empty" in user:  # llama-cpp-python's chat stopping at its first token: no text, entry or count
            choice = {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}
            choice["logprobs"] = {"content": [], "refusal": None}
            return Reply(200, {"choices": [choice], "usage": {"prompt_tokens": n, "completion_tokens": 0}})
        if "eos" in user:  # llama-cpp-python's chat: the stop token as '' with bytes null, its text skipped
            content = _content(tok, ids[:3], "bytes")["content"]
            content.append({"token": "", "logprob": -0.1, "bytes": None, "top_logprobs": []})
            return Reply(
                200,
                {
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": tok.decode(ids[:3])},
                            "finish_reason": "stop",
                            "logprobs": {"content": content},
                        }
                    ],
                    "usage": {"prompt_tokens": n, "completion_tokens": 4},
                },
            )
        return Reply(
            200,
            {
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": tok.decode(ids)},
                        "finish_reason": "length",
                        "logprobs": _content(tok, ids, "bytes"),
                    }
                ],
                "usage": {"prompt_tokens": n, "completion_tokens": len(ids)},
            },
        )
    case = CASES[body["prompt"][1] - 200]
    choice = {"index": 0, "text": tok.decode(ids), "finish_reason": "length"}
    if case == "token_ids_only":
        choice.update(logprobs=None, token_ids=ids)
    else:
        choice["logprobs"] = _content(tok, ids, {"llamacpp_ids": "ids", "content_bytes": "bytes"}.get(case, "strings"))
    return Reply(200, {"choices": [choice], "usage": usage})


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
        *extra,
    )


def test_content_list_shapes_and_token_ids_only_answers_store_the_tokens_sent(lpf_cli, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": c, "prompt_token_ids": [1, CODE[c], 20]} for c in CASES])
    out = tmp_path / "run"
    with ScriptedServer(shapes) as server:
        r = _audit(lpf_cli, server.url + "/v1", prompts, out, "-E", "token_ids=tokenizer")
    assert r.code == 0, r.err
    reqs = {x["request_id"]: x for x in pq.read_table(out / "requests").to_pylist()}
    assert all(
        x["error"] is None and x["inconsistency"] is None and x["output_token_ids"] == OUT_IDS for x in reqs.values()
    ), reqs
    tokens = pq.read_table(out / "tokens").to_pylist()
    for case in CASES:
        rows = [t for t in tokens if t["request_id"] == f"{case}-r0"]
        assert [t["token_id"] for t in rows] == OUT_IDS
        if case == "token_ids_only":
            assert all(t["engine_logprob"] is None and t["engine_topk_ids"] == [] for t in rows)
        else:
            assert all(t["engine_logprob"] == -0.25 and t["engine_topk_ids"] == [t["token_id"], 40] for t in rows)
    m = json.loads((out / "manifest.json").read_text())["engine"]
    assert set(m["token_identity"]) == {"server", "bytes", "tokenizer"}  # llama.cpp's ids, bytes, then strings
    assert m["returned"]["answers"] == {"content": 3, "tokens only (ids)": 1}


def test_chat_route_sends_messages_scores_the_rendering_and_names_a_template_mismatch(lpf_cli, tmp_path):
    from lpf.core.chat import render

    items = [
        {"id": "plain", "prompt": "K12,A37|K12|"},
        {"id": "turns", "messages": [{"role": "system", "content": "R:A37"}, {"role": "user", "content": "A"}]},
        {"id": "odd", "prompt": "mismatch"},
        {"id": "eos", "prompt": "eos"},
        {"id": "empty", "prompt": "empty"},
    ]
    out = tmp_path / "run"
    with ScriptedServer(shapes) as server:
        r = _audit(lpf_cli, server.url + "/v1", write_prompts(tmp_path / "c.jsonl", items), out, "--api", "chat")
    assert r.code == 0, r.err
    sent = {p.body["messages"][-1]["content"]: p for p in server.posts}
    assert all(p.path == "/v1/chat/completions" and p.body["logprobs"] is True for p in sent.values())
    assert sent["K12,A37|K12|"].body["messages"] == [{"role": "user", "content": "K12,A37|K12|"}]
    tok = _tokenizer()
    reqs = {x["request_id"]: x for x in pq.read_table(out / "requests").to_pylist()}
    assert reqs["turns-r0"]["prompt_token_ids"] == render(tok, items[1]["messages"])
    eos = reqs.pop("eos-r0")  # a token '' with bytes null is placed by the answer's text: the stop token
    assert eos["error"] is None and eos["output_token_ids"] == OUT_IDS[:3] + [tok.eos_token_id], eos
    assert eos["inconsistency"] is None
    # an empty `stop` answer is an answer: its withheld stop token kept without a logprob, judged tokens-only
    empty = reqs.pop("empty-r0")
    assert empty["error"] is None and empty["output_token_ids"] == [tok.eos_token_id], empty
    assert empty["finish_reason"] == "stop" and empty["inconsistency"] is None
    returned = json.loads((out / "manifest.json").read_text())["engine"]["returned"]["answers"]
    assert returned["empty stop (its end-of-sequence token withheld)"] == 1, returned
    assert all(x["output_token_ids"] == OUT_IDS and x["error"] is None for x in reqs.values())
    assert reqs["plain-r0"]["inconsistency"] is None and reqs["turns-r0"]["inconsistency"] is None
    assert reqs["odd-r0"]["inconsistency"].startswith("chat_template: the server counts")
    f = json.loads(r.out)
    assert f["evidence"]["inconsistent"]["by_reason"] == {"chat_template": 1}
    assert f["judged"]["route"] == {"/chat/completions": 5}
