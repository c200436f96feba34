"""Common ground of the adapters that talk to a server over HTTP (`openai`, `sglang`).

Contract: a `RemoteEngine` subclass says how one request becomes a JSON payload (`endpoint`,
`payload`) and how one JSON answer becomes a `Completion` (`parse`). An answer with nothing usable
(no tokens, no logprobs, logprobs that cannot be paired with tokens, ids the tokenizer cannot
place) raises `RequestFailed` with a one-line reason and becomes that request's error. An answer
that is usable but fails a consistency check (the server's own token count, its text against its
token ids, SGLang's `output_ids` against its logprob ids, the finish reason against the length,
logprobs above 0 or not numbers) is kept as returned with `inconsistency` = "KIND: detail[; ...]"
(`Problems`): evidence of a lie is never dropped. This class sends the requests with
`lpf.adapters.http` (concurrency limit, bounded retries, per-attempt timeout, overall deadline),
records every attempt on the completion (`attempts`), and yields completions as they finish;
every request comes back, failed ones with `error` set. Each attempt carries a
request id (`tag`: a header or a payload field): lpf's own (retries add "~retryN") or, for the `openai`
engine by default, a UUID (`-E request_id_header`: servers whose middleware takes only UUIDs refuse
others); the id sent is recorded on the attempt (`sent_id`), so a server's logs and traces (`lpf serve
--trace-dir`, vLLM's plugin) map back to the run's requests.

The server's model is not a local path, so `resolve_model_spec` decides which local model gives the
tokenizer (prompts, checks) and the reference: `--model` when it is a local directory or zoo:/tiny:
name, else `--reference`. The served name travels as the engine option `served_model`; the manifest
records options and the API key's environment variable name, never the key.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from pydantic import model_validator

from lpf.adapters.base import Completion, Engine, Options
from lpf.adapters.http import (
    CircuitBreaker,
    RequestFailed,
    RetryPolicy,
    Stats,
    api_key_from_env,
    make_client,
    post_json,
    run_all,
)
from lpf.core.errors import LpfError
from lpf.core.knobs import knob
from lpf.core.workload import EngineRequest


class RemoteOptions(Options):
    base_url: str = knob(
        "", help="openai/sglang/llamacpp engines: the server, e.g. http://127.0.0.1:8000/v1.", flag=True
    )
    api_key_env: str = knob(
        "",
        help="openai/sglang engines: environment variable holding the API key (never written anywhere).",
        flag=True,
        metavar="VAR",
    )
    # the client's requests in flight, not a batch the server forms: no role (lpf repeat does not vary it)
    concurrency: int = knob(16, ge=1, help="Requests in flight at once.", shrink_order=110)
    timeout_s: float = knob(60.0, gt=0, help="Seconds one attempt may take.")
    max_retries: int = knob(4, ge=0, help="Attempts after the first, for failures worth retrying.")
    deadline_s: float = knob(3600.0, gt=0, help="Seconds the whole run may take.")
    backoff_s: float = knob(0.5, gt=0, help="First retry's wait in seconds (doubling, with jitter).")
    # open-loop load: Poisson arrivals (seeded by the run's seed); 0 = closed loop
    arrival_rate: float = knob(
        0.0,
        ge=0,
        help="Requests per second, Poisson arrivals (0: a new request as soon as one of `concurrency` finishes).",
    )
    # client behaviours that trigger prefix-cache bugs (`lpf.adapters.client_behaviour`)
    cancel_after_ms: float = knob(
        0.0,
        ge=0,
        help="A request the workload marks (abort_after_tokens) is first sent "
        "and cancelled after this many ms, then resent (0: sent once).",
    )
    burst_prefix_tokens: int = knob(
        0, ge=0, help="Send requests whose first N prompt tokens agree together, one burst per prefix (0: no bursts)."
    )
    burst_gap_ms: float = knob(500.0, ge=0, help="Milliseconds between two bursts (burst_prefix_tokens).")

    @model_validator(mode="after")
    def _usable(self):
        if not self.base_url:
            raise LpfError("this engine talks to a server: pass --base-url http://HOST:PORT")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise LpfError(f"--base-url must be an http(s)://HOST[:PORT][/PATH] URL, got {self.base_url!r}")
        if parts.username or parts.password:
            raise LpfError(
                "--base-url must not carry credentials (they would be written to the manifest); "
                "put the key in an environment variable and pass --api-key-env NAME"
            )
        api_key_from_env(self.api_key_env)  # a missing key is refused before the run directory exists
        if self.burst_prefix_tokens and self.arrival_rate:
            raise LpfError("-E burst_prefix_tokens and -E arrival_rate both set send times: pick one")
        return self

    def policy(self) -> RetryPolicy:
        return RetryPolicy(
            max_retries=self.max_retries, backoff_s=self.backoff_s, timeout_s=self.timeout_s, deadline_s=self.deadline_s
        )


def is_local_model(spec: str) -> bool:
    return spec.startswith(("zoo:", "tiny:")) or (Path(spec).expanduser() / "config.json").is_file()


class RemoteEngine(Engine):
    Options = RemoteOptions
    server = True
    needs_served_name = False  # openai: the payload names the model; sglang: one model per server

    def __init__(self, model, sampling, options: RemoteOptions):
        super().__init__(model, sampling, options)
        from lpf.core.model_specs import load_tokenizer

        self.api_key = api_key_from_env(options.api_key_env)
        self.tokenizer = load_tokenizer(model)
        cfg = json.loads((model.path / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        self.vocab_size = int(cfg.get("vocab_size") or len(self.tokenizer))
        self.max_context = cfg.get("max_position_embeddings")
        self.stats = Stats()
        self._told: dict[str, str | None] = {}
        self.server_version = self._server_version()

    def _server_version(self) -> str | None:
        """The server's own version where it tells (vLLM and SGLang answer GET /version), for the manifest;
        None when it does not answer quickly: the run does not depend on it."""
        import httpx

        root = self.options.base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            answer = httpx.get(root + "/version", headers=headers, timeout=5.0).json()
        except (httpx.HTTPError, ValueError):
            return None
        version = answer.get("version") if isinstance(answer, dict) else None
        return str(version) if version is not None else None

    @classmethod
    def resolve_model_spec(cls, model: str | None, reference: str | None, options: dict) -> str:
        """The local model spec for the run (tokenizer + default reference); fills options['served_model']
        for engines whose requests name the model."""
        served = options.get("served_model") or None
        if model is None and served is None and cls.needs_served_name:
            raise LpfError(f"--engine {cls.name} needs --model NAME (the model the server serves)")
        if cls.needs_served_name and served is None:
            options["served_model"] = model
        if model is not None and is_local_model(model):
            return model
        if reference:
            return reference
        if model is None:
            from lpf.core.model_specs import DEFAULT_MODEL

            return DEFAULT_MODEL
        raise LpfError(
            f"--model {model!r} is the served model's name, not a local directory or zoo: name: pass "
            f"--reference DIR (the same model's weights and tokenizer, used for prompts and rescoring)"
        )

    # -- subclass hooks -------------------------------------------------------------------------------
    def endpoint(self) -> str:
        raise NotImplementedError

    def payload(self, req: EngineRequest) -> dict:
        raise NotImplementedError

    def parse(self, req: EngineRequest, body: Any) -> Completion:
        raise NotImplementedError

    def tag(self, req: EngineRequest, payload: dict, attempt: int) -> tuple[dict, dict, str | None]:
        """The attempt's payload, headers and the id the server is told (None: none), so a server's own
        logs and traces name the run's requests; retries get a suffix (a server may refuse an id still
        in flight). A subclass that tells one calls `told` (a cancelled attempt's record needs it)."""
        return payload, {}, None

    def told(self, req: EngineRequest, sent_id: str | None) -> str | None:
        """Remember the last id sent for `req` (its `request_id` names the attempt group: `ID~attempt0`
        for a cancelled first send, whose in-flight attempt has no record of its own)."""
        self._told[req.request_id] = sent_id
        return sent_id

    @staticmethod
    def attempt_id(req: EngineRequest, attempt: int) -> str:
        return req.request_id if attempt == 0 else f"{req.request_id}~retry{attempt}"

    async def call(self, client, req: EngineRequest, deadline: float, breaker: CircuitBreaker, attempts: list) -> Any:
        """One request's JSON answer (a subclass may adapt the payload after a refusal); every attempt
        is appended to `attempts`."""
        return await post_json(
            client,
            self.url(self.endpoint()),
            self.payload(req),
            self.options.policy(),
            deadline,
            self.stats,
            breaker,
            tag=lambda p, a: self.tag(req, p, a),
            attempts=attempts,
        )

    # -- shared machinery ---------------------------------------------------------------------------
    def url(self, path: str) -> str:
        return self.options.base_url.rstrip("/") + path

    def describe(self) -> dict:
        return {
            "name": self.name,
            "version": self.server_version,
            "options": self.options.to_dict(),
            "client": {"retries": self.stats.to_dict()},
        }

    def in_flight(self) -> int:
        """How many requests are sent at once (an engine may derive it from its other knobs)."""
        return self.options.concurrency

    def generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        o = self.options
        concurrency = self.in_flight()
        deadline = time.monotonic() + o.deadline_s
        breaker = CircuitBreaker(concurrency + o.max_retries + 1)
        started: dict[str, float] = {}
        attempts: dict[str, list] = {}

        async def handler(client, req: EngineRequest) -> Completion:
            started[req.request_id] = time.time()
            log = attempts.setdefault(req.request_id, [])
            body = await self._cancelled_first(client, req, deadline, breaker, log)
            if body is None:
                body = await self.call(client, req, deadline, breaker, log)
            try:
                c = self.parse(req, body)
            except RequestFailed as e:  # the attempt got an answer we cannot use: say so on the attempt too
                if log:
                    log[-1]["error"] = str(e)
                raise
            c.t_submit, c.attempts = started[req.request_id], log
            return c

        def on_error(req: EngineRequest, message: str) -> Completion:
            return Completion.failed(
                req.request_id, message, t_submit=started.get(req.request_id), attempts=attempts.get(req.request_id, [])
            )

        for _, completion in run_all(
            requests,
            handler,
            concurrency=concurrency,
            client_factory=lambda: make_client(concurrency, self.api_key),
            on_error=on_error,
            join_timeout=o.timeout_s + 5,
            start_at=self.arrivals(requests),
        ):
            yield completion

    async def _cancelled_first(self, client, req: EngineRequest, deadline: float, breaker, log: list) -> Any:
        """With `cancel_after_ms`, a marked request's first attempt (as `ID~attempt0`), cancelled after
        that long (the connection closes: vLLM aborts the request); None then, and the caller resends.
        An answer that beat the cancel is the request's answer (returned); a failure is kept, then resent."""
        import asyncio
        import dataclasses

        from lpf.adapters.client_behaviour import CANCELLED_ID, cancel_record, cancelled_attempt

        ms = self.options.cancel_after_ms
        if not cancelled_attempt(req, ms):
            return None
        first: list = []
        t = time.time()
        try:
            body = await asyncio.wait_for(
                self.call(
                    client, dataclasses.replace(req, request_id=CANCELLED_ID(req.request_id)), deadline, breaker, first
                ),
                ms / 1000,
            )
            log.extend(first)  # it beat the cancel: the request's answer (its server rows keep ID~attempt0)
            return body
        except asyncio.TimeoutError:
            log.extend(first)  # attempts that failed before the cancel are evidence too
            cancel_record(log, t, time.time(), ms, sent_id=self._told.get(CANCELLED_ID(req.request_id)))
        except RequestFailed:
            log.extend(first)
        return None

    def arrivals(self, requests: list[EngineRequest]) -> Callable[[EngineRequest], float] | None:
        """With `arrival_rate`, each request's send time (seconds after the start): a Poisson process
        seeded by the run's seed, in arrival order, so a rerun sends the same schedule. With
        `burst_prefix_tokens`, the bursts of `client_behaviour.burst_arrivals`."""
        if self.options.burst_prefix_tokens:
            from lpf.adapters.client_behaviour import burst_arrivals

            at = burst_arrivals(requests, self.options.burst_prefix_tokens, self.options.burst_gap_ms / 1000)
            return lambda r: at[r.request_id]
        rate = self.options.arrival_rate
        if not rate:
            return None
        rng = random.Random(self.sampling.seed)
        at, t = {}, 0.0
        for r in sorted(requests, key=lambda r: r.seq):
            at[r.request_id] = t
            t += rng.expovariate(rate)
        return lambda r: at[r.request_id]

    # -- checks every parser shares -----------------------------------------------------------------
    def check_ids(self, ids: list[int], what: str = "token id") -> None:
        for pos, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise RequestFailed(
                    f"{what} {t!r} at position {pos} is not in the model's vocabulary (0..{self.vocab_size - 1})"
                )

    def top_k(
        self,
        top: Any,
        n: int,
        field: str,
        entry_pairs: Callable[[Any, int], list[tuple[float, int]]],
        problems: "Problems",
    ) -> tuple[list, list]:
        """Per position, the best `--logprobs` alternatives (ids, logprobs), best first, from a server's
        `field` (one entry per output token); `entry_pairs(entry, pos)` reads one entry in that
        server's shape as (logprob, token id) pairs. Nothing asked or nothing sent: no top-k; a list
        that cannot be lined up with the tokens is an inconsistency (the sampled tokens still count)."""
        k = self.sampling.logprobs
        if k == 0 or top is None:
            return [], []
        if not isinstance(top, list) or len(top) != n:
            problems.add(
                "top_logprobs", f"{field} has {len(top) if isinstance(top, list) else 'no'} entries for {n} tokens"
            )
            return [], []
        ids_out, lps_out = [], []
        for pos, entry in enumerate(top):
            # sorted and cut: the sampled token may ride along as a (k+1)-th entry
            pairs = sorted(((v, t) for v, t in entry_pairs(entry, pos) if v == v), key=lambda p: -p[0])
            ids_out.append([t for _, t in pairs[:k]])
            lps_out.append([v for v, _ in pairs[:k]])
        return ids_out, lps_out

    def check_answer(
        self,
        req: EngineRequest,
        ids: list[int],
        claimed: Any,
        finish: Any,
        text: Any,
        problems: "Problems",
        finish_detail: str | None = None,
    ) -> None:
        """What every answer must agree with: tokens at all, at most max_tokens of them, the server's
        own count, its finish reason (a `length` finish short of both max_tokens and the context is
        not one) and its text (the tokens decoded, with or without special tokens)."""
        n = len(ids)
        if n == 0:
            raise RequestFailed("the answer has no output tokens")
        if n > req.max_tokens:
            problems.add("too_long", f"{n} output tokens for max_tokens {req.max_tokens}")
        if isinstance(claimed, int) and not isinstance(claimed, bool) and claimed != n:
            problems.add("token_count", f"the server counts {claimed} completion tokens but returned {n} with logprobs")
        room = None if self.max_context is None else self.max_context - len(req.prompt_token_ids)
        if finish == "length" and n < req.max_tokens and (room is None or n < room):
            problems.add("finish_reason", f"finish_reason 'length' after {n} of max_tokens {req.max_tokens} tokens")
        elif finish not in ("stop", "length"):
            problems.add("finish_reason", f"finish_reason {finish!r}" + (f": {finish_detail}" if finish_detail else ""))
        if isinstance(text, str):
            decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
            if text != decoded and text != self.tokenizer.decode(ids, skip_special_tokens=False):
                problems.add("text", f"the answer's text {snippet(text)} is not its tokens' text {snippet(decoded)}")


class Problems:
    """The consistency checks an answer failed, as `KIND: detail` items; `logprob` problems of many
    positions collapse into one item (the first position and the count)."""

    def __init__(self):
        self.items: dict[str, str] = {}
        self._counts: dict[str, int] = {}

    def add(self, kind: str, detail: str) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self.items.setdefault(kind, detail)

    def logprob(self, value: Any, pos: int) -> float:
        """A logprob as returned: a number above 0, NaN, null or not a number at all is kept (as NaN
        when it is no number) and noted, never a reason to drop the answer's tokens."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.add("logprob", f"logprob at position {pos} is {snippet(value)}, not a number")
            return math.nan
        value = float(value)
        if value != value or value > 1e-6:
            self.add("logprob", f"logprob at position {pos} is {value!r}, not a log-probability")
            return value
        return min(value, 0.0)

    def text(self) -> str | None:
        if not self.items:
            return None
        return "; ".join(
            f"{kind}: {detail}" + (f" ({self._counts[kind]} positions)" if self._counts[kind] > 1 else "")
            for kind, detail in self.items.items()
        )


def snippet(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def as_logprob(value: Any, pos: int) -> float:
    """A top-k alternative's logprob: a usable number, or NaN (the alternative is then left out).
    -inf is left out too: a zero-probability alternative says nothing about the ranking, and the
    top-k metrics take finite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value > 1e-6:
        return math.nan
    return float(min(value, 0.0))
