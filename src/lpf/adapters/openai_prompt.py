"""What an OpenAI-compatible answer says about its prompt: checked against the stored one, and its logprobs read.

Contract (pure: an answer's parts in, plain data out; problems noted on the caller's `Problems`):
- `check(req, body, choice, usage, chat, problems)`: the server's prompt against the stored one (the
  reference's tokenization or chat rendering): its `prompt_token_ids` (vLLM's `return_token_ids`, at the
  top or in the choice) or else `usage.prompt_tokens` must be the stored prompt's; a mismatch is noted as
  `chat_template` on the chat route (the server rendered the messages differently), else `prompt_tokens`.
- `echoed(req, ids, logprobs, top, top_k, problems)`: (logprobs, top-k ids, top-k logprobs) of prompt
  positions 1..P-1 from an answer asked with `echo` (its tokens start with the prompt); `top_k(top, n,
  what)` is the engine's reading of top-k alternatives. None, noted as `echo`, when the echo is not the
  prompt; `RequestFailed` when it is no longer than the prompt.
- `vllm_field(req, field, k, problems)`: the same from vLLM's `prompt_logprobs` ([null, {token id:
  {logprob, rank, ...}}, ...], one per prompt token), the best k alternatives kept; None, noted as
  `prompt_logprobs`, when it is not one entry per prompt token.
"""

from __future__ import annotations

from typing import Any, Callable

from lpf.adapters.http import RequestFailed
from lpf.adapters.remote import Problems, as_logprob
from lpf.core.workload import EngineRequest


def check(req: EngineRequest, body: dict, choice: dict, usage: dict, chat: bool, problems: Problems) -> None:
    ours = list(req.prompt_token_ids)
    theirs = body.get("prompt_token_ids", choice.get("prompt_token_ids"))
    kind = "chat_template" if chat else "prompt_tokens"
    how = "renders the messages with another chat template" if chat else "tokenized the prompt differently"
    if isinstance(theirs, list) and theirs and all(isinstance(t, int) for t in theirs):
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            problems.add(
                kind,
                f"the server's prompt ({len(theirs)} tokens) differs from the reference's "
                f"({len(ours)}) at position {at}: the server {how}",
            )
        return
    n = usage.get("prompt_tokens")
    if isinstance(n, int) and not isinstance(n, bool) and n != len(ours):
        problems.add(
            kind, f"the server counts {n} prompt tokens, the reference's prompt has {len(ours)}: the server {how}"
        )


def echoed(
    req: EngineRequest, ids: list, logprobs: list, top: Any, top_k: Callable, problems: Problems
) -> tuple[list, list, list] | None:
    prompt = list(req.prompt_token_ids)
    n = len(prompt)
    if len(ids) <= n:
        raise RequestFailed(f"echo returned {len(ids)} tokens for a prompt of {n} and at least one output")
    if ids[:n] != prompt:
        at = next(i for i, (a, b) in enumerate(zip(ids, prompt)) if a != b)
        problems.add("echo", f"the echoed tokens differ from the prompt at position {at} (prompt logprobs not stored)")
        return None
    p_ids, p_lps = top_k(top[1:n] if isinstance(top, list) else top, n - 1, "top_logprobs (prompt)")
    return logprobs[1:n], p_ids, p_lps


def vllm_field(req: EngineRequest, field: Any, k: int, problems: Problems) -> tuple[list, list, list] | None:
    prompt = list(req.prompt_token_ids)
    if not isinstance(field, list) or len(field) != len(prompt):
        problems.add(
            "prompt_logprobs",
            f"prompt_logprobs has {len(field) if isinstance(field, list) else 'no'} "
            f"entries for {len(prompt)} prompt tokens",
        )
        return None
    lps, ids_out, lps_out = [], [], []
    for pos, (tid, entry) in enumerate(zip(prompt[1:], field[1:]), 1):
        pairs = {}
        for key, value in entry.items() if isinstance(entry, dict) else ():
            v = value.get("logprob") if isinstance(value, dict) else value
            if str(key).lstrip("-").isdigit():
                pairs[int(key)] = v
        lps.append(problems.logprob(pairs.get(tid), pos))
        best = sorted(((as_logprob(v, pos), t) for t, v in pairs.items()), key=lambda p: -p[0])
        best = [(v, t) for v, t in best if v == v][:k]
        ids_out.append([t for _, t in best])
        lps_out.append([v for v, _ in best])
    return lps, ids_out, lps_out
