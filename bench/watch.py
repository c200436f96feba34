"""Benchmark: `lpf watch`'s proxy overhead against calling the upstream directly, at 0%, 1% and 100% sampling.

The upstream is a minimal OpenAI-compatible uvicorn server in a child process answering every completion
with a fixed vLLM-shaped body (logprobs and token ids when asked), at once, or after the delay a request's
`x-bench-delay-ms` header asks (the time an engine takes to generate: waiting, not CPU). The proxy runs in
another child (`python bench/watch.py --serve-proxy`): `lpf.watch.proxy` with a real `Recorder` writing a
run directory (no scorer: scoring is another process, off the request path; on this 2-core machine it would
only compete for the CPU). Two named baselines run in the same children's company, so what bounds the
proxy is measured, not guessed: `relay` (a raw asyncio TCP byte relay: one extra Python hop that parses
nothing) and `noop proxy` (uvicorn + httpx forwarding every request, no sampling, no metrics: the floor of
an HTTP-aware proxy on this stack).

Latency: `--requests` sequential requests per route, interleaved (request i goes to every route in turn,
so every route sees the same machine load): p50 and p99 of the client's round trip. Throughput: the same
number from `--concurrency` clients, routes in turn, `--rounds` times (median), against the instant upstream
(CPU-bound: on this machine client, upstream and proxy share 2 cores, so any proxy CPU lowers it) and
against one that takes `--engine-ms` per answer (an engine's pace: the proxy's CPU then has room). The CPU
each request costs a route's own process (user + system, from /proc) is printed beside: on a busy machine
it is the figure that depends least on what else runs.
`--quick`: 200 requests, 1 round (seconds; nothing asserted, no results file). Otherwise writes
bench/results/watch.json. Usage: python bench/watch.py [--quick] [--requests N] [--concurrency C]
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DELAY = "x-bench-delay-ms"


def fake_upstream_app():
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if request.headers.get(DELAY):
            await asyncio.sleep(float(request.headers[DELAY]) / 1e3)
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

    @app.get("/ping")
    async def ping():
        return {}

    return app


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(fake_upstream_app(), host="127.0.0.1", port=port, log_level="error", access_log=False)


def serve_proxy(upstream: str, port: int, rate: float, out: str) -> None:
    import uvicorn

    from lpf.watch.metrics import WatchMetrics
    from lpf.watch.proxy import create_proxy
    from lpf.watch.record import Recording
    from lpf.watch.recorder import Recorder
    from lpf.watch.sample import Sampler
    from lpf.watch.service import Settings, prepare

    s = Settings(upstream=upstream, reference="zoo:hybrid", out=Path(out), sample=rate)
    run, tok, vocab = prepare(s)
    recorder = Recorder(run, Recording(tok, vocab), part_seconds=1.0)
    app = create_proxy(upstream, Sampler(rate, 0), recorder, WatchMetrics())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def serve_noop(upstream: str, port: int) -> None:
    """The named baseline: uvicorn + one pooled httpx client relaying every request, nothing else."""
    import uvicorn

    held = {}
    drop = {b"host", b"content-length", b"connection", b"transfer-encoding"}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (m := await receive())["type"] != "lifespan.shutdown":
                held["c"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
                await send({"type": "lifespan.startup.complete"})
            return await send({"type": "lifespan.shutdown.complete"})
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        c = held["c"]
        headers = [(k, v) for k, v in scope["headers"] if k not in drop]
        try:
            resp = await c.send(
                c.build_request(scope["method"], upstream + scope["path"], content=body, headers=headers), stream=True
            )
        except httpx.HTTPError:  # as a proxy answers it (502), not a traceback
            await send({"type": "http.response.start", "status": 502, "headers": []})
            return await send({"type": "http.response.body", "body": b""})
        out = [(k, v) for k, v in resp.headers.raw if k.lower() not in (b"transfer-encoding", b"connection")]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
        async for chunk in resp.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        await resp.aclose()

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def serve_relay(upstream_port: int, port: int) -> None:
    """The other named baseline: a TCP relay (a connection to the upstream per client connection, bytes
    copied both ways): the cost of one more Python hop with no HTTP in it."""

    async def pipe(r, w):
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            w.close()

    async def client(cr, cw):
        ur, uw = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(pipe(cr, uw), pipe(ur, cw))

    async def main():
        server = await asyncio.start_server(client, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _start(args: list[str], url: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, __file__, *args])
    deadline = time.monotonic() + 180
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


HEADERS = {"content-type": "application/json"}


def latencies(routes: dict[str, str], n: int) -> dict[str, list[float]]:
    """n sequential requests per route, interleaved: request i goes to every route in turn."""
    lat: dict[str, list[float]] = {k: [] for k in routes}
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            for name, base in routes.items():
                t = time.perf_counter()
                r = c.post(f"{base}/v1/completions", content=_body(i), headers=HEADERS)
                lat[name].append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
    return lat


async def throughput(base: str, n: int, concurrency: int, delay_ms: float, first: int) -> tuple[float, list[str]]:
    """requests/s of n requests from `concurrency` clients, and why each one that did not get a 200 failed."""
    headers = {**HEADERS, DELAY: str(delay_ms)} if delay_ms else HEADERS
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=120) as c:
        sem = asyncio.Semaphore(concurrency)

        async def one(i):
            async with sem:
                try:
                    r = await c.post(f"{base}/v1/completions", content=_body(first + i), headers=headers)
                    return None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    return f"client: {type(e).__name__}: {e}"

        t = time.perf_counter()
        failed = await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t), [f for f in failed if f]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, int(len(xs) * q))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine-ms", type=float, default=200.0)
    ap.add_argument("--serve-upstream", type=int)
    ap.add_argument("--serve-proxy", nargs=4, metavar=("UPSTREAM", "PORT", "RATE", "OUT"))
    ap.add_argument("--serve-noop", nargs=2, metavar=("UPSTREAM", "PORT"))
    ap.add_argument("--serve-relay", nargs=2, type=int, metavar=("UPSTREAM_PORT", "PORT"))
    a = ap.parse_args()
    if a.serve_upstream:
        return serve_upstream(a.serve_upstream)
    if a.serve_proxy:
        up, port, rate, out = a.serve_proxy
        return serve_proxy(up, int(port), float(rate), out)
    if a.serve_noop:
        return serve_noop(a.serve_noop[0], int(a.serve_noop[1]))
    if a.serve_relay:
        return serve_relay(*a.serve_relay)
    import os

    from lpf.serve.process import free_port

    n, rounds = (200, 1) if a.quick else (a.requests, a.rounds)
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    procs: dict[str, subprocess.Popen] = {"direct": _start(["--serve-upstream", str(up_port)], f"{upstream}/ping")}
    routes = {"direct": upstream}
    load0 = os.getloadavg()
    try:
        port = free_port()
        procs["relay"] = _start(["--serve-relay", str(up_port), str(port)], f"http://127.0.0.1:{port}/ping")
        routes["relay"] = f"http://127.0.0.1:{port}"
        port = free_port()
        procs["noop proxy"] = _start(["--serve-noop", upstream, str(port)], f"http://127.0.0.1:{port}/ping")
        routes["noop proxy"] = f"http://127.0.0.1:{port}"
        for rate in (0.0, 0.01, 1.0):
            port, name = free_port(), f"proxy {rate:.0%}"
            out = Path(tempfile.mkdtemp()) / "run"
            procs[name] = _start(
                ["--serve-proxy", upstream, str(port), str(rate), str(out)], f"http://127.0.0.1:{port}/metrics"
            )
            routes[name] = f"http://127.0.0.1:{port}"
        latencies(routes, 30)  # warm-up: connections, imports on first use
        cpu0 = {k: cpu_seconds(p.pid) for k, p in procs.items()}
        t0 = time.time()
        lat = latencies(routes, n)
        rps: dict[str, list[float]] = {k: [] for k in routes}
        paced: dict[str, list[float]] = {k: [] for k in routes}
        failed: dict[str, list[str]] = {k: [] for k in routes}
        names = list(routes)
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # each round starts with another route
            for k in order:
                got, bad = asyncio.run(throughput(routes[k], n, a.concurrency, 0, n * (2 + r)))
                rps[k].append(got)
                failed[k] += bad
            for k in order:
                got, bad = asyncio.run(throughput(routes[k], n, a.concurrency, a.engine_ms, n * (2 + r)))
                paced[k].append(got)
                failed[k] += bad
        cpu = {k: cpu_seconds(p.pid) - cpu0[k] for k, p in procs.items()}
        wall = time.time() - t0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(30)
    per_route = n * (1 + 2 * rounds)
    results = {}
    for k in routes:
        own = cpu[k] / (per_route * (len(routes) if k == "direct" else 1))  # the upstream serves every route
        results[k] = {
            "p50_ms": pct(lat[k], 0.5),
            "p99_ms": pct(lat[k], 0.99),
            "rps": statistics.median(rps[k]),
            "rps_rounds": rps[k],
            "rps_engine_paced": statistics.median(paced[k]),
            "rps_engine_paced_rounds": paced[k],
            "cpu_ms_per_request": 1e3 * own,
            "failed_requests": len(failed[k]),
            "failures": failed[k][:10],
        }
    d = results["direct"]
    print(
        f"{n} requests per route per phase, {rounds} round(s), {a.concurrency} clients; engine-paced upstream "
        f"{a.engine_ms:.0f} ms/answer; load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}; {wall:.0f} s"
    )
    print(
        "| route | p50 ms | p99 ms | p50 overhead ms | throughput req/s | x direct | CPU ms/request | "
        "engine-paced req/s | x direct |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['p50_ms'] - d['p50_ms']:.2f} | "
            f"{r['rps']:.0f} | {r['rps'] / d['rps']:.2f}x | {r['cpu_ms_per_request']:.2f} | "
            f"{r['rps_engine_paced']:.0f} | {r['rps_engine_paced'] / d['rps_engine_paced']:.2f}x |"
            + (f" {r['failed_requests']} failed" if r["failed_requests"] else "")
        )
    if not a.quick:
        meta = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "requests": n,
            "rounds": rounds,
            "concurrency": a.concurrency,
            "engine_ms": a.engine_ms,
            "load_average": [load0[0], os.getloadavg()[0]],
        }
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        (ROOT / "bench" / "results" / "watch.json").write_text(
            json.dumps(stamp({"meta": meta, **results}), indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
