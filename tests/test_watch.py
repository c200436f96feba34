"""`lpf watch`: the proxy in front of real servers on 127.0.0.1, each started by the test.

- Against `lpf serve` (zoo:hybrid, float32): every answer through the proxy equals a direct call's field
  by field (ids and timestamps aside), sampled or not, errors included; what was sampled is recorded in
  the run schema (timing, requests in flight, upstream request id) and scored, and `lpf analyze` /
  `lpf report` read the recording.
- Against a scripted streaming upstream (a real HTTP server sending vLLM's SSE chunks, scripted so that it can
  cut a stream; `lpf serve`'s own streams through the proxy: test_serve.py): streams pass through event by
  event, a sampled one with what lpf asked for taken out, its tokens and logprobs recorded; an upstream that
  cuts a stream cuts the client's.
- Sampling is a pure function of the body and the seed (the one fast test here; the others start processes
  and are slow; test_watch_units.py covers the parts without servers).
The model-swap drill (`lpf serve` restarted with --inject quantize-weights:4 mid-stream) and the
concurrent-clients drill are in test_watch_drills.py (slow).
"""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pyarrow.parquet as pq
import pytest

from lpf.serve.process import served
from lpf.watch.process import watched
from lpf.watch.sample import Sampler

MODEL = "zoo:hybrid"
SEED = 3


