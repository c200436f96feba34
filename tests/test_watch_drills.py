"""`lpf watch` drills with real parts (slow: each starts `lpf serve` and `lpf watch` processes).

- The model swapped under its name: `lpf serve` (zoo:hybrid, float32) restarted on the same port with
  `--inject quantize-weights:4` in the middle of a clean stream of requests: no window before the swap
  alarms, the first window after it does, and its change point names the swap's first request.
- Concurrent clients (64 at once) with disconnects and malformed bodies, the scorer SIGKILLed mid-run: every
  client that stayed got the upstream's own answer, every sample is recorded or counted as dropped, the
  scorer comes back, and a SIGKILL of `lpf watch` itself leaves every committed sample readable.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pyarrow.parquet as pq
import pytest

from lpf.serve.process import free_port, served
from lpf.watch.process import watched

MODEL = "zoo:hybrid"
pytestmark = pytest.mark.slow
ENV = {"OMP_NUM_THREADS": "1"}


def wait_for(pred, timeout: float = 180.0, what: str = "condition", show=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}" + (f": {show()}" if show else ""))


def windows(out) -> list[dict]:
    p = out / "live" / "windows.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []


def _prompts(n: int, seed: int) -> list[str]:
    from lpf.zoo import registry

    return [it["prompt"] for it in registry.workload_items("oracle", seed=seed, n=n)]


def test_a_model_swapped_under_its_name_alarms_in_the_first_window_after_the_swap(tmp_path):
    port, out, w = free_port(), tmp_path / "run", 8
    prompts = _prompts(4 * w, seed=21)
    args = ["--reference", MODEL, "--sample", "1", "--window", w, "--part-seconds", "0.3"]

    def send(base, ps):
        for p in ps:  # one at a time: arrival order is the order sent
            r = httpx.post(
                f"{base}/v1/completions",
                json={"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
                timeout=120,
            )
            assert r.status_code == 200, r.text

    with served("--model", MODEL, "--cache-mb", 12, "--port", port, env=ENV) as clean:
        with watched(clean.base_url, out, *args, env=ENV) as proxy:
            send(proxy.base_url, prompts[: 2 * w])
            clean.stop()
            with served("--model", MODEL, "--cache-mb", 12, "--port", port, "--inject", "quantize-weights:4", env=ENV):
                send(proxy.base_url, prompts[2 * w :])
                got = wait_for(lambda: len(windows(out)) >= 4 and windows(out), what="4 windows judged")
    assert [x["alarm"] for x in got[:4]] == [False, False, True, True], [(x["verdicts"], x["run_test"]) for x in got]
    assert got[2]["change"]["seq"] == 2 * w and got[2]["change"]["request_id"] == f"w{2 * w:09d}"
    assert got[2]["run_test"]["result"] == "different"


def test_concurrent_clients_disconnects_malformed_bodies_and_a_killed_scorer(tmp_path):
    out = tmp_path / "run"
    prompts = _prompts(64, seed=33)
    args = ["--reference", MODEL, "--sample", "0.5", "--window", "16", "--part-seconds", "0.3"]
    with served("--model", MODEL, "--cache-mb", 16, env=ENV) as up:
        with watched(up.base_url, out, *args, env=ENV) as proxy:
            bodies = []
            for i, p in enumerate(prompts):
                if i % 12 == 5:
                    bodies.append(b'{"model": "zoo:hybrid", "prompt": [1, 2,')  # malformed
                else:
                    body = {"model": MODEL, "prompt": p, "max_tokens": 8 + i % 8, "temperature": 0, "seed": i}
                    bodies.append(json.dumps(body).encode())
            leave = {i for i in range(len(bodies)) if i % 10 == 7}  # clients that give up after 50 ms

            async def one(client, base, i, raw, short):
                try:
                    return await client.post(
                        f"{base}/v1/completions",
                        content=raw,
                        headers={"content-type": "application/json"},
                        timeout=0.05 if short else 300,
                    )
                except httpx.TimeoutException:
                    return None

            async def burst(base, with_leavers):
                limits = httpx.Limits(max_connections=128)
                async with httpx.AsyncClient(limits=limits) as client:
                    return await asyncio.gather(
                        *(one(client, base, i, raw, with_leavers and i in leave) for i, raw in enumerate(bodies))
                    )

            via = asyncio.run(burst(proxy.base_url, True))
            # the scorer is SIGKILLed once it has started; proxying goes on through a second burst
            status = out / "live" / "scorer.json"
            wait_for(status.is_file, what="the scorer's first cycle")
            os.kill(json.loads(status.read_text())["pid"], signal.SIGKILL)
            again = asyncio.run(burst(proxy.base_url, False))
            assert all(r is not None for r in again)
            direct = asyncio.run(burst(up.base_url, False))
            for i, (a, b) in enumerate(zip(via, direct)):
                if i in leave and a is None:
                    continue
                assert a is not None and a.status_code == b.status_code, (i, a and a.text, b.text)
                ja, jb = a.json(), b.json()
                for k in ("id", "created"):
                    ja.pop(k, None), jb.pop(k, None)
                assert ja == jb, i
            metrics = wait_for(
                lambda: (m := httpx.get(f"{proxy.base_url}/metrics").text)
                and _value(m, "lpf_watch_scorer_restarts") >= 1
                and _value(m, "lpf_watch_samples_recorded") + _value(m, "lpf_watch_samples_dropped_total")
                == _value(m, 'lpf_watch_requests_total{route="/v1/completions",sampled="True"}')
                and m,
                what="every sample recorded or dropped, the scorer restarted",
                show=lambda: [
                    x
                    for x in httpx.get(f"{proxy.base_url}/metrics").text.splitlines()
                    if "_created" not in x and not x.startswith("#")
                ],
                timeout=60,
            )
            sampled = _value(metrics, 'lpf_watch_requests_total{route="/v1/completions",sampled="True"}')
            recorded = len(pq.read_table(out / "requests"))
            assert recorded == _value(metrics, "lpf_watch_samples_recorded")
            assert recorded + _value(metrics, "lpf_watch_samples_dropped_total") == sampled > 0
            wait_for(lambda: windows(out), what="a window judged after the restart")
            # a SIGKILL of lpf watch loses no sample already written
            proxy.stop(signal.SIGKILL)
            from lpf.run.store import RunDir

            run = RunDir.open(out)
            assert run.read("requests").num_rows == recorded
            assert set(run.read("tokens", ["request_id"]).column("request_id").to_pylist()) <= set(
                run.read("requests", ["request_id"]).column("request_id").to_pylist()
            )


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
