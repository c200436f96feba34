"""The reverse proxy: a raw ASGI app that forwards every request to the upstream and samples some for lpf.

Contract: `create_proxy(upstream, sampler, recorder, metrics, top_k, timeout, extra_routes)` returns a `Proxy`, an ASGI
app (its `state.proxy` holds the counters the live page reads). Every path and method is forwarded
(`/v1/completions`, `/v1/chat/completions`, `/v1/models`, and whatever else the upstream serves), except
`/metrics` and the `extra_routes` lpf answers itself (path -> async handler: the live page at /lpf/), which
a small FastAPI app beside the relay serves.
- Unsampled requests go through unchanged: the body as sent, the answer's bytes as the upstream sends
  them, chunk by chunk (never buffered whole), with its status and headers (hop-by-hop ones aside). They
  cost what a relay costs and no more: the sampling hash of the body's bytes (`Sampler.take`) is decided
  first, and only a body it picks is parsed (`wire.sampleable`: a one-choice completion with a well-formed
  JSON body; any other goes through unsampled).
- A sampled request is sent as `wire.augment` makes it; the answer goes back with what lpf added taken
  out (`wire.strip`): a whole answer re-serialized, a stream event by event as each arrives (an event
  that exists only because lpf asked for more, `wire.extra_chunk`, is not relayed). An augmented request
  the upstream refuses (4xx) is sent again as the client sent it, and the client gets that answer; the
  fields the refusal names are not added again (all of them when it names none and the plain request
  succeeded).
- Upstream failures: a refused connection is 502, a time-out 504 (JSON {"error": ...}: a proxy cannot
  refuse a connection it has accepted); an upstream that cuts an answer short cuts the client's the same
  way (the connection closed mid-body). A client that disconnects cancels its upstream request (the
  upstream connection is closed, which `lpf serve` and vLLM take as an abort).
- lpf's work is off the request path: a sample goes to the recorder's bounded queue (`Recorder.offer`,
  never blocking) once the client has its answer; a full queue drops the sample and counts it.
Why raw ASGI and not a framework route: a catch-all FastAPI route with a StreamingResponse cost the
proxy ~2 ms of CPU per request on this project's machine (routing, dependency solving, a task group per
answer); one watcher task per request (the client's disconnect) is all a relay needs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import suppress
from types import SimpleNamespace

from lpf.watch import wire
from lpf.watch.evidence import REPLICA_HEADERS, Sample
from lpf.watch.upstream import Answer, Upstream, UpstreamError, UpstreamTimeout

log = logging.getLogger("lpf.watch")
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailers",
    b"transfer-encoding",
    b"upgrade",
    b"host",
    b"content-length",
    b"accept-encoding",
    b"expect",
}
EVIDENCE_BYTES = 2000  # of a malformed answer, kept as returned
SAMPLED_ROUTES = (wire.COMPLETIONS, wire.CHAT)


class _Cut(Exception):
    """The upstream cut a stream already being relayed: the client's is cut there too."""


