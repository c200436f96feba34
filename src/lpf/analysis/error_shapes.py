"""Failed requests' errors grouped by their shape, and the hint for what to try.

Contract (pure: strings in, plain data out):
- `shape(error, request_id=None) -> str`: the error with what differs between requests failing the
  same way taken out: the request's own id, UUIDs, long hex ids, every number (`#`) and every
  list of numbers (`[...]`). Two errors
  with the same shape are one failure (490 copies of a refusal that quotes each request's id are one
  group, not 490).
- `group(errors, request_ids=None, top=None) -> list[dict]`: {shape, n, example (the first error of
  that shape, as the server said it)}, commonest first (ties: first seen); None errors are skipped.
- `hint(error) -> str | None`: what to try, for the failures lpf knows a way around ("-E prompt=text"
  for a server that refuses token-id prompts, "-E request_id_header=none" for a refusal with no
  reason given, ...); None otherwise.
- `summary(errors, request_ids=None, kinds=3) -> str`: one line: each of the commonest shapes' count
  and example, how many other shapes, and the hint of the commonest that has one.
"""

from __future__ import annotations

import re
from collections import Counter

_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_HEX = re.compile(r"\b(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{12,}\b")
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LIST = re.compile(r"\[[-#(), ]*\]")  # a list of numbers (an answer's entries, quoted): its length varies too

# (pattern on the error, hint): the first that matches speaks
_HINTS = [
    (re.compile(r"token-id prompts|prompt must be a string", re.I), "try -E prompt=text (send prompts as text)"),
    (
        re.compile(r"HTTP 4\d\d from [^ ]+: \(empty body\)"),
        "the server refused without a reason: request-id middleware may want another X-Request-Id; "
        "try -E request_id_header=none (or =uuid)",
    ),
    (
        re.compile(r"cannot connect|server refused \d+ connections"),
        "is a server listening at --base-url? (start it, or check host, port and /v1)",
    ),
    (
        re.compile(r"HTTP 404 .*(model|does not exist)", re.I),
        "--model (or --served-model) must be the name the server serves (its GET /v1/models)",
    ),
    (
        re.compile(r"HTTP 401|HTTP 403"),
        "the server wants a key: put it in an environment variable and pass --api-key-env NAME",
    ),
    (
        re.compile(r"no complete answer within"),
        "answers took longer than -E timeout_s: raise it, or lower -E concurrency",
    ),
]


def shape(error: str, request_id: str | None = None) -> str:
    text = error.replace(request_id, "<request>") if request_id else error
    text = _UUID.sub("<uuid>", text)
    text = _HEX.sub("<hex>", text)
    return _LIST.sub("[...]", _NUMBER.sub("#", text))


def group(errors, request_ids=None, top: int | None = None) -> list[dict]:
    ids = list(request_ids) if request_ids is not None else None
    counts: Counter = Counter()
    example: dict[str, str] = {}
    for i, e in enumerate(errors):
        if e is None:
            continue
        s = shape(e, ids[i] if ids is not None else None)
        counts[s] += 1
        example.setdefault(s, e)
    ranked = sorted(counts, key=lambda s: -counts[s])  # stable: ties stay in the order first seen
    return [{"shape": s, "n": counts[s], "example": example[s]} for s in ranked[:top]]


def hint(error: str) -> str | None:
    for pattern, text in _HINTS:
        if pattern.search(error):
            return text
    return None


def summary(errors, request_ids=None, kinds: int = 3) -> str:
    groups = group(errors, request_ids)
    if not groups:
        return "no errors"
    parts = [f"{g['n']} x {g['example']}" for g in groups[:kinds]]
    if len(groups) > kinds:
        rest = sum(g["n"] for g in groups[kinds:])
        parts.append(f"{rest} more in {len(groups) - kinds} other shapes")
    line = "; ".join(parts)
    said = next((h for h in (hint(g["example"]) for g in groups) if h), None)
    if said is None or any(flag in line for flag in re.findall(r"-E \S+", said)):  # the error says it already
        return line
    return f"{line} (hint: {said})"