def wait_for(pred, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def scorer_status(out) -> dict:
    try:
        return json.loads((out / "live" / "scorer.json").read_text())
    except (OSError, ValueError):
        return {}


def post(url: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=120)


def same_answer(a: httpx.Response, b: httpx.Response) -> None:
    """Status and JSON equal field by field, less what differs between two calls of one server (id, created)."""
    assert a.status_code == b.status_code, (a.text, b.text)
    ja, jb = a.json(), b.json()
    if isinstance(ja, dict) and isinstance(jb, dict):
        for k in ("id", "created"):
            ja.pop(k, None), jb.pop(k, None)
    assert ja == jb


def test_sampling_is_a_function_of_the_body_and_the_seed():
    bodies = [json.dumps({"prompt": f"P{i}", "max_tokens": 4}).encode() for i in range(4000)]
    a, b, c = Sampler(0.25, 1), Sampler(0.25, 1), Sampler(0.25, 2)
    picks = [a.take(x) for x in bodies]
    assert picks == [b.take(x) for x in bodies]  # a replay samples the same requests
    assert picks != [c.take(x) for x in bodies]  # another seed, another sample
    assert 0.22 < sum(picks) / len(picks) < 0.28
    assert all(Sampler(1.0).take(x) for x in bodies[:50]) and not any(Sampler(0.0).take(x) for x in bodies[:50])


@pytest.fixture(scope="module")
def upstream():
    with served("--model", MODEL, "--cache-mb", 12, env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


@pytest.fixture(scope="module")
def proxy(upstream, tmp_path_factory):
    out = tmp_path_factory.mktemp("watch") / "run"
    args = ["--reference", MODEL, "--sample", "0.5", "--seed", SEED, "--window", "4", "--part-seconds", "0.3"]
    with watched(upstream.base_url, out, *args, env={"OMP_NUM_THREADS": "1"}) as w:
        yield w


def _bodies() -> list[dict]:
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=5, n=12)
    out = []
    for i, it in enumerate(items):
        b = {"model": MODEL, "prompt": it["prompt"], "max_tokens": 10, "temperature": 0, "seed": i}
        if i % 3 == 1:
            b["logprobs"] = 2  # the client's own logprobs: kept as asked
        if i % 4 == 2:
            b["return_token_ids"] = True
        out.append(b)
    return out


@pytest.mark.slow  # `lpf serve` and `lpf watch` processes: ~100 s on the shared 2-core machine
def test_answers_through_the_proxy_equal_direct_ones_and_the_sample_is_recorded(upstream, proxy, lpf_cli, tmp_path):
    bodies = _bodies()
    sampler = Sampler(0.5, SEED)
    raws = [json.dumps(b).encode() for b in bodies]
    sampled = [sampler.take(r) for r in raws]
    assert 0 < sum(sampled) < len(sampled)  # both kinds are compared
    for raw in raws:
        same_answer(post(f"{proxy.base_url}/v1/completions", raw), post(f"{upstream.base_url}/v1/completions", raw))
    # errors pass through as the upstream answered them
    for raw in (b'{"model": "zoo:hybrid", "prompt": ', json.dumps({"model": "nope", "prompt": "A"}).encode()):
        a, b = post(f"{proxy.base_url}/v1/completions", raw), post(f"{upstream.base_url}/v1/completions", raw)
        assert a.status_code >= 400
        same_answer(a, b)
    a, b = httpx.get(f"{proxy.base_url}/v1/models"), httpx.get(f"{upstream.base_url}/v1/models")
    assert a.status_code == 200
    ja, jb = a.json(), b.json()
    assert [d["id"] for d in ja["data"]] == [d["id"] for d in jb["data"]] == [MODEL]

    out = proxy.out
    n = sum(sampled)  # the unknown-model body is sampled or not by its own hash; count what was recorded
    wait_for(lambda: scorer_status(out).get("scored", 0) >= n, what="the sample scored")
    req = pq.read_table(out / "requests").to_pylist()
    by_prompt = {tuple(r["prompt_token_ids"]): r for r in req if r["error"] is None}
    assert len(by_prompt) == n
    watch = {r["request_id"]: r for r in pq.read_table(out / "watch").to_pylist()}
    for r in by_prompt.values():
        assert r["t_submit"] <= r["t_first_token"] <= r["t_finish"]
        w = watch[r["request_id"]]
        assert w["status"] == 200 and w["in_flight"] == 0 and w["upstream_request_id"]
    # the recorded ids are the server's: a direct call with ids and logprobs returns the same
    b0 = next(b for b, s in zip(bodies, sampled) if s)
    direct = post(f"{upstream.base_url}/v1/completions", {**b0, "return_token_ids": True, "logprobs": 1}).json()
    rec = by_prompt[tuple(direct["choices"][0]["prompt_token_ids"])]
    assert rec["output_token_ids"] == direct["choices"][0]["token_ids"]
    tok = [t for t in pq.read_table(out / "tokens").to_pylist() if t["request_id"] == rec["request_id"]]
    assert [t["engine_logprob"] for t in sorted(tok, key=lambda t: t["position"])] == pytest.approx(
        direct["choices"][0]["logprobs"]["token_logprobs"]
    )
    # no API key, no request header anywhere in the run
    assert "Bearer" not in "".join(p.read_text(errors="replace") for p in out.rglob("*.json*"))
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns(".lock", "*.log"))
    r = lpf_cli("analyze", copy, "--json")
    assert r.code == 0, r.err
    findings = json.loads(r.out)
    assert findings["counts"].get("clean") == n
    assert lpf_cli("report", copy).code == 0 and (copy / "report.html").is_file()

    # the supervisor reads the scorer's judged windows on its own polling cycle: a loaded machine can show
    # the sample scored (scorer.json) before /metrics has counted its window's verdicts
    def counted() -> str | None:  # (every verdict's series exists from the start, at 0)
        text = httpx.get(f"{proxy.base_url}/metrics").text
        return text if 'lpf_watch_verdicts_total{verdict="clean"} 0.0' not in text else None

    metrics = wait_for(counted, what="the judged window's verdicts in /metrics")
    assert f'lpf_watch_requests_total{{route="/v1/completions",sampled="True"}} {float(n)}' in metrics
    page = httpx.get(f"{proxy.base_url}/lpf/")
    assert page.status_code == 200 and "<svg" in page.text and f"recorded: {n}" in page.text
    assert f"reference: {MODEL}" in page.text and "scoring lag: 0 answered samples waiting" in page.text


