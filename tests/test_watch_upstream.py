"""`lpf.watch.upstream`, the proxy's HTTP/1.1 client, against a real asyncio server on 127.0.0.1 that answers each
path with scripted bytes: every framing (content-length, chunked with extensions and trailers, close-delimited,
HEAD, 1xx first), keep-alive reuse, a kept-alive connection the server closed while idle (sent again on a fresh
one), bodies cut short, a server that never answers (a time-out) and one that is not there. About a second.
And the proxy's ASGI app over it: a client that leaves once it has read [DONE] left with its whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace

import pytest

from lpf.watch.upstream import Upstream, UpstreamError, UpstreamTimeout

ANSWERS = {
    b"/length": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-request-id: r1\r\n\r\nhello",
    b"/chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5;ext=1\r\ndata:\r\n6\r\n one\n\n\r\n0\r\ntrailer: x\r\n\r\n",
    b"/close": b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end",
    b"/continue": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
    b"/cut-chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\nonly half",
    b"/cut-length": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort",
    b"/then-close": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",  # keep-alive said, then closed when idle
    b"/drop-next": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",  # the next request on it: closed unanswered
}


async def _server():
    state = {"connections": 0, "requests": []}

    async def handle(r, w):
        state["connections"] += 1
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                method, path, _ = head.split(b"\r\n", 1)[0].split(b" ")
                length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
                body = await r.readexactly(length[0]) if length else b""
                state["requests"].append((method, path, body, head))
                if state.pop("drop", None) is w:
                    break
                if path == b"/drop-next":
                    state["drop"] = w
                if path == b"/never":
                    await asyncio.sleep(30)
                if method == b"HEAD":
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
                else:
                    w.write(ANSWERS[path])
                await w.drain()
                if path in (b"/close", b"/cut-chunked", b"/cut-length", b"/then-close"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], state


def test_framings_keep_alive_stale_connections_cuts_and_time_outs():
    async def main():
        server, port, state = await _server()
        up = Upstream(f"http://127.0.0.1:{port}", timeout=1.0)

        async def get(path, method="GET", body=b""):
            a = await up.send(method, path, [(b"x-client", b"1")], body)
            try:
                return a.status_code, a.headers, await a.aread()
            finally:
                await a.aclose()

        status, headers, body = await get("/length", "POST", b'{"a": 1}')
        assert (status, body, headers["x-request-id"]) == (200, b"hello", "r1")
        method, path, sent, head = state["requests"][-1]
        assert (method, sent) == (b"POST", b'{"a": 1}') and b"x-client: 1" in head and b"content-length: 8" in head
        assert (await get("/chunked"))[2] == b"data: one\n\n"
        assert (await get("/length", "HEAD"))[2] == b""
        assert (await get("/continue"))[:3:2] == (201, b"ok")
        assert state["connections"] == 1  # one kept-alive connection so far
        assert (await get("/close"))[2] == b"until the end"
        assert (await get("/then-close"))[2] == b"ok"
        await asyncio.sleep(0.05)  # the server closed it while it sat in the pool
        assert (await get("/length"))[2] == b"hello"  # on a fresh connection
        assert (await get("/drop-next"))[2] == b"ok"
        n = state["connections"]
        assert (await get("/length"))[2] == b"hello"  # sent on the kept connection, closed unanswered, sent again
        assert state["connections"] == n + 1 and [r[1] for r in state["requests"][-2:]] == [b"/length"] * 2
        for path in ("/cut-chunked", "/cut-length"):
            with pytest.raises(UpstreamError, match="cut"):
                await get(path)
        with pytest.raises(UpstreamTimeout):
            await get("/never")
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="ConnectError"):
            await Upstream(f"http://127.0.0.1:{port}", timeout=1.0).send("GET", "/length", [], b"")
        await up.aclose()

    asyncio.run(main())


def test_a_cancelled_request_closes_its_connection():
    async def main():
        server, port, state = await _server()
        up = Upstream(f"http://127.0.0.1:{port}", timeout=None)
        task = asyncio.ensure_future(up.send("GET", "/never", [], b""))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert up.idle == []  # not put back: the server sees the connection closed (an abort)
        server.close()

    asyncio.run(main())


def _held_stream_upstream(events: list[bytes]):
    """An upstream that sends `events` as one chunked SSE answer, one at a time, and then holds the body open (no
    last chunk)."""

    async def handle(r, w):
        head = await r.readuntil(b"\r\n\r\n")
        length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
        await r.readexactly(length[0])
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for e in events:
            w.write(b"%x\r\n%s\r\n" % (len(e), e))
            await w.drain()
            await asyncio.sleep(0.2)  # one event at a time, as an engine sends them
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await r.read()  # until the proxy closes its side
        w.close()

    return asyncio.start_server(handle, "127.0.0.1", 0)


async def _relay_until_client_leaves(leave_after: bytes):
    """One sampled streamed completion through the proxy's ASGI app; the client disconnects once a body it was
    sent contains `leave_after`. Returns the sample the recorder was offered."""
    from lpf.watch.metrics import WatchMetrics
    from lpf.watch.proxy import create_proxy
    from lpf.watch.sample import Sampler

    event = {"id": "c1", "choices": [{"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": "length"}]}
    upstream = await _held_stream_upstream([b"data: " + json.dumps(event).encode() + b"\n\n", b"data: [DONE]\n\n"])
    offered = []
    app = create_proxy(
        f"http://127.0.0.1:{upstream.sockets[0].getsockname()[1]}",
        Sampler(1.0),
        SimpleNamespace(offer=lambda s: offered.append(s) or True),
        WatchMetrics(),
    )
    life = asyncio.Queue()
    await life.put({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(app({"type": "lifespan"}, life.get, lambda m: asyncio.sleep(0)))
    left = asyncio.Event()
    bodies = [{"type": "http.request", "body": json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()}]

    async def receive():
        if bodies:
            return bodies.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if leave_after in message.get("body", b""):
            left.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    await asyncio.wait_for(app(scope, receive, send), 10)
    await life.put({"type": "lifespan.shutdown"})
    await lifespan
    upstream.close()
    return offered


def test_a_client_that_leaves_after_done_has_its_whole_answer_and_one_that_leaves_before_does_not():
    # the openai client closes its connection on [DONE], before the upstream has ended the chunked body
    whole = asyncio.run(_relay_until_client_leaves(b"[DONE]"))
    assert len(whole) == 1 and whole[0].error is None and whole[0].stream_done
    assert whole[0].collected.finish_reason == "length" and whole[0].collected.token_ids == [5, 6]
    cut = asyncio.run(_relay_until_client_leaves(b'"ab"'))  # gone before [DONE] was relayed
    assert len(cut) == 1 and cut[0].error == "the client disconnected"