def _dumps(obj) -> bytes:  # FastAPI's own JSON rendering (compact, UTF-8)
    return json.dumps(obj, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode()


def _error(status: int, message: str) -> tuple[int, list, bytes]:
    body = _dumps({"error": {"message": message, "type": "UpstreamError", "param": None, "code": status}})
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


class _State:
    def __init__(self):
        self.in_flight = 0
        self.seq = 0
        self.refused: set[str] = set()


class _Watch:
    """The client's side of one request: a task that waits for its disconnect and then cancels the handler.
    `done()` before the last send (uvicorn answers a completed cycle's receive with a disconnect too)."""

    __slots__ = ("gone", "_task")

    def __init__(self, receive):
        self.gone = False
        handler = asyncio.current_task()

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone = True
            handler.cancel()

        self._task = asyncio.ensure_future(watch())

    def done(self) -> None:
        self._task.cancel()


def create_proxy(
    upstream: str, sampler, recorder, metrics, top_k: int = 5, timeout: float | None = None, extra_routes=None
) -> Proxy:
    return Proxy(upstream, sampler, recorder, metrics, top_k, timeout, extra_routes)


class Proxy:
    """The ASGI app: `self.state.proxy` the counters the live page reads; the upstream client lives from the
    lifespan's startup to its shutdown."""

    def __init__(
        self, upstream: str, sampler, recorder, metrics, top_k: int = 5, timeout: float | None = None, extra_routes=None
    ):
        base = upstream.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.sampler, self.recorder, self.metrics, self.top_k, self.timeout = sampler, recorder, metrics, top_k, timeout
        self.live = _State()
        self.state = SimpleNamespace(proxy=self.live)
        self.client: Upstream | None = None
        # (route label, sampled) -> the labelled counter (a labels() lookup per request is not free)
        self.counters: dict = {}
        self.side = self._side_app(extra_routes or {})
        self.side_paths = {"/metrics", *(extra_routes or {})}

    def _side_app(self, extra_routes: dict):
        """/metrics and the routes lpf answers itself: a small FastAPI app beside the relay."""
        from fastapi import FastAPI
        from fastapi.responses import Response

        side = FastAPI(title="lpf watch", docs_url=None, redoc_url=None, openapi_url=None)
        metrics, recorder, live = self.metrics, self.recorder, self.live

        @side.get("/metrics")
        async def _metrics():
            metrics.in_flight.set(live.in_flight)
            metrics.queue_depth.set(recorder.depth())
            metrics.recorded.set(recorder.recorded)
            metrics.unrecordable.set(recorder.failed)
            metrics.pruned.set(getattr(recorder, "pruned_parts", 0))
            data, kind = metrics.render()
            return Response(data, media_type=kind)

        for path, handler in extra_routes.items():
            side.get(path)(handler)
        return side

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http" or scope["path"] in self.side_paths:
            return await self.side(scope, receive, send)
        await self._handle(scope, receive, send)

    async def _lifespan(self, receive, send):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.client = Upstream(self.base, self.timeout, connect_timeout=min(self.timeout or 10.0, 10.0))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _handle(self, scope, receive, send):
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":  # gone before its body arrived: nothing was sent upstream
                self.metrics.client_gone.inc()
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        route = scope["path"]
        arrival, in_flight = time.time(), self.live.in_flight
        self.live.in_flight += 1
        watch = _Watch(receive)
        sample = None
        try:
            parsed = None
            if scope["method"] == "POST" and route in SAMPLED_ROUTES and self.sampler.take(body):
                with suppress(ValueError):
                    parsed = json.loads(body)
            sampled = parsed is not None and wire.sampleable(route, parsed)
            self._count(route, sampled)
            if not sampled:
                resp = await self._send(scope, route, body)
                await self._passthrough(resp, send, watch)
                return
            self.live.seq += 1
            sample = Sample(
                seq=self.live.seq - 1,
                route=route,
                body=parsed,
                added=wire.Added(),
                stream=bool(parsed.get("stream")),
                t_arrival=arrival,
                in_flight=in_flight,
                collected=wire.Collected(route),
            )
            await self._sampled(scope, send, watch, route, body, parsed, sample)
        except _Cut:
            return  # uvicorn closes a connection whose answer was left unfinished
        except asyncio.CancelledError:
            if not watch.gone:
                raise  # the server is stopping
            asyncio.current_task().uncancel()
            self.metrics.client_gone.inc()
            # a client that closes once it has read [DONE] (the openai client does, before the upstream ends
            # its chunked body) left with its whole answer: nothing of the evidence was cut
            if sample is not None and sample.error is None and not sample.stream_done:
                sample.error = "the client disconnected"
        except UpstreamTimeout as e:
            self.metrics.upstream_errors.inc()
            self._note_error(sample, e)
            await self._answer(send, watch, *_error(504, f"lpf watch: the upstream did not answer in time ({e})"))
        except UpstreamError as e:
            self.metrics.upstream_errors.inc()
            self._note_error(sample, e)
            await self._answer(send, watch, *_error(502, f"lpf watch: the upstream could not be reached ({e})"))
        finally:
            watch.done()
            self.live.in_flight -= 1
            if sample is not None:
                self._finish(sample)

    def _count(self, route: str, sampled: bool) -> None:
        key = (route if route.startswith("/v1/") else "other", sampled)
        c = self.counters.get(key)
        if c is None:
            c = self.counters[key] = self.metrics.proxied.labels(route=key[0], sampled=str(sampled))
        c.inc()

    def _note_error(self, sample, e) -> None:
        if sample is not None and sample.error is None:
            sample.error = f"upstream: {type(e).__name__}"

    async def _send(self, scope, route: str, body: bytes) -> Answer:
        """The upstream's response (headers read, body not); the client leaving first cancels it (and the
        handler), which closes the upstream connection: the upstream aborts the request."""
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP]
        headers.append((b"accept-encoding", b"identity"))  # bytes as the client would decode them
        raw = scope.get("raw_path")  # the path as the client sent it (%-escapes and all)
        target = raw.decode("latin-1") if raw else route
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        return await self.client.send(scope["method"], target, headers, body)

    def _headers(self, resp: Answer, keep_length: bool) -> list:
        return [
            (k, v)
            for k, v in resp.raw_headers
            if k.lower() not in HOP_BY_HOP or (keep_length and k.lower() == b"content-length")
        ]

    async def _answer(self, send, watch: _Watch, status: int, headers: list, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        watch.done()
        await send({"type": "http.response.body", "body": body})

    async def _passthrough(self, resp: Answer, send, watch: _Watch) -> None:
        self.metrics.answered(resp.status_code)
        try:
            await send(
                {"type": "http.response.start", "status": resp.status_code, "headers": self._headers(resp, True)}
            )
            try:
                async for chunk in resp.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError:
                self.metrics.upstream_errors.inc()
                return  # the client's answer is cut where the upstream's was (uvicorn closes it unfinished)
            watch.done()
            await send({"type": "http.response.body", "body": b""})
        finally:
            await asyncio.shield(resp.aclose())

    async def _sampled(self, scope, send, watch: _Watch, route: str, raw: bytes, parsed: dict, sample: Sample):
        sent, added = wire.augment(route, parsed, self.top_k, frozenset(self.live.refused))
        sample.added = added
        augmented = added != wire.Added()
        resp = await self._send(scope, route, _dumps(sent) if augmented else raw)
        self._note_headers(sample, resp)
        if augmented and 400 <= resp.status_code < 500 and resp.status_code != 404:
            try:
                refusal = (await resp.aread()).decode(errors="replace")
            finally:
                await asyncio.shield(resp.aclose())
            resp = await self._send(scope, route, raw)  # as the client sent it: its answer is the direct one
            self._note_headers(sample, resp)
            if resp.status_code < 400:
                named = {f for f in ("logprobs", wire.ID_FIELD) if f in refusal}
                self.live.refused |= named or {"logprobs", wire.ID_FIELD}
                log.warning(
                    "lpf watch: the upstream refused %s; not asked again", ", ".join(sorted(named)) or refusal[:200]
                )
            sample.added = added = wire.Added()
        sample.status = resp.status_code
        self.metrics.answered(resp.status_code)
        if sample.stream and resp.status_code == 200:
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self._headers(resp, False)})
                await self._stream(resp, send, sample, added)
                watch.done()
                await send({"type": "http.response.body", "body": b""})
            finally:
                await asyncio.shield(resp.aclose())
            return
        try:
            data = await resp.aread()
        finally:
            await asyncio.shield(resp.aclose())
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
        headers = self._headers(resp, False) + [(b"content-length", str(len(out)).encode())]
        await self._answer(send, watch, resp.status_code, headers, out)

    async def _stream(self, resp: Answer, send, sample: Sample, added: wire.Added):
        buf = b""
        try:
            async for chunk in resp.aiter_raw():
                if sample.t_first is None:
                    sample.t_first = time.time()
                buf += chunk
                while (i := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[: i + 2], buf[i + 2 :]
                    out = self._event(event, sample, added)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
            if buf:
                await send({"type": "http.response.body", "body": buf, "more_body": True})
            if sample.collected.finish_reason is None and sample.error is None:
                sample.error = "the stream ended without a finish_reason"
        except UpstreamError as e:
            self.metrics.upstream_errors.inc()
            sample.error = f"the upstream cut the stream ({e})"
            raise _Cut() from e

    def _event(self, event: bytes, sample: Sample, added: wire.Added) -> bytes:
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                sample.stream_done = True
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

    def _note_headers(self, sample: Sample, resp: Answer) -> None:
        sample.headers = {k: resp.headers[k] for k in REPLICA_HEADERS if k in resp.headers}

    def _finish(self, sample: Sample) -> None:
        sample.t_end = sample.t_end or time.time()
        if sample.t_end < (sample.t_first or 0):
            sample.t_end = sample.t_first
        if not self.recorder.offer(sample):
            self.metrics.dropped.inc()
