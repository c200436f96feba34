"""`lpf serve` (a real server in a child process on 127.0.0.1) under 2,000 requests from up to 256
concurrent clients, with random disconnects mid-request and malformed bodies mixed in.

It must stay healthy (every malformed body a 4xx, never a 5xx; /health 200 throughout), every
completed answer must be right (greedy tokens the reference's argmax and logprobs within float32
rounding of the reference, checked with the HF rescorer), every disconnected request must be taken
out of the engine (cancelled, its state slot free again once all is done), and its memory must stay
bounded (resident size after the storm close to what it was after warming up).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow

MODEL = "zoo:hybrid"
N_REQUESTS, MAX_CLIENTS = 2000, 256
MALFORMED = [
    b"{not json",
    b"[]",
    b'{"prompt": 5}',
    b'{"prompt": [1, 2, 99999999], "max_tokens": 2}',
    b'{"prompt": [1, 30], "max_tokens": "many"}',
    b'{"prompt": [1, 30], "n": 0}',
    b'{"prompt": [1, 30], "stream": true, "echo": true, "logprobs": 1}',  # streams are served; echo in one is not
    b'{"model": "nope", "prompt": [1, 30]}',
    b"\xff\xfe\x00",
    json.dumps({"prompt": [1] * 5000, "max_tokens": 2}).encode(),
]


def _metrics(base: str) -> dict:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _prompts():
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.zoo import registry

    tok = load_tokenizer(resolve_model(MODEL))
    return [tok.encode(it["prompt"]) for it in registry.workload_items("oracle", seed=21, n=40)]


async def _storm(base: str, prompts: list[list[int]], jobs: list[str]) -> list[dict]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for i, kind in enumerate(jobs):
        queue.put_nowait((i, kind))
    out: list[dict] = []
    rng = random.Random(7)

    async def client():
        def connect():
            return httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1))

        c = connect()
        try:
            while not queue.empty():
                i, kind = queue.get_nowait()
                p = prompts[i % len(prompts)]
                body = {
                    "model": MODEL,
                    "prompt": p,
                    "max_tokens": 4,
                    "temperature": 0,
                    "logprobs": 1,
                    "return_tokens_as_token_ids": True,
                }
                if kind == "malformed":
                    r = await c.post(
                        base + "/v1/completions",
                        content=MALFORMED[i % len(MALFORMED)],
                        headers={"Content-Type": "application/json"},
                    )
                    out.append({"kind": kind, "status": r.status_code, "text": r.text[:200]})
                elif kind == "disconnect":
                    try:  # gives up mid-request: the connection closes under the server
                        await asyncio.wait_for(
                            c.post(base + "/v1/completions", json={**body, "max_tokens": 64, "ignore_eos": True}),
                            rng.uniform(0.01, 0.3),
                        )
                        out.append({"kind": kind, "status": "finished first"})
                    except asyncio.TimeoutError:
                        out.append({"kind": kind, "status": "gone"})
                        # a request cancelled inside httpx can leave the pool's one connection checked
                        # out (the next request then waits for it until PoolTimeout): a client that
                        # gave up closes its connection and opens a new one, as a real one would
                        await c.aclose()
                        c = connect()
                else:
                    r = await c.post(base + "/v1/completions", json=body, headers={"X-Request-Id": f"s{i}"})
                    out.append(
                        {
                            "kind": kind,
                            "status": r.status_code,
                            "prompt": p,
                            "answer": r.json() if r.status_code == 200 else r.text,
                        }
                    )
        finally:
            await c.aclose()

    await asyncio.gather(*(client() for _ in range(MAX_CLIENTS)))
    return out


def test_serve_stays_healthy_right_and_bounded_under_a_storm():
    from lpf.core.model_specs import resolve_model
    from lpf.pipeline.reference import Rescorer, ScoreItem
    from lpf.serve.process import served

    prompts = _prompts()
    rng = random.Random(3)
    jobs = [rng.choices(["ok", "disconnect", "malformed"], weights=[80, 10, 10])[0] for _ in range(N_REQUESTS)]
    with served("--model", MODEL, "--cache-mb", 24, "--max-num-seqs", 128, env={"OMP_NUM_THREADS": "1"}) as s:
        warm = asyncio.run(_storm(s.base_url, prompts, ["ok"] * 100))
        assert all(r["status"] == 200 for r in warm)
        before, free0 = _rss_mb(s.proc.pid), _metrics(s.base_url)["lpf_state_slots_free"]
        t0 = time.monotonic()
        results = asyncio.run(_storm(s.base_url, prompts, jobs))
        elapsed = time.monotonic() - t0
        time.sleep(1.0)  # the last cancellations are taken between two steps
        m = _metrics(s.base_url)
        after = _rss_mb(s.proc.pid)
        assert urllib.request.urlopen(s.base_url + "/health", timeout=10).status == 200
        code, log = s.stop()
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert len(results) == N_REQUESTS

    bad = [r for r in results if r["kind"] == "malformed"]
    assert bad and all(400 <= r["status"] < 500 for r in bad), [r for r in bad if not 400 <= r["status"] < 500][:3]
    gone = [r for r in results if r["kind"] == "disconnect" and r["status"] == "gone"]
    assert len(gone) >= 50
    # every request the server took ends finished, refused or cancelled; none is left holding a slot
    assert m["lpf_requests_submitted_total"] == (
        m["lpf_requests_finished_total"] + m["lpf_requests_rejected_total"] + m["lpf_requests_cancelled_total"]
    )
    assert m["lpf_requests_in_flight"] == 0 and m["lpf_state_slots_free"] == free0
    # many clients left after their request reached the engine (the others gave up while connecting); how many
    # depends on the machine's pace against the clients' 0.01-0.3 s patience: 108 of 223 (48%) on a full-suite
    # run of 2026-12-07, over half on others. The accounting above is the invariant; this says cancels happen
    assert m["lpf_requests_cancelled_total"] >= 0.3 * len(gone)
    assert after - before < 150, (before, after)

    ok = [r for r in results if r["kind"] == "ok"]
    assert all(r["status"] == 200 for r in ok), [r for r in ok if r["status"] != 200][:3]
    # every completed answer against the reference: greedy tokens its argmax, logprobs within rounding
    answers = {}
    for r in ok:
        lp = r["answer"]["choices"][0]["logprobs"]
        ids = tuple(int(t.removeprefix("token_id:")) for t in lp["tokens"])
        answers.setdefault((tuple(r["prompt"]), ids), []).append(lp["token_logprobs"])
    rescorer = Rescorer(resolve_model(MODEL))
    items = [ScoreItem(str(i), list(p), list(ids)) for i, (p, ids) in enumerate(answers)]
    ref = {}
    for table in rescorer.score(items):
        for row in table.to_pylist():
            ref[(int(row["request_id"]), row["position"])] = row
    for i, ((p, ids), lps) in enumerate(answers.items()):
        for pos in range(len(ids)):
            row = ref[(i, pos)]
            assert row["ref_rank"] == 1 or row["ref_top1_logprob"] - row["ref_logprob"] < 1e-4, (p, ids, pos)
            assert max(abs(v[pos] - row["ref_logprob"]) for v in lps) < 1e-3, (p, ids, pos)
    assert len(answers) <= len(prompts)  # one answer per prompt, however busy the server was
    print(
        f"storm: {N_REQUESTS} requests in {elapsed:.1f} s, rss {before:.0f} -> {after:.0f} MB, "
        f"cancelled {m['lpf_requests_cancelled_total']:.0f} of {len(gone)} disconnects"
    )
