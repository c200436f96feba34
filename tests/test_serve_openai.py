"""`lpf serve` as an OpenAI server the official `openai` Python client drives: completions and chat, whole
and streamed, directly and through `lpf watch`.

One `lpf serve` (zoo:hybrid, float32) for the module. Streamed answers must carry exactly the tokens and
logprobs of the whole answer to the same greedy request, in more than one chunk (the stream follows the
engine's steps), end with `data: [DONE]`, and the chat route's prompt must be the model's chat template
rendering of the messages (what `lpf run --engine openai` scores chat workloads against).
"""

from __future__ import annotations

import json
import time

import httpx
import pyarrow.parquet as pq
import pytest

from lpf.serve.process import served
from lpf.watch.process import watched

MODEL = "zoo:hybrid"
PROMPT = "Q: 12+7=?\nA:"
MESSAGES = [{"role": "system", "content": "BE BRIEF"}, {"role": "user", "content": "12+7"}]


@pytest.fixture(scope="module")
def server():
    with served("--model", MODEL, "--cache-mb", 12, env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def _client(base_url: str):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(**extra) -> dict:
    return dict(
        model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}, **extra
    )


def test_the_openai_client_gets_the_same_tokens_whole_and_streamed(server):
    from lpf.core.chat import render
    from lpf.core.model_specs import load_tokenizer, resolve_model

    c = _client(server.base_url)
    whole = c.completions.create(prompt=PROMPT, logprobs=2, **_greedy())
    chunks = list(c.completions.create(prompt=PROMPT, logprobs=2, stream=True, **_greedy()))
    assert len(chunks) > 1  # one chunk per engine step, not the answer in one piece
    w = whole.choices[0]
    assert "".join(ch.choices[0].text for ch in chunks) == w.text
    assert sum((ch.choices[0].logprobs.token_logprobs for ch in chunks), []) == w.logprobs.token_logprobs
    assert sum((ch.choices[0].logprobs.tokens for ch in chunks), []) == w.logprobs.tokens
    # each chunk's offsets start where the text sent before it ends (vLLM's `initial_text_offset`)
    starts = [ch.choices[0].logprobs.text_offset[0] for ch in chunks if ch.choices[0].logprobs.tokens]
    assert starts == [
        len("".join(x.choices[0].text for x in chunks[:i]))
        for i, ch in enumerate(chunks)
        if ch.choices[0].logprobs.tokens
    ]
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length" == w.finish_reason
    assert sum((ch.choices[0].model_extra["token_ids"] for ch in chunks), []) == w.model_extra["token_ids"]

    chat = c.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **_greedy())
    tok = load_tokenizer(resolve_model(MODEL))
    assert chat.model_extra["prompt_token_ids"] == render(tok, MESSAGES)
    assert chat.usage.prompt_tokens == len(render(tok, MESSAGES)) and chat.usage.completion_tokens == 8
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 8 and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[0].token == e.token for e in entries)  # vLLM's order: the token, then its top-k
    stream = list(
        c.chat.completions.create(
            messages=MESSAGES,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
            **_greedy(),
        )
    )
    assert stream[0].choices[0].delta.role == "assistant" and stream[-1].choices == []
    assert stream[-1].usage.completion_tokens == 8
    body = [ch for ch in stream if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == chat.choices[0].message.content
    got = [e.logprob for ch in body if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert got == [e.logprob for e in entries]

    raw = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True},
        timeout=60,
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith("data: [DONE]\n\n") and raw.text.startswith("data: {")
    bad = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "x"}]})
    assert bad.status_code == 400 and "messages[0]" in bad.json()["error"]["message"]
    echo = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "stream": True}
    bad = httpx.post(f"{server.base_url}/v1/completions", json=echo)  # refused, never silently left out
    assert bad.status_code == 400 and "stream=true" in bad.json()["error"]["message"]


@pytest.mark.slow  # an `lpf watch` process and its scorer (~30 s here under load)
def test_the_openai_client_through_lpf_watch_is_recorded_and_scored(server, tmp_path):
    out = tmp_path / "run"
    args = [
        "--reference",
        MODEL,
        "--sample",
        "1",
        "--window",
        "4",
        "--part-seconds",
        "0.2",
        "--upstream-dtype",
        "float32",
    ]
    with watched(server.base_url, out, *args, env={"OMP_NUM_THREADS": "1"}) as w:
        c = _client(w.base_url)
        direct = _client(server.base_url)
        a = c.completions.create(prompt=PROMPT, **_greedy())
        assert a.choices[0].text == direct.completions.create(prompt=PROMPT, **_greedy()).choices[0].text
        assert a.choices[0].logprobs is None  # what lpf asked for is taken out again
        text = "".join(ch.choices[0].text for ch in c.completions.create(prompt=PROMPT, stream=True, **_greedy()))
        assert text == a.choices[0].text
        c.chat.completions.create(messages=MESSAGES, **_greedy())
        streamed = c.chat.completions.create(messages=MESSAGES, stream=True, **_greedy())
        assert all(ch.choices[0].logprobs is None for ch in streamed if ch.choices)
        deadline = time.monotonic() + 120
        windows = out / "live" / "windows.jsonl"
        while time.monotonic() < deadline and not (windows.exists() and windows.read_text().strip()):
            time.sleep(0.3)
        judged = [json.loads(line) for line in windows.read_text().splitlines()]
    req = pq.read_table(out / "requests").to_pylist()
    assert len(req) == 4 and all(r["inconsistency"] is None and r["error"] is None for r in req)
    assert all(len(r["output_token_ids"]) == 8 for r in req)
    assert judged[0]["n_requests"] == 4 and judged[0]["verdicts"] == {"clean": 4} and not judged[0]["alarm"]
