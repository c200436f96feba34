"""Benchmark: `lpf watch`'s proxy overhead against calling the upstream directly, at 0%, 1% and 100% sampling.

The upstream is a minimal OpenAI-compatible uvicorn server in a child process answering every completion
at once with a fixed vLLM-shaped body (logprobs and token ids when asked), so what is measured is the
proxy's own cost, not an engine's. The proxy runs in another child (`python bench/watch.py --serve-proxy`):
`lpf.watch.proxy` with a real `Recorder` writing a run directory (no scorer: scoring is another process,
off the request path; on this 2-core machine it would only compete for the CPU). The CPU each request costs the proxy process (user + system, from /proc) is printed beside the upstream's:
on a busy machine it is the figure that does not depend on what else runs. Per configuration,
`--requests` sequential requests (latency: p50 and p99 of the client's round trip) and the same number
from `--concurrency` clients (throughput, requests/s), direct and through the proxy, side by side.
`--quick`: 200 requests (seconds; nothing asserted, no results file). Otherwise writes
bench/results/watch.json. Usage: python bench/watch.py [--quick] [--requests N] [--concurrency C]
"""

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def fake_upstream_app():
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        choice = {"index": 0, "text": "ABCD", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        choice["token_ids"] = [11, 12, 13, 14] if body.get("return_token_ids") else None
        choice["prompt_token_ids"] = [5, 6, 7] if body.get("return_token_ids") else None
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "text_offset": [0, 1, 2, 3],
                "token_logprobs": [-0.1, -0.2, -0.3, -0.4],
                "tokens": ["A", "B", "C", "D"],
                "top_logprobs": [{"A": -0.1}, {"B": -0.2}, {"C": -0.3}, {"D": -0.4}],
            }
        return {
            "id": "cmpl-x",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }

    return app


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(fake_upstream_app(), host="127.0.0.1", port=port, log_level="error", access_log=False)


def serve_proxy(upstream: str, port: int, rate: float, out: str) -> None:
    import uvicorn

    from lpf.watch.service import Settings, prepare
    from lpf.watch.metrics import WatchMetrics
    from lpf.watch.proxy import create_proxy
    from lpf.watch.record import Recording
    from lpf.watch.recorder import Recorder
    from lpf.watch.sample import Sampler

    s = Settings(upstream=upstream, reference="zoo:hybrid", out=Path(out), sample=rate)
    run, tok, vocab = prepare(s)
    recorder = Recorder(run, Recording(tok, vocab), part_seconds=1.0)
    app = create_proxy(upstream, Sampler(rate, 0), recorder, WatchMetrics())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def _start(args: list[str], url: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, __file__, *args])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{args} exited with {p.returncode} before it listened")
        try:
            httpx.get(url, timeout=1)
            return p
        except httpx.HTTPError:
            time.sleep(0.2)
    p.kill()
    raise RuntimeError(f"{args} did not start")


def _body(i: int) -> bytes:
    return json.dumps({"model": "m", "prompt": f"request {i}", "max_tokens": 4, "temperature": 0}).encode()


def cpu_seconds(pid: int) -> float:
    """user + system CPU of a process so far (from /proc): what the proxy costs, whatever else the machine runs."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(base: str, n: int, concurrency: int, pid: int | None = None) -> dict:
    cpu0 = cpu_seconds(pid) if pid else None
    lat = []
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            t = time.perf_counter()
            r = c.post(f"{base}/v1/completions", content=_body(i), headers={"content-type": "application/json"})
            lat.append(time.perf_counter() - t)
            assert r.status_code == 200

    async def many():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=120) as c:
            sem = asyncio.Semaphore(concurrency)

            async def one(i):
                async with sem:
                    r = await c.post(
                        f"{base}/v1/completions", content=_body(n + i), headers={"content-type": "application/json"}
                    )
                    assert r.status_code == 200

            t = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            return n / (time.perf_counter() - t)

    lat.sort()
    out = {"p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))]}
    out["rps"] = asyncio.run(many())
    if pid:
        out["cpu_ms_per_request"] = 1e3 * (cpu_seconds(pid) - cpu0) / (2 * n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--serve-upstream", type=int)
    ap.add_argument("--serve-proxy", nargs=4, metavar=("UPSTREAM", "PORT", "RATE", "OUT"))
    a = ap.parse_args()
    if a.serve_upstream:
        return serve_upstream(a.serve_upstream)
    if a.serve_proxy:
        up, port, rate, out = a.serve_proxy
        return serve_proxy(up, int(port), float(rate), out)
    from lpf.serve.process import free_port

    n = 200 if a.quick else a.requests
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    procs = [_start(["--serve-upstream", str(up_port)], f"{upstream}/docs")]
    results = {}
    try:
        measure(upstream, 50, a.concurrency)  # warm-up
        results["direct"] = measure(upstream, n, a.concurrency, procs[0].pid)
        for rate in (0.0, 0.01, 1.0):
            port = free_port()
            out = Path(tempfile.mkdtemp()) / "run"
            p = _start(["--serve-proxy", upstream, str(port), str(rate), str(out)], f"http://127.0.0.1:{port}/metrics")
            procs.append(p)
            measure(f"http://127.0.0.1:{port}", 50, a.concurrency)
            results[f"proxy {rate:.0%}"] = measure(f"http://127.0.0.1:{port}", n, a.concurrency, p.pid)
            p.terminate()
            p.wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)
    d = results["direct"]
    print("| route | p50 ms | p99 ms | p50 overhead ms | throughput req/s | x direct | CPU ms/request |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['p50_ms'] - d['p50_ms']:.2f} | "
            f"{r['rps']:.0f} | {r['rps'] / d['rps']:.2f}x | {r['cpu_ms_per_request']:.2f} |"
        )
    if not a.quick:
        (ROOT / "bench" / "results" / "watch.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
