"""What the proxy hands the recorder for one sampled request: plain data, no I/O.

Contract: a `Sample` is filled on the request path (arrival, first byte, end, requests in flight at
arrival, the upstream's status, request id and replica headers, the answer's pieces) and put on the
recorder's bounded queue once the client has its answer; nothing here is sent to the client. Headers
are copied from `REPLICA_HEADERS` only (never Authorization or any other request header: API keys are
never recorded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lpf.watch.wire import Added, Collected

# response headers that say which upstream replica answered (load balancers, vLLM, SGLang, gateways)
REPLICA_HEADERS = (
    "x-request-id",
    "x-served-by",
    "x-backend",
    "x-upstream",
    "x-replica",
    "x-instance-id",
    "x-pod-name",
    "x-kong-upstream-status",
    "server",
    "via",
    "fly-request-id",
    "x-amzn-requestid",
    "cf-ray",
)


@dataclass
class Sample:
    seq: int  # arrival index among sampled requests
    route: str
    body: dict  # the client's body (parsed), as the client sent it
    added: Added
    stream: bool
    t_arrival: float  # unix seconds
    in_flight: int  # requests in flight through the proxy at arrival (this one excluded)
    collected: Collected
    t_first: float | None = None  # first byte of the answer's body
    t_end: float | None = None
    status: int | None = None
    error: str | None = None  # why the answer is not a usable completion (upstream error, malformed, cut)
    raw_evidence: str | None = None  # a malformed answer's first bytes, kept as returned
    headers: dict = field(default_factory=dict)  # REPLICA_HEADERS the upstream answered with
    stream_done: bool = False  # the upstream's stream reached its `data: [DONE]`: the answer is whole

    @property
    def upstream_request_id(self) -> str | None:
        return self.headers.get("x-request-id") or self.collected.response_id
