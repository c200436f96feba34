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
Why not httpx: its request, URL and pool layers cost ~2 ms of CPU per request on this project's 2-core machine,
more than the rest of the proxy together (bench/watch.py measures it against a no-op uvicorn+httpx proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from urllib.parse import urlsplit

READ = 65536
NO_BODY = {204, 304}


class UpstreamError(Exception):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class _Stale(Exception):
    """A reused connection the upstream had closed before answering: safe to send again."""


def _within(seconds: float | None):
    return asyncio.timeout(seconds) if seconds is not None else contextlib.nullcontext()


class Answer:
    def __init__(self, up: Upstream, reader, writer, status: int, raw_headers: list, framing, keep: bool, timeout):
        self._up, self._reader, self._writer = up, reader, writer
        self.status_code, self.raw_headers = status, raw_headers
        self._framing, self._keep, self._timeout = framing, keep, timeout
        self._complete = framing == 0
        self._headers: dict | None = None

    @property
    def headers(self) -> dict:
        if self._headers is None:
            self._headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.raw_headers}
        return self._headers

    async def aiter_raw(self):
        r, t = self._reader, self._timeout
        try:
            if self._framing == "chunked":
                while True:
                    async with _within(t):
                        line = await r.readline()
                    if not line.endswith(b"\n"):
                        raise UpstreamError("RemoteProtocolError: the upstream cut a chunked answer")
                    size = int(line.split(b";", 1)[0].strip() or b"x", 16)
                    if size == 0:
                        while True:  # trailers, then the blank line
                            async with _within(t):
                                line = await r.readline()
                            if line in (b"\r\n", b"\n"):
                                break
                            if not line:
                                raise UpstreamError("RemoteProtocolError: the upstream cut a chunked answer")
                        break
                    while size:
                        async with _within(t):
                            data = await r.read(min(size, READ))
                        if not data:
                            raise UpstreamError("RemoteProtocolError: the upstream cut a chunked answer")
                        size -= len(data)
                        yield data
                    async with _within(t):
                        await r.readexactly(2)
            elif isinstance(self._framing, int):
                left = self._framing
                while left:
                    async with _within(t):
                        data = await r.read(min(left, READ))
                    if not data:
                        raise UpstreamError("RemoteProtocolError: the upstream cut the answer short")
                    left -= len(data)
                    yield data
            else:  # delimited by the connection's close
                self._keep = False
                while True:
                    async with _within(t):
                        data = await r.read(READ)
                    if not data:
                        break
                    yield data
            self._complete = True
        except TimeoutError:
            raise UpstreamTimeout("ReadTimeout") from None
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, ssl.SSLError) as e:
            raise UpstreamError(f"ReadError: {type(e).__name__}: {e}") from None

    async def aread(self) -> bytes:
        return b"".join([c async for c in self.aiter_raw()])

    async def aclose(self) -> None:
        if self._writer is None:
            return
        w, self._writer = self._writer, None
        if self._complete and self._keep and len(self._up.idle) < self._up.max_idle:
            self._up.idle.append((self._reader, w))
        else:
            w.transport.abort() if not self._complete else w.close()


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
        lines = [f"{method} ".encode(), self.prefix, target.encode("latin-1"), b" HTTP/1.1\r\nhost: ", self.host_header]
        for k, v in headers:
            lines += (b"\r\n", k, b": ", v)
        if body or method in ("POST", "PUT", "PATCH"):
            lines += (b"\r\ncontent-length: ", str(len(body)).encode())
        lines.append(b"\r\n\r\n")
        data = b"".join(lines) + body
        while self.idle:
            reader, writer = self.idle.pop()
            if reader.at_eof() or writer.is_closing():
                writer.close()
                continue
            try:
                return await self._exchange(reader, writer, data, method, reused=True)
            except _Stale:
                continue
        return await self._exchange(*await self._connect(), data, method, reused=False)

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

    async def _exchange(self, reader, writer, data: bytes, method: str, reused: bool) -> Answer:
        t = self.timeout
        try:
            writer.write(data)
            async with _within(t):
                await writer.drain()
                while True:
                    line = await reader.readline()
                    if not line:
                        if reused:
                            raise _Stale()
                        raise UpstreamError("RemoteProtocolError: the upstream closed the connection without answering")
                    version, _, rest = line.partition(b" ")
                    status = int(rest[:3])
                    raw = []
                    while True:
                        h = await reader.readline()
                        if h in (b"\r\n", b"\n"):
                            break
                        if not h.endswith(b"\n"):
                            raise UpstreamError("RemoteProtocolError: the upstream cut its headers")
                        k, _, v = h.partition(b":")
                        raw.append((k.strip(), v.strip()))
                    if status >= 200 or status == 101:
                        break  # 1xx (100 Continue, 103 Early Hints) come before the answer
        except TimeoutError:
            writer.transport.abort()
            raise UpstreamTimeout("ReadTimeout") from None
        except (_Stale, UpstreamError):
            writer.transport.abort()
            raise
        except (ConnectionError, ValueError, IndexError, ssl.SSLError, asyncio.LimitOverrunError) as e:
            writer.transport.abort()
            if reused and isinstance(e, ConnectionError):
                raise _Stale() from None
            raise UpstreamError(f"RemoteProtocolError: {type(e).__name__}: {e}") from None
        except BaseException:  # cancelled: the client left; closing the connection is the upstream's abort
            writer.transport.abort()
            raise
        names = {k.lower(): v for k, v in raw}
        keep = version == b"HTTP/1.1" and names.get(b"connection", b"").lower() != b"close"
        if method == "HEAD" or status in NO_BODY or status < 200:
            framing = 0
        elif b"chunked" in names.get(b"transfer-encoding", b"").lower():
            framing = "chunked"
        elif names.get(b"content-length", b"").isdigit():
            framing = int(names[b"content-length"])
        else:
            framing = None
        return Answer(self, reader, writer, status, raw, framing, keep, t)
