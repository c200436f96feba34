"""What `lpf watch` could not judge, said as facts: failed samples by status class, unscorable ones by reason.

Contract (pure; no I/O):
- `failure_class(error, status)`: None for an answered sample, else "4xx" / "5xx" (the upstream answered
  an error), "no-answer" (refused, timed out, cut, malformed: nothing usable came back) or "client-gone"
  (the client left first: not the upstream's failure, never counted against it).
- `unscored_reason(error, n_output, inconsistency, stream)`: None for a sample the reference scores as
  recorded, else one of UNSCORED_REASONS: "stream-stripped" (a streamed answer with neither token ids nor
  logprobs: the upstream or a gateway strips them from streams; its ids would be re-encoded text),
  "retokenized" (the same, not streamed), "empty" (no output token), "inconsistent" (scored, but the
  answer contradicts itself: e.g. fewer token ids than logprob entries, which the analysis weighs).
  Only the first three leave the scoring; an inconsistent sample is scored and counted here too.
- `window_facts(classes, reasons)`: a window's {n_failed, failed {class: n}, unscored {reason: n},
  upstream_failing}: `upstream_failing` when more than UPSTREAM_FAILING_SHARE of its requests (client
  departures aside) failed upstream: such a window is thin because the upstream failed, and says so.
- `window_result(line)`: the window's label for `lpf_watch_windows_total{result}`: "upstream-failing", the
  run-level test's "same" / "different", "undecided" (scored, too few tokens to decide), or "unscored".
- `window_notes(line)`: the window's failures and unscorable samples in words, for its log line and the page.
"""

from __future__ import annotations

FAILURE_CLASSES = ("4xx", "5xx", "no-answer", "client-gone")
UNSCORED_REASONS = ("stream-stripped", "retokenized", "empty", "inconsistent")
WINDOW_RESULTS = ("same", "different", "undecided", "not-applicable", "unscored", "upstream-failing")
# more than this share of a window's requests failed upstream: the window is `upstream-failing`
UPSTREAM_FAILING_SHARE = 0.5
CLIENT_GONE = "the client disconnected"
WHY = {
    "stream-stripped": "the upstream or a gateway strips logprobs and token ids from streamed answers",
    "retokenized": "the upstream returned neither token ids nor logprobs",
    "empty": "no output token",
    "inconsistent": "answers that contradict themselves (scored, weighed as such)",
}


def failure_class(error: str | None, status: int | None) -> str | None:
    if error is None:
        return None
    if error.startswith(CLIENT_GONE):
        return "client-gone"
    if status is not None and 400 <= status < 500:
        return "4xx"
    if status is not None and status >= 500:
        return "5xx"
    return "no-answer"


def unscored_reason(error: str | None, n_output: int, inconsistency: str | None, stream: bool | None) -> str | None:
    if error is not None:
        return None  # a failure, counted as one
    if inconsistency and "retokenized:" in inconsistency:
        return "stream-stripped" if stream else "retokenized"
    if not n_output:
        return "empty"
    if inconsistency:
        return "inconsistent"
    return None


def leaves_scoring(reason: str | None) -> bool:
    """Whether a sample with this reason is left unscored (an inconsistent one is scored)."""
    return reason is not None and reason != "inconsistent"


def window_facts(classes: list[str | None], reasons: list[str | None]) -> dict:
    failed: dict[str, int] = {}
    for c in classes:
        if c is not None:
            failed[c] = failed.get(c, 0) + 1
    unscored: dict[str, int] = {}
    for r in reasons:
        if r is not None:
            unscored[r] = unscored.get(r, 0) + 1
    upstream = sum(n for c, n in failed.items() if c != "client-gone")
    judged = len(classes) - failed.get("client-gone", 0)
    return {
        "n_failed": upstream,
        "failed": failed,
        "unscored": unscored,
        "upstream_failing": judged > 0 and upstream / judged > UPSTREAM_FAILING_SHARE,
    }


def window_result(line: dict) -> str:
    if line.get("upstream_failing"):
        return "upstream-failing"
    result = (line.get("run_test") or {}).get("result")
    if result in ("same", "different"):
        return result
    if result == "not applicable":  # a self-reference: the upstream agrees with itself whatever it serves
        return "not-applicable"
    return "undecided" if line.get("n_requests") else "unscored"


def window_notes(line: dict) -> str:
    """'13 of 20 failed upstream (5xx 13): upstream failing; 4 of 20 not scorable: ...', or ''."""
    n = line.get("n_settled") or len(line.get("request_ids") or ()) or 0
    parts = []
    failed = line.get("failed") or {}
    if line.get("n_failed"):
        by = ", ".join(f"{c} {k}" for c, k in sorted(failed.items()) if c != "client-gone")
        parts.append(
            f"{line['n_failed']} of {n} failed upstream ({by})"
            + (": upstream failing" if line.get("upstream_failing") else "")
        )
    if failed.get("client-gone"):
        parts.append(f"{failed['client-gone']} of {n} left by their clients")
    for reason, k in sorted((line.get("unscored") or {}).items()):
        verb = "scored with caution" if reason == "inconsistent" else "not scorable"
        parts.append(f"{k} of {n} {verb}: {WHY.get(reason, reason)}")
    return "; ".join(parts)
