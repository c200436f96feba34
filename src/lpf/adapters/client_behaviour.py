"""Client behaviours of the HTTP engines that trigger prefix-cache bugs: cancel-then-resend, bursts.

Contract (pure helpers `RemoteEngine` calls; no I/O of their own):
- `cancelled_attempt(req, cancel_after_ms)`: whether this request is first sent and cancelled: the
  workload marks it (`abort_after_tokens`: the built-in engine cancels it past that many prompt
  tokens; a client over HTTP cannot see tokens, so it cancels after `cancel_after_ms`) and the
  option is on. `CANCELLED_ID(request_id)` is the id the cancelled attempt carries to the server
  (`ID~attempt0`, as the built-in engine names its cancelled attempt), so its trace rows stay apart
  from the answer's; `cancel_record(...)` is its attempt record (`schema.ATTEMPT` fields, `cancelled`
  in the error, never an answer thrown away: an answer that came back before the cancel is the
  request's answer, its one attempt, and its server trace rows keep the id `ID~attempt0`).
- `burst_arrivals(requests, prefix_tokens, gap_s)`: send times (seconds after the start) that put
  every request whose first `prefix_tokens` prompt tokens agree into one burst at the same instant,
  bursts `gap_s` apart in the arrival order of their first request: N requests sharing a prefix
  reach the server together (a server's prefix cache sees siblings admitted in the same step).
"""

from __future__ import annotations

from lpf.core.workload import EngineRequest

CANCELLED = "cancelled by the client"


def CANCELLED_ID(request_id: str) -> str:  # noqa: N802 - reads as the id it names
    return f"{request_id}~attempt0"


def cancelled_attempt(req: EngineRequest, cancel_after_ms: float) -> bool:
    return bool(cancel_after_ms) and req.abort_after_tokens is not None


def is_cancel_record(rec: dict) -> bool:
    return str(rec.get("error") or "").startswith(CANCELLED)


def cancel_record(
    attempts: list, t_start: float, t_end: float, cancel_after_ms: float, sent_id: str | None = None
) -> dict:
    rec = {
        "attempt": len(attempts),
        "sent": True,
        "status": None,
        "error": f"{CANCELLED} after {cancel_after_ms:g} ms (cancel_after_ms), then resent",
        "t_start": t_start,
        "t_end": t_end,
        "sent_id": sent_id,  # the id the server was told for the cancelled attempt
    }
    attempts.append(rec)
    return rec


def burst_arrivals(requests: list[EngineRequest], prefix_tokens: int, gap_s: float) -> dict[str, float]:
    bursts: dict[tuple, float] = {}
    at = {}
    for r in sorted(requests, key=lambda r: r.seq):
        key = tuple(r.prompt_token_ids[:prefix_tokens])
        if key not in bursts:
            bursts[key] = len(bursts) * gap_s
        at[r.request_id] = bursts[key]
    return at
