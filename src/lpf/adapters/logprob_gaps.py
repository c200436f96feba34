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
`gaps` counts the places an entry does not continue the text (0: every entry lines up with all of it,
or an entry gave nothing to line up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


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
