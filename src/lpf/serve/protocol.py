"""What `lpf serve`'s two wire formats share: errors, prompts, sampling, budgets, stop strings, token text.

Contract: `openai_api` (OpenAI /v1/completions as vLLM serves it) and `sglang_api` (SGLang's native
/generate) parse a request into a pydantic model, turn it into engine `Request`s with the helpers here
(`tokenize_prompts`, `make_sampling`, `engine_requests`, `output_budget`, `refuse_non_neutral`), or
raise `ApiError` (400 with a one-line reason, answered in vLLM's error shape). No torch here.

What lpf serve does not do is refused, never silently ignored: beam search,
logit bias, grammars, `prompt_logprobs=-1` (the whole vocabulary). Prompt logprobs (`prompt_logprobs`,
`echo` with `logprobs`, SGLang `logprob_start_len` inside the prompt) are the engine's own: it projects
the prompt rows of its prefill chunks through the same head as its samples (`SamplingParams.prompt_logprobs`).
Stop strings are applied to the finished output (tokens after the match are dropped), which gives
what a server that stops early returns, because a request's tokens never depend on later ones.

Logprobs are raw (log-softmax of the logits, before temperature / top-k / top-p). Choice i of a seeded
request uses the seed itself for i = 0 (so one request with seed S reproduces `lpf run` with that
request seed) and `request_seed(S, i)` for the others.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Union

from pydantic import Field, StrictInt, StrictStr

from lpf.builtin.request import Request
from lpf.core.errors import LpfError
from lpf.core.sampling import SamplingParams, request_seed

TokenId = Annotated[StrictInt, Field(ge=0)]
PromptField = Union[StrictStr, list[StrictStr], list[TokenId], list[list[TokenId]]]


class ApiError(Exception):
    """An error answered to the client as {"error": {message, type, param, code}} (vLLM's shape)."""

    def __init__(self, message: str, status: int = 400, type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the served model name clients must send
    root: str  # the model directory
    vocab_size: int
    max_context: int | None
    eos_token_id: int | None
    # with chunked prefill off the engine must fit prompt + outputs in one step's token budget
    # (a recompute after preemption), or the request would wait forever
    prefill_limit: int | None = None
    # the server's own default for requests that do not set one (`lpf serve --repetition-penalty`), as
    # servers whose routes apply a default penalty do
    repetition_penalty: float = 1.0
    # what the engine computes with, for /v1/models (`lpf.adapters.engine_config.builtin` + its faults)
    configuration: dict | None = None


@dataclass
class PromptIn:
    token_ids: list[int]
    text: str | None  # the text as sent (None for token-id prompts)


@dataclass
class Planned:
    """One prompt of an HTTP request and the engine requests (choices) generated for it."""

    prompt: PromptIn
    requests: list[Request]
    stops: list[str]
    max_tokens: int


def refuse_non_neutral(extra: dict | None, neutral: dict[str, tuple], where: str) -> None:
    for name, allowed in neutral.items():
        if extra and name in extra and extra[name] not in allowed:
            raise ApiError(f"{name}={extra[name]!r} is not supported by lpf serve ({where})", param=name)


# -- shared validation ---------------------------------------------------------------------------
def tokenize_prompts(prompt: Any, tokenizer, info: ModelInfo, key: str) -> list[PromptIn]:
    """A prompt field (text, token ids, or a list of either) -> validated prompts."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    elif isinstance(prompt, list):
        items = prompt
    else:
        raise ApiError(f"{key} is required", param=key)
    if not items:
        raise ApiError(f"{key} is empty", param=key)
    out = []
    for p in items:
        ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise ApiError("Prompt cannot be empty", param=key)
        bad = max(ids)
        if bad >= info.vocab_size:
            raise ApiError(f"Token id {bad} is out of vocabulary", param=key)
        if info.max_context is not None and len(ids) >= info.max_context:
            raise ApiError(
                f"This model's maximum context length is {info.max_context} tokens. However, your prompt "
                f"contains {len(ids)} input tokens, which leaves no room for output tokens. Please reduce "
                f"the length of the input prompt.",
                param="input_tokens",
            )
        out.append(PromptIn(ids, p if isinstance(p, str) else None))
    return out


def make_sampling(
    temperature: float,
    top_p: float,
    top_k: int,
    max_tokens: int,
    ignore_eos: bool,
    logprobs: int,
    prompt_logprobs: bool = False,
    penalties: dict | None = None,
) -> SamplingParams:
    try:
        return SamplingParams(
            **(penalties or {}),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except LpfError as e:
        raise ApiError(str(e)) from None


def engine_requests(
    prompt: PromptIn, ids: list[str], sampling: SamplingParams, max_tokens: int, seed: int | None, info: ModelInfo
) -> list[Request]:
    if seed is None:
        seeds = [secrets.randbits(31) for _ in ids]
    else:
        seeds = [seed if i == 0 else request_seed(seed, i) for i in range(len(ids))]
    return [
        Request(rid, list(prompt.token_ids), sampling, max_tokens, s, info.eos_token_id) for rid, s in zip(ids, seeds)
    ]


def output_budget(requested: int | None, prompt: PromptIn, info: ModelInfo, name: str) -> int:
    room = None if info.max_context is None else info.max_context - len(prompt.token_ids)
    if requested is None:
        if room is None:
            raise ApiError(f"{name} is required: the model config states no context length", param=name)
        return room
    if requested < 1:
        raise ApiError(
            f"{name} must be at least 1 (lpf serve generates at least one token), got {requested}", param=name
        )
    budget = requested if room is None else min(requested, room)
    if info.prefill_limit is not None and len(prompt.token_ids) + budget > info.prefill_limit:
        raise ApiError(
            f"prompt ({len(prompt.token_ids)} tokens) + {name} ({budget}) exceed max_num_batched_tokens "
            f"({info.prefill_limit}) and chunked prefill is off: the engine could never schedule it",
            param=name,
        )
    return budget


def apply_stop(tokenizer, ids: list[int], stops: list[str], skip_special: bool) -> tuple[int, str, str] | None:
    """(tokens kept, text before the stop string, the stop string) at the first token whose text
    contains a stop string, or None. The token completing the match is kept, as vLLM keeps it."""
    if not stops:
        return None
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=skip_special)
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if hits:
            at, s = min(hits)
            return k, text[:at], s
    return None


def prompt_entries(prompt_ids: list[int], done: Request) -> list[tuple[int, float | None, int | None, list, list]]:
    """Per prompt position (token id, logprob, rank, top-k ids, top-k logprobs) as the engine computed them;
    position 0 has nothing before it (logprob and rank None, no top-k)."""
    rows = done.prompt_rows() or []
    return [(prompt_ids[0], None, None, [], [])] + [
        (tid, lp, rank, ids, lps) for tid, (lp, rank, ids, lps) in zip(prompt_ids[1:], rows)
    ]


class TokenText:
    """Per-token strings as vLLM renders them: each id decoded alone, or 'token_id:N'."""

    def __init__(self, tokenizer, as_ids: bool):
        self.tokenizer, self.as_ids, self._cache = tokenizer, as_ids, {}

    def __call__(self, tid: int) -> str:
        if self.as_ids:
            return f"token_id:{tid}"
        if tid not in self._cache:
            self._cache[tid] = self.tokenizer.decode([tid])
        return self._cache[tid]
