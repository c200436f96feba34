"""The reverse proxy: an ASGI app that forwards every request to the upstream and samples some for lpf.

Contract: `create_proxy(upstream, sampler, recorder, metrics, top_k, timeout, extra_routes)` returns a
FastAPI app. Every path and method is forwarded (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
and whatever else the upstream serves), except `/metrics` and the `extra_routes` lpf answers itself
(path -> async handler: the live page at /lpf/).
- Unsampled requests (and every request that is not a one-choice completion with a well-formed JSON
  body, `wire.sampleable`) go through unchanged: the body as sent, the answer's bytes as the upstream
  sends them, chunk by chunk (never buffered whole), with its status and headers (hop-by-hop ones aside).
- A sampled request (`Sampler.take` of the body's bytes) is sent as `wire.augment` makes it; the answer
  goes back with what lpf added taken out (`wire.strip`): a whole answer re-serialized, a stream event by
  event as each arrives (an event that exists only because lpf asked for more, `wire.extra_chunk`, is
  not relayed). An augmented request the upstream refuses (4xx) is sent again as the client sent
  it, and the client gets that answer; the fields the refusal names are not added again (all of them when
  it names none and the plain request succeeded).
- Upstream failures: a refused connection is 502, a time-out 504 (JSON {"error": ...}: a proxy cannot
  refuse a connection it has accepted); an upstream that cuts an answer short cuts the client's the same
  way (the connection closed mid-body). A client that disconnects cancels its upstream request (the
  upstream connection is closed, which `lpf serve` and vLLM take as an abort).
- lpf's work is off the request path: a sample goes to the recorder's bounded queue (`Recorder.offer`,
  never blocking) once the client has its answer; a full queue drops the sample and counts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager, suppress

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from lpf.watch import wire
from lpf.watch.evidence import REPLICA_HEADERS, Sample

log = logging.getLogger("lpf.watch")
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "accept-encoding",
}
EVIDENCE_BYTES = 2000  # of a malformed answer, kept as returned


class ClientGone(Exception):
    pass


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "UpstreamError", "param": None, "code": status}}, status)


def _dumps(obj) -> bytes:  # FastAPI's own JSON rendering (compact, UTF-8)
    return json.dumps(obj, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode()


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


class _Relay(StreamingResponse):
    """A streamed answer whose `done()` runs once however the relay ends: finished, cut, or cancelled by a
    client that left before the body began (Starlette then never starts the body's generator, whose own
    `finally` would not run: the upstream response would stay open and the request counted in flight)."""

    def __init__(self, content, done, **kw):
        super().__init__(content, **kw)
        self._done = done

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._done())


class _State:
    def __init__(self):
        self.in_flight = 0
        self.seq = 0
        self.refused: set[str] = set()


def create_proxy(
    upstream: str, sampler, recorder, metrics, top_k: int = 5, timeout: float | None = None, extra_routes=None
):
    base = upstream.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    state = _State()
    holder: dict = {}

    @asynccontextmanager
    async def lifespan(_app):
        holder["client"] = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=min(timeout or 10.0, 10.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        try:
            yield
        finally:
            await holder["client"].aclose()

    app = FastAPI(title="lpf watch", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def _metrics():
        metrics.in_flight.set(state.in_flight)
        metrics.queue_depth.set(recorder.depth())
        metrics.recorded.set(recorder.recorded)
        metrics.unrecordable.set(recorder.failed)
        data, kind = metrics.render()
        return Response(data, media_type=kind)

    for path, handler in (extra_routes or {}).items():
        app.get(path)(handler)

    app.state.proxy = state

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def _proxy(path: str, request: Request):
        try:
            body = await request.body()
        except ClientDisconnect:  # gone before its body arrived: nothing was sent upstream
            metrics.client_gone.inc()
            return Response(status_code=499)
        route = "/" + path
        arrival, in_flight = time.time(), state.in_flight
        state.in_flight += 1
        try:
            parsed = None
            if request.method == "POST" and route in (wire.COMPLETIONS, wire.CHAT):
                with suppress(ValueError):
                    parsed = json.loads(body)
            sampled = wire.sampleable(route, parsed) and sampler.take(body)
            metrics.proxied.labels(route=route if route.startswith("/v1/") else "other", sampled=str(sampled)).inc()
            if not sampled:
                resp = await _send(request, route, body)
                return _passthrough(resp, state)
            state.seq += 1
            sample = Sample(
                seq=state.seq - 1,
                route=route,
                body=parsed,
                added=wire.Added(),
                stream=bool(parsed.get("stream")),
                t_arrival=arrival,
                in_flight=in_flight,
                collected=wire.Collected(route),
            )
            try:
                return await _sampled(request, route, body, parsed, sample)
            except (ClientGone, httpx.HTTPError) as e:  # kept as evidence: an abort, an unreachable upstream
                sample.error = (
                    "the client disconnected" if isinstance(e, ClientGone) else f"upstream: {type(e).__name__}"
                )
                _finish(sample, release=False)
                raise
        except ClientGone:
            metrics.client_gone.inc()
            state.in_flight -= 1
            return Response(status_code=499)
        except httpx.TimeoutException as e:
            metrics.upstream_errors.inc()
            state.in_flight -= 1
            return _error(504, f"lpf watch: the upstream did not answer in time ({type(e).__name__})")
        except httpx.HTTPError as e:
            metrics.upstream_errors.inc()
            state.in_flight -= 1
            return _error(502, f"lpf watch: the upstream could not be reached ({type(e).__name__}: {e})")

    async def _send(request: Request, route: str, body: bytes) -> httpx.Response:
        """The upstream's response (headers read, body not), or ClientGone if the client leaves first."""
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        headers.append(("accept-encoding", "identity"))  # bytes as the client would decode them
        req = holder["client"].build_request(
            request.method, base + route, params=request.query_params, content=body, headers=headers
        )
        send = asyncio.ensure_future(holder["client"].send(req, stream=True))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({send, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if send.done():
            return send.result()
        send.cancel()  # closes the upstream connection: the upstream aborts the request
        with suppress(asyncio.CancelledError, httpx.HTTPError):
            await send
        raise ClientGone()

    def _headers(resp: httpx.Response, keep_length: bool) -> dict:
        return {
            k: v
            for k, v in resp.headers.items()
            if k.lower() not in HOP_BY_HOP or (keep_length and k.lower() == "content-length")
        }

    def _passthrough(resp: httpx.Response, state: _State) -> StreamingResponse:
        async def body():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError:
                metrics.upstream_errors.inc()
                raise  # the client's answer is cut where the upstream's was

        async def done():
            await resp.aclose()
            state.in_flight -= 1

        return _Relay(body(), done, status_code=resp.status_code, headers=_headers(resp, True))

    async def _sampled(request: Request, route: str, raw: bytes, parsed: dict, sample: Sample):
        sent, added = wire.augment(route, parsed, top_k, frozenset(state.refused))
        sample.added = added
        augmented = added != wire.Added()
        resp = await _send(request, route, _dumps(sent) if augmented else raw)
        _note_headers(sample, resp)
        if augmented and 400 <= resp.status_code < 500 and resp.status_code != 404:
            refusal = (await resp.aread()).decode(errors="replace")
            await resp.aclose()
            resp = await _send(request, route, raw)  # as the client sent it: its answer is the direct one
            _note_headers(sample, resp)
            if resp.status_code < 400:
                named = {f for f in ("logprobs", wire.ID_FIELD) if f in refusal}
                state.refused |= named or {"logprobs", wire.ID_FIELD}
                log.warning(
                    "lpf watch: the upstream refused %s; not asked again", ", ".join(sorted(named)) or refusal[:200]
                )
            sample.added = added = wire.Added()
        sample.status = resp.status_code
        if sample.stream and resp.status_code == 200:

            async def done():
                await resp.aclose()
                if sample.error is None and sample.collected.finish_reason is None:
                    sample.error = "the client disconnected"  # before or while the stream was relayed
                _finish(sample)

            return _Relay(_stream(resp, sample, added), done, status_code=200, headers=_headers(resp, False))
        try:
            data = await resp.aread()
        finally:
            await resp.aclose()
        sample.t_first = sample.t_end = time.time()
        out = data
        if resp.status_code != 200:
            sample.error = f"HTTP {resp.status_code}"
            sample.raw_evidence = data[:EVIDENCE_BYTES].decode(errors="replace")
        else:
            try:
                answer = json.loads(data)
                sample.collected.add_answer(answer)
                if added != wire.Added():
                    out = _dumps(wire.strip(answer, added))
            except ValueError as e:
                sample.error = f"malformed answer ({e})"
                sample.raw_evidence = data[:EVIDENCE_BYTES].decode(errors="replace")
        _finish(sample)
        return Response(out, status_code=resp.status_code, headers=_headers(resp, out is data))

    async def _stream(resp: httpx.Response, sample: Sample, added: wire.Added):
        buf = b""
        try:
            async for chunk in resp.aiter_raw():
                if sample.t_first is None:
                    sample.t_first = time.time()
                buf += chunk
                while (i := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[: i + 2], buf[i + 2 :]
                    yield _event(event, sample, added)
            if buf:
                yield buf
            if sample.collected.finish_reason is None and sample.error is None:
                sample.error = "the stream ended without a finish_reason"
        except httpx.HTTPError as e:
            metrics.upstream_errors.inc()
            sample.error = f"the upstream cut the stream ({type(e).__name__})"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            metrics.client_gone.inc()
            sample.error = "the client disconnected"
            raise

    def _event(event: bytes, sample: Sample, added: wire.Added) -> bytes:
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                chunk = json.loads(payload)
            except ValueError as e:
                sample.error = sample.error or f"malformed stream event ({e})"
                sample.raw_evidence = sample.raw_evidence or payload[:EVIDENCE_BYTES].decode(errors="replace")
                continue
            sample.collected.add_chunk(chunk)
            if added != wire.Added():
                stripped = wire.strip(chunk, added)
                if wire.extra_chunk(sample.route, stripped, sample.body):
                    return b""  # a direct call gets no such event
                lines[i] = b"data: " + _dumps(stripped)
        return b"\n".join(lines)

    def _note_headers(sample: Sample, resp: httpx.Response) -> None:
        sample.headers = {k: resp.headers[k] for k in REPLICA_HEADERS if k in resp.headers}

    def _finish(sample: Sample, release: bool = True) -> None:
        if release:
            state.in_flight -= 1
        sample.t_end = sample.t_end or time.time()
        if sample.t_end < (sample.t_first or 0):
            sample.t_end = sample.t_first
        if not recorder.offer(sample):
            metrics.dropped.inc()

    return app
