"""The HTTP client shared by the `openai` and `sglang` adapters: asyncio + httpx, bounded everything.

Contract:
- `post_json(...)` sends one JSON request and returns the decoded JSON answer, or raises `RequestFailed`
  with a one-line reason. Every attempt is appended to the caller's `attempts` list as it ends (the
  `schema.ATTEMPT` fields: `sent` false when it never left, `status`, the server's own `error` message,
  `t_start`/`t_end`), so "sent and failed" stays apart from "never sent"; a request whose answered
  attempts failed before later ones could not be sent says both in its error. It retries, at most
  `max_retries` times, on what can pass (429, 5xx, timeouts, refused or broken connections), with
  exponential backoff and full jitter; a 429 or 503 with `Retry-After` waits at least that long. Other 4xx
  answers, answers that are not JSON, and a refusal of the request's shape whatever its status (a 5xx whose
  message is a validation error, `is_validation_error`: some servers answer a refused field with 500) are
  not retried (they would come back the same); nor is an authentication failure (`is_auth_error`: a 401, or
  a 403 or 5xx whose message speaks of keys, credentials or authentication, as a gateway's can), whose one
  line names `--api-key-env`. `tag(payload, attempt)` gives each attempt's payload,
  headers and the id the server is told for it (`sent_id` in the attempt's record). Every attempt is
  bounded by `timeout_s` from connect to the last byte, and nothing is attempted or waited for past the
  run's overall deadline.
- `run_all(items, handler, ...)` runs an async handler over items with a concurrency limit in a
  background event loop (each item no earlier than `start_at(item)` seconds after the start, when
  given: open-loop arrivals) and yields `(item, result)` pairs from the calling thread as each finishes,
  so a synchronous `Engine.generate` can stream completions. A handler failure becomes that item's
  error (via `on_error`), never a lost item; closing the iterator cancels what is still in flight.
- `CircuitBreaker`: once the server has refused `threshold` connections in a row with no success in
  between, the remaining requests fail at once ("server unreachable") instead of each retrying into
  a dead port.
The API key comes from an environment variable named by the user and lives only in request headers.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import queue
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Iterator

from lpf.core.errors import LpfError


class RequestFailed(Exception):
    """One request could not be completed; the message is what the run records as its error."""


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 4
    backoff_s: float = 0.5  # first backoff; doubles per retry, full jitter
    backoff_max_s: float = 10.0
    timeout_s: float = 60.0  # one attempt, connect to last byte
    deadline_s: float = 3600.0  # the whole run

    def __post_init__(self):
        if self.max_retries < 0:
            raise LpfError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("backoff_s", "backoff_max_s", "timeout_s", "deadline_s"):
            if not getattr(self, name) > 0:
                raise LpfError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Stats:
    """What the client did, for the manifest and the tests (attempts, retries, reasons)."""

    attempts: int = 0
    retries: int = 0
    reasons: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        return {"attempts": self.attempts, "retries": self.retries, "retry_reasons": dict(self.reasons)}


class CircuitBreaker:
    def __init__(self, threshold: int):
        self.threshold = max(1, threshold)
        self.refused_in_a_row = 0
        self.last = ""

    @property
    def open(self) -> bool:
        return self.refused_in_a_row >= self.threshold

    def refused(self, reason: str) -> None:
        self.refused_in_a_row += 1
        self.last = reason

    def success(self) -> None:
        self.refused_in_a_row = 0


def api_key_from_env(env_name: str) -> str | None:
    """The key held by the named environment variable (the name is recorded, the key never is)."""
    if not env_name:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise LpfError(f"--api-key-env {env_name}: that environment variable is not set or empty")
    return key


def make_client(concurrency: int, api_key: str | None):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # httpx's own timeouts are per phase; the per-attempt bound is enforced around each attempt.
    return httpx.AsyncClient(
        headers=headers,
        timeout=None,
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
    )


def attempt_record(
    attempts: list,
    sent: bool,
    status: int | None,
    error: str | None,
    t_start: float,
    t_end: float | None = None,
    sent_id: str | None = None,
) -> dict:
    """Append one attempt (the `schema.ATTEMPT` fields; numbered in order) and return it."""
    rec = {
        "attempt": len(attempts),
        "sent": sent,
        "status": status,
        "error": error,
        "t_start": t_start,
        "t_end": time.time() if t_end is None else t_end,
        "sent_id": sent_id,
    }
    attempts.append(rec)
    return rec


def failure_message(final: str, attempts: list) -> str:
    """The request's error: `final`, and when attempts that reached the server failed before the last
    one could not be sent, what the server said then (the evidence a dead port would otherwise hide)."""
    failed = [a for a in attempts if a["sent"] and a["error"]]
    if attempts and not attempts[-1]["sent"] and failed:
        said = [a for a in failed if a["status"] is not None] or failed  # the server's own words first
        return f"sent and failed ({said[-1]['error']}); then {final}"
    return final


async def post_json(
    client,
    url: str,
    payload: dict,
    policy: RetryPolicy,
    deadline: float,
    stats: Stats,
    breaker: CircuitBreaker | None = None,
    tag: Callable[[dict, int], tuple[dict, dict, str | None]] | None = None,
    attempts: list | None = None,
) -> Any:
    """`tag(payload, attempt)` -> (payload, headers, sent_id) for that attempt (attempt 0 first): the
    id the server is told, if any, goes to the attempt's record; `attempts` collects every attempt's
    record (see the module docstring)."""
    import httpx

    log: list = [] if attempts is None else attempts

    def fail(final: str):
        return RequestFailed(failure_message(final, log))

    attempt = 0
    while True:
        now = time.time()
        if breaker is not None and breaker.open:
            reason = (
                f"not sent: the server refused {breaker.refused_in_a_row} connections in a row (last: {breaker.last})"
            )
            attempt_record(log, False, None, reason, now, now)
            raise fail(reason)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = f"overall deadline of {policy.deadline_s:g} s passed before this request finished"
            attempt_record(log, False, None, reason, now, now)
            raise fail(reason)
        retry_after, sent, status = None, True, None
        stats.attempts += 1
        body, headers, sent_id = tag(payload, attempt) if tag else (payload, {}, None)
        try:
            resp = await asyncio.wait_for(
                client.post(url, json=body, headers=headers), min(policy.timeout_s, remaining)
            )
        except asyncio.TimeoutError:  # (TimeoutError itself only from 3.11 on)
            kind, reason = "timeout", f"no complete answer within {min(policy.timeout_s, remaining):.3g} s"
        except httpx.ConnectError as e:
            kind, reason, sent = "refused", f"cannot connect to {url} ({_short(e) or 'connection refused'})", False
            if breaker is not None:
                breaker.refused(reason)
        except httpx.TransportError as e:
            kind, reason = "broken", f"connection broken ({type(e).__name__}: {_short(e) or 'no detail'})"
        else:
            if breaker is not None:
                breaker.success()
            code = status = resp.status_code
            said = server_message(resp.content) if code >= 400 else ""
            if is_auth_error(code, said):  # a missing or wrong key: every attempt would fail the same way
                reason = (
                    f"HTTP {code} from {url}: authentication failed ({said or 'no message'}); put the API key in an "
                    "environment variable and pass --api-key-env NAME (-E api_key_env=NAME)"
                )
                attempt_record(log, True, code, reason, now, sent_id=sent_id)
                raise fail(reason)
            if (code == 429 or code >= 500) and not is_validation_error(said):
                kind, reason = f"HTTP {code}", f"HTTP {code}: {said}"
                retry_after = parse_retry_after(resp.headers.get("retry-after"))
            elif code >= 400:  # a refusal: the same request would be refused again
                reason = f"HTTP {code} from {url}: {said}"
                attempt_record(log, True, code, reason, now, sent_id=sent_id)
                raise fail(reason)
            else:
                try:
                    answer = json.loads(resp.content)
                except ValueError as e:
                    reason = f"answer is not valid JSON ({e}; starts {resp.content[:60]!r})"
                    attempt_record(log, True, code, reason, now, sent_id=sent_id)
                    raise fail(reason) from None
                attempt_record(log, True, code, None, now, sent_id=sent_id)
                return answer
        attempt_record(log, sent, status, reason, now, sent_id=sent_id)
        stats.reasons[kind] += 1
        if attempt >= policy.max_retries:
            raise fail(f"gave up after {attempt + 1} attempts: {reason}")
        delay = random.uniform(0, min(policy.backoff_max_s, policy.backoff_s * 2**attempt))
        if retry_after is not None:
            delay = max(delay, retry_after)
        if time.monotonic() + delay >= deadline:
            raise fail(f"overall deadline of {policy.deadline_s:g} s would pass before a retry: {reason}")
        stats.retries += 1
        attempt += 1
        await asyncio.sleep(delay)


# what request validators say (pydantic v1/v2, FastAPI, Rust's serde, plain "must be a string"): a
# refusal of the request's shape, deterministic whatever status code the server wraps it in
_VALIDATION = re.compile(
    r"validation error|input should be|field required|extra inputs are not permitted|\btype=\w+_type\b"
    r"|is not valid under any of the given schemas|\bmust be (?:a|an) (?:string|str|integer|list|array)\b"
    r"|should be (?:a|an) (?:string|str|integer|list|array)\b|invalid type: |expected (?:a |an )?(?:str|string)\b",
    re.IGNORECASE,
)


# what servers and gateways say when the key is missing or wrong, whatever status wraps it (LiteLLM's proxy
# answers a missing upstream key as HTTP 500 "litellm.AuthenticationError: ... api_key ...")
_AUTH = re.compile(
    r"authenticat|unauthori[sz]ed|credential|api[ _-]?key|\bauth\b|bearer token|invalid token", re.IGNORECASE
)


def is_auth_error(code: int, message: str) -> bool:
    """Whether an error answer is an authentication failure: 401, or 403 / 5xx whose message speaks of keys,
    credentials or authentication (never retried: the next attempt carries the same key)."""
    return code == 401 or ((code == 403 or code >= 500) and bool(message) and _AUTH.search(message) is not None)


def is_validation_error(message: str) -> bool:
    """Whether a server's error message is a validation error (the request's shape refused)."""
    return bool(message) and _VALIDATION.search(message) is not None


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (delta-seconds or an HTTP date), None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def server_message(body: bytes) -> str:
    """The server's own error message when it sent one (OpenAI, FastAPI and SGLang shapes), else a snippet."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return _one_line(str(err["message"]))
        for key in ("message", "detail", "error"):
            if obj.get(key):
                return _one_line(str(obj[key]))
    text = body[:200].decode("utf-8", errors="replace")
    return _one_line(text) or "(empty body)"


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _short(e: BaseException) -> str:
    return _one_line(str(e))


