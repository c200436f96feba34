"""An OpenAI-compatible answer's output token ids, where its logprob entries alone do not give them.

Contract (called by `lpf.adapters.openai` while it parses an answer; `token_map` is its `TokenMap`):
- `sampled_ids(token_map, positions, text, finish, eos)`: each logprob entry's token mapped to one id on
  its own, and those that map to nothing (a `''` token with `bytes: null`: a special token whose text the
  server skipped) placed from the answer's text; a token neither way places fails the request.
- `tokens_only(token_map, choice, text, usage, finish, problems, eos, engine)`: an answer without logprobs:
  the server's `token_ids`, else its text re-encoded (the stop token added when the server counts it and
  skipped its text); what does not add up is recorded in `problems`, never dropped. `engine` counts the
  shape (`returned`) and checks the ids (`check_ids`).
- `empty_stop(block, text, finish, usage, eos)`: an answer that stopped before its first token (no text,
  no logprob entry, no token counted), which the caller keeps as the end-of-sequence token.
- `counts_more(claimed, ids)`: the server counts more completion tokens than it sent entries for.
"""

from __future__ import annotations

from typing import Any

from lpf.adapters.http import RequestFailed


def empty_stop(block, text, finish, usage: dict, eos: int | None) -> bool:
    """An answer that stopped before its first token: no text, no logprob entry, no token counted."""
    return (
        text == ""
        and finish == "stop"
        and not usage.get("completion_tokens")
        and (block is None or not block.positions)
        and eos is not None
    )


def sampled_ids(token_map, positions, text, finish, eos: int | None) -> list[int]:
    """The sampled tokens' ids: each mapped on its own, and those that map to nothing from the answer's text."""
    strict = token_map.mode == "server"  # server ids only: nothing else places a token
    ids = [token_map.resolve(p.token, p.tid, p.raw, pos, strict=strict) for pos, p in enumerate(positions)]
    if None not in ids:
        return ids
    filled = token_map.by_text(ids, [p.token for p in positions], text, eos if finish == "stop" else None)
    if filled is None:
        pos = ids.index(None)
        raise RequestFailed(
            f"token {positions[pos].token!r} at position {pos} does not map back to one token id of the "
            f"local tokenizer, nor does the answer's text place it"
        )
    return filled


def tokens_only(token_map, choice: dict, text, usage: dict, finish, problems, eos: int | None, engine) -> list[int]:
    """The output ids of an answer without logprobs: the server's `token_ids`, else its text re-encoded."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        engine.check_ids(ids)
        engine.returned["tokens only (ids)"] += 1
        claimed = usage.get("completion_tokens")
        if isinstance(claimed, int) and claimed != len(ids):
            problems.add("token_count", f"the server counts {claimed} completion tokens but returned {len(ids)} ids")
        return list(ids)
    if not isinstance(text, str) or not text and not usage.get("completion_tokens"):
        raise RequestFailed("the answer has neither logprobs nor token ids nor text")
    ids, exact = token_map.text_ids(text)
    engine.returned["tokens only (text)"] += 1
    claimed = usage.get("completion_tokens")
    if isinstance(claimed, int) and claimed == len(ids) + 1 and finish == "stop" and eos is not None:
        ids.append(eos)  # the stop token: its text is skipped, the server counts it
    elif isinstance(claimed, int) and claimed != len(ids):
        problems.add(
            "retokenized",
            f"its text re-encodes to {len(ids)} tokens; the server counts {claimed} "
            f"(the tokens scored are not the server's)",
        )
    if not exact:
        problems.add("retokenized", "its text does not re-encode to tokens that decode back to it")
    return ids


def counts_more(claimed: Any, ids: list) -> bool:
    """The server counts more completion tokens than it sent logprob entries for."""
    return isinstance(claimed, int) and not isinstance(claimed, bool) and claimed > len(ids)
