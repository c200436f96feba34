"""The logprob shapes OpenAI-compatible servers answer with, read into one form (no tokenizer, no I/O).

Contract: `read_logprobs(block)` takes a choice's `logprobs` value and returns a `Block` (shape,
positions, and `top_problem` when the alternatives cannot be lined up with the tokens), or None when the server sent none (null, absent, or an empty list: the answer is tokens only). Shapes:
  legacy   /v1/completions as OpenAI first defined it (vLLM, lpf serve, SGLang's OpenAI route):
           {"tokens": [str], "token_logprobs": [number|null], "top_logprobs": [{str: number}|null],
           "text_offset": [int]}
  content  the chat shape, also llama.cpp's llama-server on /v1/completions: {"content": [{"token": str,
           "logprob": number, "bytes": [int]|null, "id": int (llama.cpp), "top_logprobs": [{"token",
           "logprob", "bytes", "id"}]}]}; OpenAI's hosted API and vLLM's chat route send no ids.
Each position is a `Position`: the token as sent (string, id when the server gave one, bytes when it
gave them), its logprob exactly as sent (`MISSING` when the entry has none) and its alternatives
(`Alt`s, None when the server sent no list for it). A block of neither shape raises `RequestFailed`:
nothing in it can be paired with tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lpf.adapters.http import RequestFailed

MISSING = object()  # an entry with no logprob at all (distinct from null, which a server may send)


@dataclass
class Alt:
    token: Any = None  # the string as sent (may be "token_id:N")
    tid: Any = None  # the id as sent (llama.cpp's "id"), else None
    raw: Any = None  # the bytes as sent (a list of ints), else None
    logprob: Any = MISSING


@dataclass
class Position(Alt):
    top: list[Alt] | None = field(default=None)


@dataclass
class Block:
    shape: str  # legacy | content
    positions: list[Position]
    top_problem: str | None = None  # why the alternatives were not read (the tokens still count)


def read_logprobs(block: Any) -> Block | None:
    if block is None or block == [] or block == {}:
        return None
    if isinstance(block, dict) and "content" in block:
        content = block["content"]
        if content is None or content == []:
            return None
        if not isinstance(content, list):
            raise RequestFailed(f"logprobs.content is a JSON {type(content).__name__}, not a list")
        return Block("content", [_content_entry(e, pos) for pos, e in enumerate(content)])
    if isinstance(block, dict) and ("tokens" in block or "token_logprobs" in block):
        tokens, values = block.get("tokens"), block.get("token_logprobs")
        if not isinstance(tokens, list) or not isinstance(values, list):
            raise RequestFailed("answer's logprobs lack tokens / token_logprobs lists")
        if len(values) != len(tokens):
            raise RequestFailed(f"{len(values)} logprobs for {len(tokens)} tokens")
        top = block.get("top_logprobs")
        lined_up = isinstance(top, list) and len(top) == len(tokens)
        out = [
            Position(token=t, logprob=v, top=_legacy_top(top[i]) if lined_up else None)
            for i, (t, v) in enumerate(zip(tokens, values))
        ]
        problem = (
            None
            if top is None or lined_up
            else f"top_logprobs has {len(top) if isinstance(top, list) else 'no'} entries for {len(tokens)} tokens"
        )
        return Block("legacy", out, problem)
    raise RequestFailed(
        "answer's logprobs are neither the completions shape (tokens, token_logprobs) nor the chat shape (content)"
    )


def _legacy_top(entry: Any) -> list[Alt] | None:
    if entry is None:
        return None
    if isinstance(entry, dict):
        return [Alt(token=k, logprob=v) for k, v in entry.items()]
    if isinstance(entry, list):  # some servers send [{"token", "logprob"}] here too
        return [_alt(e) for e in entry if isinstance(e, dict)]
    return []


def _alt(e: dict) -> Alt:
    return Alt(token=e.get("token"), tid=e.get("id"), raw=e.get("bytes"), logprob=e.get("logprob", MISSING))


def _content_entry(e: Any, pos: int) -> Position:
    if not isinstance(e, dict):
        raise RequestFailed(f"logprobs.content[{pos}] is {type(e).__name__}, not an object")
    top = e.get("top_logprobs")
    alts = [_alt(t) for t in top if isinstance(t, dict)] if isinstance(top, list) else None
    return Position(
        token=e.get("token"), tid=e.get("id"), raw=e.get("bytes"), logprob=e.get("logprob", MISSING), top=alts
    )