def _sse(body: dict, cut: bool = False) -> bytes:
    """vLLM's streamed completion as its serving code renders it: one chunk per token (logprobs, token_ids and
    the first chunk's prompt_token_ids explicitly null unless asked), a final chunk with finish_reason, [DONE]."""
    toks = [(11, "A", -0.25), (12, "B", -1.5), (13, "C", -0.125)]
    events = []
    for i, (tid, text, lp) in enumerate(toks):
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
        choice.update(prompt_token_ids=None, token_ids=None)
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "text_offset": [i],
                "token_logprobs": [lp],
                "tokens": [f"token_id:{tid}" if body.get("return_tokens_as_token_ids") else text],
                "top_logprobs": [{text: lp, "Z": lp - 1}][: 1 if body["logprobs"] else 0] or None,
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = [tid]
            if i == 0:
                choice["prompt_token_ids"] = [5, 6, 7]
        events.append({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]})
    events.append(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
        }
    )
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return data[: len(data) // 2] if cut else data


def _events(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


@pytest.mark.slow  # an `lpf watch` process (~20 s to start here under load)
def test_streams_pass_through_event_by_event_and_sampled_ones_are_recorded(tmp_path):
    from scripted_http import Reply, ScriptedServer

    def script(server, path, body, attempt):
        if body.get("prompt") == "cut":
            return Reply(raw=_sse(body, cut=True), headers={"X-Request-Id": "up-cut"}, truncate=True)
        return Reply(raw=_sse(body), headers={"X-Request-Id": "up-1"})

    with ScriptedServer(script) as up:
        out = tmp_path / "run"
        args = ["--reference", MODEL, "--sample", "1", "--window", "100", "--part-seconds", "0.2"]
        with watched(up.url, out, *args, env={"OMP_NUM_THREADS": "1"}) as w:
            for extra in ({}, {"logprobs": 0}, {"return_token_ids": True}):
                body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "stream": True, **extra}
                via = httpx.post(f"{w.base_url}/v1/completions", json=body, timeout=30)
                direct = httpx.post(f"{up.url}/v1/completions", json=body, timeout=30)
                assert via.status_code == direct.status_code == 200
                assert _events(via.content) == _events(direct.content)
            sent = [p.body for p in up.posts[::2]]  # what the proxy asked (the direct calls are the others)
            assert sent[0]["logprobs"] == 5 and sent[0]["return_token_ids"] is True
            assert sent[1]["logprobs"] == 0  # the client's own value, not lpf's
            with pytest.raises(httpx.HTTPError):  # a stream cut short is cut for the client too
                httpx.post(f"{w.base_url}/v1/completions", json={"prompt": "cut", "stream": True}, timeout=30).read()
            wait_for(
                lambda: (out / "requests").is_dir() and len(pq.read_table(out / "requests")) == 4, what="4 recorded"
            )
    req = sorted(pq.read_table(out / "requests").to_pylist(), key=lambda r: r["seq"])
    assert [r["output_token_ids"] for r in req[:3]] == [[11, 12, 13]] * 3
    assert req[0]["finish_reason"] == "length" and req[0]["output_text"] == "ABC"
    assert req[3]["error"] and req[3]["finish_reason"] == "error"
    tok = [t for t in pq.read_table(out / "tokens").to_pylist() if t["request_id"] == req[0]["request_id"]]
    assert [t["engine_logprob"] for t in sorted(tok, key=lambda t: t["position"])] == [-0.25, -1.5, -0.125]
    watch = {r["request_id"]: r for r in pq.read_table(out / "watch").to_pylist()}
    assert watch[req[0]["request_id"]]["upstream_request_id"] == "up-1"
    assert watch[req[0]["request_id"]]["lpf_added"] == "logprobs,token_ids"
