"""A lean HTTP/1.1 client for the proxy's upstream: pooled keep-alive connections, answers streamed as they come.

Contract: `Upstream(base_url, timeout, connect_timeout, max_idle)`; `await up.send(method, target, headers, body)`
(target: the path and query the client asked for; headers: (name, value) bytes pairs, `host` and the body's
framing set here) returns an `Answer` once the status line and headers are read: `status_code`, `raw_headers`
((name, value) bytes pairs as the upstream sent them), `headers` (lower-case name -> value, for the few a
recording keeps). `async for chunk in answer.aiter_raw()` yields the body's bytes as they arrive (chunked
transfer decoded; content-length or close-delimited), `await answer.aread()` the whole body, and
`await answer.aclose()` puts a fully read keep-alive connection back in the pool and closes any other (an
answer left unfinished closes its connection: the upstream sees the client's abort).
Errors: `UpstreamTimeout` (no connection within `connect_timeout`, or `timeout` seconds without a byte) and
`UpstreamError` (refused, reset, a malformed or cut answer); both name what happened. Cancelling a send or a
read closes the connection. A kept-alive connection the upstream closed while idle (no byte of an answer on
it) is retried once on a fresh one, as HTTP clients do; a refused connect is tried once more (nothing was sent).
The HTTP/1.1 framing (request bytes, status line, headers, content-length / chunked / close-delimited bodies,
1xx, HEAD, keep-alive) is `h11`'s, one `h11.Connection` per pooled connection; this module moves bytes and
times them. Why not httpx: its request, URL and pool layers cost ~2 ms of CPU per request on this project's
2-core machine, more than the rest of the proxy together (bench/watch.py measures it against a no-op
uvicorn+httpx proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from urllib.parse import urlsplit

import h11

READ = 65536
HEAD_LIMIT = 1 << 20  # the most bytes of status line and headers a response may have


class UpstreamError(Exception):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class _Stale(Exception):
    """A reused connection the upstream had closed before answering: safe to send again."""


def _within(seconds: float | None):
    return asyncio.timeout(seconds) if seconds is not None else contextlib.nullcontext()


class Answer:
    def __init__(self, up: Upstream, conn: _Conn, status: int, raw_headers: list, timeout):
        self._up, self._conn = up, conn
        self.status_code, self.raw_headers = status, raw_headers
        self._timeout = timeout
        self._complete = False
        self._headers: dict | None = None

    @property
    def headers(self) -> dict:
        if self._headers is None:
            self._headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.raw_headers}
        return self._headers

    async def aiter_raw(self):
        c, t = self._conn, self._timeout
        try:
            while True:
                ev = c.h11.next_event()
                if ev is h11.NEED_DATA:
                    async with _within(t):
                        c.h11.receive_data(await c.reader.read(READ))  # b"": the upstream closed
                elif type(ev) is h11.Data:
                    yield bytes(ev.data)
                elif type(ev) is h11.EndOfMessage:
                    break
                else:  # ConnectionClosed before the body's end
                    raise h11.RemoteProtocolError("the upstream cut the answer short")
            self._complete = True
        except TimeoutError:
            raise UpstreamTimeout("ReadTimeout") from None
        except h11.RemoteProtocolError as e:
            raise UpstreamError(f"RemoteProtocolError: the upstream cut the answer short ({e})") from None
        except (ConnectionError, ssl.SSLError) as e:
            raise UpstreamError(f"ReadError: {type(e).__name__}: {e}") from None

    async def aread(self) -> bytes:
        return b"".join([c async for c in self.aiter_raw()])

    async def aclose(self) -> None:
        c, self._conn = self._conn, None
        if c is None:
            return
        h = c.h11
        if not self._complete and h.their_state is h11.SEND_BODY:
            # a body with no bytes (HEAD, 204, 304, content-length 0) ends without a read: let h11 say so
            with contextlib.suppress(h11.RemoteProtocolError):
                if type(h.next_event()) is h11.EndOfMessage:
                    self._complete = True
        reusable = self._complete and h.our_state is h11.DONE and h.their_state is h11.DONE
        if reusable and len(self._up.idle) < self._up.max_idle:
            h.start_next_cycle()
            self._up.idle.append(c)
        else:
            c.writer.transport.abort() if not self._complete else c.writer.close()


class _Conn:
    """One pooled connection: its streams and the h11 state machine that frames what crosses it."""

    __slots__ = ("reader", "writer", "h11")

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)


class Upstream:
    def __init__(self, base_url: str, timeout: float | None, connect_timeout: float = 10.0, max_idle: int = 256):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url}")
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.host_header = u.netloc.encode()
        self.prefix = u.path.rstrip("/").encode()
        self.timeout, self.connect_timeout, self.max_idle = timeout, connect_timeout, max_idle
        self.idle: list = []

    async def send(self, method: str, target: str, headers: list, body: bytes) -> Answer:
        head = [(b"host", self.host_header), *headers]
        if body or method in ("POST", "PUT", "PATCH"):
            head.append((b"content-length", str(len(body)).encode()))
        request = h11.Request(method=method, target=self.prefix + target.encode("latin-1"), headers=head)
        while self.idle:
            c = self.idle.pop()
            if c.reader.at_eof() or c.writer.is_closing():
                c.writer.close()
                continue
            try:
                return await self._exchange(c, request, body, reused=True)
            except _Stale:
                continue
        return await self._exchange(_Conn(*await self._connect()), request, body, reused=False)

    async def aclose(self) -> None:
        while self.idle:
            self.idle.pop()[1].close()

    async def _connect(self):
        for attempt in (0, 1):
            try:
                async with asyncio.timeout(self.connect_timeout):
                    return await asyncio.open_connection(
                        self.host,
                        self.port,
                        ssl=self.ssl,
                        limit=1 << 20,
                        server_hostname=self.host if self.ssl else None,
                    )
            except TimeoutError:
                raise UpstreamTimeout("ConnectTimeout") from None
            except OSError as e:
                # nothing was sent: one more try after a moment (bench/watch.py saw loopback connects to a busy
                # upstream fail in a burst, for httpx too), then the client's 502
                if attempt:
                    raise UpstreamError(f"ConnectError: {e}") from None
                await asyncio.sleep(0.02)

    async def _exchange(self, c: _Conn, request: h11.Request, body: bytes, reused: bool) -> Answer:
        t, h = self.timeout, c.h11
        try:
            data = h.send(request) + (h.send(h11.Data(data=body)) if body else b"") + h.send(h11.EndOfMessage())
        except h11.LocalProtocolError as e:  # a header h11 will not put on the wire (a CR or LF in it...)
            c.writer.transport.abort()
            raise UpstreamError(f"LocalProtocolError: {e}") from None
        heard = False  # any byte of an answer: then a close is a cut, not a stale connection
        try:
            c.writer.write(data)
            async with _within(t):
                await c.writer.drain()
                while True:
                    ev = h.next_event()
                    if ev is h11.NEED_DATA:
                        chunk = await c.reader.read(READ)
                        if not chunk and not heard:
                            if reused:
                                raise _Stale()
                            raise UpstreamError(
                                "RemoteProtocolError: the upstream closed the connection without answering"
                            )
                        heard = True
                        h.receive_data(chunk)
                    elif type(ev) is h11.Response:
                        break
                    elif type(ev) is h11.ConnectionClosed:
                        raise UpstreamError("RemoteProtocolError: the upstream cut its headers")
                    # else 1xx (100 Continue, 103 Early Hints): they come before the answer
        except TimeoutError:
            c.writer.transport.abort()
            raise UpstreamTimeout("ReadTimeout") from None
        except (_Stale, UpstreamError):
            c.writer.transport.abort()
            raise
        except (ConnectionError, ssl.SSLError, h11.RemoteProtocolError) as e:
            c.writer.transport.abort()
            if reused and not heard and isinstance(e, ConnectionError):
                raise _Stale() from None
            raise UpstreamError(f"RemoteProtocolError: {type(e).__name__}: {e}") from None
        except BaseException:  # cancelled: the client left; closing the connection is the upstream's abort
            c.writer.transport.abort()
            raise
        return Answer(self, c, ev.status_code, list(ev.headers.raw_items()), t)
