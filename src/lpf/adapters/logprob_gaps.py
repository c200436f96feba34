"""Logprob entries a server left out of an answer, found again from the answer's text (pure: no I/O).

llama-server's OpenAI routes send no logprob entry for a token that ends inside a UTF-8 character
(tools/server/server-context.cpp:1825-1860, `process_token`): the answer then has fewer entries than
the tokens it counts (`usage.completion_tokens`), and every entry after such a gap, scored as if it
followed the one before it, is scored in the wrong context (an honest server called `corrupt`).

Contract: `align(pieces, text, missing, by_bytes) -> Aligned`. `pieces`: each entry's bytes in order
(`entry_bytes`; None when neither the entry nor its id's vocabulary entry gives them); `text`: the answer's text; `missing`: how many
tokens the server counts beyond the entries; `by_bytes(b)`: the one vocabulary id whose bytes are `b`,
else None (`TokenMap.by_bytes`); `special` (optional, per entry): a special token, which a server's text
may leave out (decoded without them), so it continues the text either way. Walking the text's UTF-8 bytes, each entry must continue it; the bytes
an entry skips (a gap, or the text's tail past the last entry) are tokens sent without an entry.
`slots` is the whole answer, ("entry", index) and ("gap", id) in order, when every gap is exactly one
known token and there are `missing` of them; else None, and `prefix` is how many leading entries line
up with the text before the first gap: only those are known to be scored in their true context.
`fill_gaps(positions, text, claimed, columns, token_map, special, problems)`: the openai adapter's use of
it on one answer (ids, logprobs, top-k ids, top-k logprobs): the columns with the gaps put back, or cut
before the first gap (then True), the `logprobs_missing` problem said; an answer whose first entry is
after a gap raises `RequestFailed`.
`gaps` counts the places an entry does not continue the text (0: every entry lines up with all of it,
or an entry gave nothing to line up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lpf.adapters.http import RequestFailed


@dataclass
class Aligned:
    slots: list[tuple[str, int]] | None  # ("entry", entry index) | ("gap", token id); None: not recovered
    prefix: int  # entries before the first gap
    gaps: int  # gaps found (recovered or not)


def entry_bytes(raw: Any, tid: int | None, bytes_of: Callable[[Any], bytes | None]) -> bytes | None:
    """An entry's bytes: its `bytes` list when it sent one (llama.cpp, OpenAI's chat shape), else its
    resolved id's bytes in the vocabulary (a token string may be `token_id:N`, not text)."""
    if isinstance(raw, list) and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in raw):
        return bytes(raw)
    return None if tid is None else bytes_of(tid)


def align(
    pieces: list[bytes | None],
    text: str,
    missing: int,
    by_bytes: Callable[[bytes], int | None],
    special: list[bool] | None = None,
) -> Aligned:
    data = text.encode("utf-8", "surrogatepass")
    at, prefix, gaps, slots, known = 0, None, 0, [], True
    for i, piece in enumerate(pieces):
        if piece is None:
            return Aligned(None, i if prefix is None else prefix, gaps)
        here = data.startswith(piece, at)
        if here or (special and special[i]):  # a special token (EOS) continues the text, kept in it or not
            slots.append(("entry", i))
            at += len(piece) if here else 0
            continue
        prefix = i if prefix is None else prefix
        gaps += 1
        nxt = data.find(piece, at + 1) if piece else -1
        if nxt < 0:  # the entry is nowhere later in the text (a replaced character): it cannot be placed
            return Aligned(None, prefix, gaps)
        tid = by_bytes(data[at:nxt])
        known = known and tid is not None
        slots += [("gap", -1 if tid is None else tid), ("entry", i)]
        at = nxt + len(piece)
    if at < len(data):  # the tail: tokens after the last entry
        prefix = len(pieces) if prefix is None else prefix
        gaps += 1
        tid = by_bytes(data[at:])
        known = known and tid is not None
        slots.append(("gap", -1 if tid is None else tid))
    prefix = len(pieces) if prefix is None else prefix
    return Aligned(slots if known and gaps == missing else None, prefix, gaps)


def fill_gaps(positions, text: str, claimed: int, columns, token_map, special: set, problems):
    """An answer with fewer logprob entries than the tokens the server counts (llama-server sends
    none for a token ending inside a UTF-8 character): the left-out tokens found in the text
    (`align`) and kept without a logprob (judged from their tokens alone); when the
    text cannot name them, only the entries before the first gap are kept (those after it would be
    scored in the wrong context). Returns the four columns and whether they were cut."""
    ids, lps, tids, tlps = columns
    pieces = [entry_bytes(p.raw, t, token_map.bytes_of) for p, t in zip(positions, ids)]
    found = align(pieces, text, claimed - len(ids), token_map.by_bytes, [t in special for t in ids])
    if not found.gaps:  # every entry lines up with the whole text: a count that disagrees, said as such
        return (*columns, False)
    why = "llama-server sends none for a token that ends inside a UTF-8 character"
    if found.slots is not None:
        problems.add(
            "logprobs_missing",
            f"the server counts {claimed} completion tokens but sent {len(ids)} logprob entries: the "
            f"{found.gaps} left out were found in its text and are judged from their tokens alone ({why})",
        )
        out = ([], [], [], [])
        for kind, v in found.slots:
            row = (ids[v], lps[v], tids[v], tlps[v]) if kind == "entry" else (v, None, [], [])
            for col, x in zip(out, row):
                col.append(x)
        return (*out, False)
    k = found.prefix
    # what is not scored is still kept, as the server sent it (ids and logprobs, in order)
    kept = f"; the entries not scored (id, logprob): {[(t, lp) for t, lp in zip(ids[k:], lps[k:])]}"
    if k == 0:
        raise RequestFailed(
            f"the server counts {claimed} completion tokens but sent {len(ids)} logprob entries, and its "
            f"first entry does not begin the answer's text: a token was left out before it ({why})" + kept
        )
    where = (
        f"entry {k} does not continue the answer's text ({why}) and the text cannot name what was left "
        f"out: the first {k} tokens are scored, the {len(ids) - k} entries after the gap are not (their "
        f"context is unknown){kept}"
        if k < len(ids)
        else f"what was left out follows the last entry and the text cannot name it ({why}): every entry is scored"
    )
    problems.add(
        "logprobs_missing",
        f"the server counts {claimed} completion tokens but sent {len(ids)} logprob entries; {where}; "
        f"the answer's text was {text!r}",
    )
    return ids[:k], lps[:k], tids[:k], tlps[:k], True
