"""A real HTTP server on 127.0.0.1 whose answers are scripted per request, for the adapter tests.

`ScriptedServer(script)` listens on a free loopback port (stdlib ThreadingHTTPServer, one thread per
connection, HTTP/1.0 so a stopped server refuses new connections at once). For every POST it calls
`script(server, path, body, attempt)` where `attempt` counts the posts of that body (1 = first; SGLang's
per-attempt `rid` aside);
the script returns a `Reply` (status, JSON or raw bytes, headers, optional delay, or `drop` to close
the connection without an answer; `truncate` sends a Content-Length larger than the body). Every post is
logged (`server.posts`: path, body, time, headers), so tests count retries on the server's side.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclass
class Reply:
    status: int = 200
    json: Any = None
    raw: bytes | None = None
    headers: dict = field(default_factory=dict)
    delay: float = 0.0
    drop: bool = False  # close the connection without answering
    truncate: bool = False  # announce more bytes than are sent, then close


@dataclass
class Post:
    path: str
    body: Any
    t: float
    headers: dict


class ScriptedServer:
    def __init__(self, script: Callable[["ScriptedServer", str, Any, int], Reply]):
        self.script = script
        self.posts: list[Post] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):  # quiet test output
                pass

            def do_GET(self):
                self._send(
                    Reply(json={"object": "list", "data": []})
                    if self.path.endswith("/models")
                    else Reply(status=200, raw=b"")
                )

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                key = _key(body)
                with outer.lock:
                    outer.posts.append(Post(self.path, body, time.monotonic(), dict(self.headers)))
                    attempt = sum(1 for p in outer.posts if _key(p.body) == key)
                reply = outer.script(outer, self.path, body, attempt)
                if reply.delay:
                    outer.stopping.wait(reply.delay)
                self._send(reply)

            def _send(self, reply: Reply):
                try:
                    if reply.drop:
                        self.close_connection = True
                        self.connection.close()
                        return
                    data = reply.raw if reply.raw is not None else json.dumps(reply.json).encode()
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data) + (100 if reply.truncate else 0)))
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                    if reply.truncate:
                        self.connection.close()
                except OSError:
                    pass  # the client gave up first (timeouts are part of the script)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # the default backlog (5) drops SYNs under 16 concurrent clients

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.alive = True

    def __enter__(self) -> "ScriptedServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop listening: later connections are refused (the 'server died' case)."""
        if self.alive:
            self.alive = False
            self.stopping.set()
            self.httpd.shutdown()
            self.httpd.server_close()

    def stop_soon(self) -> None:
        threading.Thread(target=self.stop, daemon=True).start()

    def attempts(self, pred: Callable[[Post], bool]) -> list[Post]:
        with self.lock:
            return [p for p in self.posts if pred(p)]


def _key(body) -> str:
    """Attempts of one request share a key: the body less SGLang's per-attempt `rid`."""
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k != "rid"}
    return json.dumps(body, sort_keys=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