def run_all(
    items: Iterable,
    handler: Callable[[Any, Any], Awaitable[Any]],
    *,
    concurrency: int,
    client_factory: Callable[[], Any],
    on_error: Callable[[Any, str], Any],
    join_timeout: float,
    start_at: Callable[[Any], float] | None = None,
) -> Iterator[tuple[Any, Any]]:
    """Yield (item, handler(client, item)) as each finishes; see the module docstring."""
    items = list(items)
    out: queue.Queue = queue.Queue()
    done = object()
    loop_box: dict = {}

    async def one(sem, client, item, t0):
        if start_at is not None:
            await asyncio.sleep(max(0.0, t0 + start_at(item) - time.monotonic()))
        async with sem:
            try:
                result = await handler(client, item)
            except RequestFailed as e:
                result = on_error(item, str(e))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a shape we did not foresee: this request's error, not a lost run
                result = on_error(item, f"unexpected answer ({type(e).__name__}: {_short(e)})")
        out.put((item, result))

    async def main():
        loop_box["task"] = asyncio.current_task()
        sem = asyncio.Semaphore(max(1, concurrency))
        async with client_factory() as client:
            t0 = time.monotonic()
            await asyncio.gather(*(one(sem, client, it, t0) for it in items))

    def thread_main():
        try:
            loop = asyncio.new_event_loop()
            loop_box["loop"] = loop
            loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, re-raised there
            out.put((done, e))
            return
        finally:
            if "loop" in loop_box:
                loop_box["loop"].close()
        out.put((done, None))

    t = threading.Thread(target=thread_main, name="lpf-http", daemon=True)
    t.start()
    finished = False
    try:
        while True:
            item, result = out.get()
            if item is done:
                finished = True
                if result is not None:
                    raise result
                return
            yield item, result
    finally:
        if not finished and "loop" in loop_box and "task" in loop_box:
            try:
                loop_box["loop"].call_soon_threadsafe(loop_box["task"].cancel)
            except RuntimeError:
                pass  # the loop already ended
        t.join(timeout=join_timeout)
