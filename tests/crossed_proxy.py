"""A real HTTP proxy on 127.0.0.1 in front of an OpenAI-compatible server (`lpf serve`) that lies, for tests.

`LyingProxy(upstream, ...)` forwards every POST to `upstream` (the real server's answer, headers such as
X-Request-Id passed on) and then, by rule, changes what the client gets:
- `swap_every=K`: crossed wires. Requests are numbered by arrival at the proxy; arrivals 2j and 2j+1
  form a pair, and every K-th pair (j % K == 0) gets each other's `choices` (text, tokens, logprobs,
  finish reason) while each keeps its own response `id` and `usage`, as a server whose outputs were
  delivered to the wrong request would answer. A pair member whose partner has not answered within
  `pair_timeout` gets its own answer. `swaps` records {got, from} by the run's request ids (X-Request-Id).
- `corrupt_at=C`: a concurrency drill. A request that arrives while at least C other requests are
  in flight at the proxy gets its answer with every logprob lowered by `shift` (the tokens untouched):
  a lie that only highly concurrent arrivals see. `corrupted` records their request ids, `arrivals`
  every request's in-flight count at arrival.
- `tamper_every=K`: a server that lowers reported logprobs. Every K-th request by arrival (k % K == 0) gets
  its sampled tokens' logprobs lowered by `shift` from the middle of the answer on (position n // 2; the
  tokens untouched); with `tamper_topk` its top-k entries at those positions are lowered too (a consistent
  answer), else they stay as they were (an answer that contradicts itself). `tampered` records
  {request id: first lowered position}.
- `delay_s`: every answer leaves the proxy no sooner than `delay_s` after its request arrived (a slower
  server: concurrency builds up under load). The time is counted from the arrival, not added to the
  upstream's own time, so while the real server answers within `delay_s` every request stays in flight
  exactly that long and the concurrency a load builds depends on its arrivals alone, not on how busy
  the machine is (two passes of one seeded load then see the same in-flight counts).
ThreadingHTTPServer, one thread per connection; `with LyingProxy(...) as p:` starts it (`p.url`) and
stops it afterwards.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class LyingProxy:
    def __init__(
        self,
        upstream: str,
        swap_every: int | None = None,
        corrupt_at: int | None = None,
        shift: float = 2.5,
        delay_s: float = 0.0,
        pair_timeout: float = 20.0,
        tamper_every: int | None = None,
        tamper_topk: bool = False,
    ):
        self.upstream = upstream.rstrip("/")
        self.swap_every, self.corrupt_at, self.shift = swap_every, corrupt_at, shift
        self.delay_s, self.pair_timeout = delay_s, pair_timeout
        self.tamper_every, self.tamper_topk = tamper_every, tamper_topk
        self.tampered: dict[str, int] = {}
        self.lock = threading.Condition()
        self.arrived = 0
        self.in_flight = 0
        self.answers: dict[int, dict] = {}  # arrival index -> (request id, upstream answer) of pair members
        self.swaps: list[dict] = []
        self.corrupted: list[str] = []
        self.arrivals: dict[str, int] = {}
        self.client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=512))
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                r = outer.client.get(outer.upstream + self.path)
                self._send(r.status_code, r.content)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                rid = self.headers.get("X-Request-Id", "")
                arrived_at = time.monotonic()
                with outer.lock:
                    k = outer.arrived
                    outer.arrived += 1
                    concurrency = outer.in_flight
                    outer.in_flight += 1
                    outer.arrivals[rid] = concurrency
                try:
                    headers = {"Content-Type": "application/json"}
                    if rid:
                        headers["X-Request-Id"] = rid
                    r = outer.client.post(outer.upstream + self.path, content=raw, headers=headers)
                    if outer.delay_s:
                        time.sleep(max(0.0, outer.delay_s - (time.monotonic() - arrived_at)))
                    body = r.content
                    if r.status_code == 200:
                        body = json.dumps(outer._lie(k, rid, json.loads(r.content), concurrency)).encode()
                    self._send(r.status_code, body)
                finally:
                    with outer.lock:
                        outer.in_flight -= 1

            def _send(self, status: int, body: bytes):
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 512
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def _lie(self, k: int, rid: str, answer: dict, concurrency: int) -> dict:
        if self.tamper_every and k % self.tamper_every == 0:
            self._tamper(rid, answer)
        if self.corrupt_at is not None and concurrency >= self.corrupt_at:
            with self.lock:
                self.corrupted.append(rid)
            for choice in answer.get("choices") or []:
                lp = choice.get("logprobs") or {}
                lp["token_logprobs"] = [
                    v - self.shift if isinstance(v, (int, float)) else v for v in lp.get("token_logprobs") or []
                ]
                lp["top_logprobs"] = [
                    {t: v - self.shift for t, v in (top or {}).items()} for top in lp.get("top_logprobs") or []
                ]
        if self.swap_every and (k // 2) % self.swap_every == 0:
            partner = k ^ 1
            with self.lock:
                self.answers[k] = {"rid": rid, "answer": answer}
                self.lock.notify_all()
                got = self.lock.wait_for(lambda: partner in self.answers, timeout=self.pair_timeout)
                if got:
                    other = self.answers[partner]
                    self.swaps.append(
                        {"got": rid, "from": other["rid"], "same_tokens": _tokens(other["answer"]) == _tokens(answer)}
                    )
                    return {**answer, "choices": other["answer"]["choices"]}
        return answer

    def _tamper(self, rid: str, answer: dict) -> None:
        for choice in answer.get("choices") or []:
            lp = choice.get("logprobs") or {}
            values = lp.get("token_logprobs") or []
            at = len(values) // 2
            if not values:
                continue
            with self.lock:
                self.tampered[rid] = at
            lp["token_logprobs"] = [v - self.shift if i >= at and v is not None else v for i, v in enumerate(values)]
            if self.tamper_topk:
                lp["top_logprobs"] = [
                    {t: v - self.shift for t, v in (top or {}).items()} if i >= at else top
                    for i, top in enumerate(lp.get("top_logprobs") or [])
                ]

    def __enter__(self) -> "LyingProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.client.close()


def _tokens(answer: dict) -> list:
    return [(c.get("logprobs") or {}).get("tokens") for c in answer.get("choices") or []]
