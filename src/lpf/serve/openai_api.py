"""OpenAI /v1/completions as vLLM 0.32 serves it: request model, planning, rendering.

Contract: `CompletionRequest` parses the body (unknown fields ignored, as vLLM does; non-neutral values
of what lpf serve cannot do refused), `plan_completion` turns it into engine `Request`s (one per prompt
per choice) or raises `ApiError`, `render_completion` turns the finished requests into vLLM's exact
JSON (field names checked against its source). -inf logprobs are rendered -9999.0, as vLLM does.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from lpf.builtin.request import Request
from lpf.serve.protocol import (ApiError, ModelInfo, Planned, PromptField, TokenText, apply_stop, engine_requests,
                                make_sampling, output_budget, refuse_non_neutral, tokenize_prompts)


def _clamp(lp: float) -> float | None:
    """vLLM's JSON number for a logprob: -inf as -9999.0; NaN (a broken engine) as null, since JSON has
    no NaN and one bad number must not turn the whole answer into a 500."""
    return None if math.isnan(lp) else max(lp, -9999.0)

COMPLETION_NEUTRAL = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0), "logit_bias": (None, {}), "use_beam_search": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "min_tokens": (None, 0), "stop_token_ids": (None, []), "allowed_token_ids": (None,),
    "bad_words": (None, []), "include_stop_str_in_output": (None, False), "prompt_embeds": (None,),
    "response_format": (None,), "structured_outputs": (None,), "logprob_token_ids": (None, []),
    "truncate_prompt_tokens": (None,),
}


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: PromptField | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    echo: bool | None = False
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    request_id: str | None = None


def plan_completion(req: CompletionRequest, tokenizer, info: ModelInfo, base_id: str) -> list[Planned]:
    refuse_non_neutral(req.model_extra, COMPLETION_NEUTRAL, "/v1/completions")
    if req.stream:
        raise ApiError("stream=true is not supported by lpf serve: request the whole completion", param="stream")
    if req.prompt_logprobs is not None:
        raise ApiError("prompt_logprobs is not supported by lpf serve: the engine computes logprobs only for "
                       "sampled positions", param="prompt_logprobs")
    if req.echo and req.logprobs is not None:
        raise ApiError("echo with logprobs needs prompt logprobs, which lpf serve does not compute; "
                       "use echo without logprobs, or logprobs without echo", param="echo")
    if req.n < 1:
        raise ApiError(f"n must be at least 1, got {req.n}", param="n")
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(f"top_k must be -1 (disable), or at least 1, got {req.top_k}", param="top_k")
    prompts = tokenize_prompts(req.prompt, tokenizer, info, "prompt")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    plans = []
    for p_idx, prompt in enumerate(prompts):
        max_tokens = output_budget(req.max_tokens if req.max_tokens is not None else 16, prompt, info, "max_tokens")
        sampling = make_sampling(1.0 if req.temperature is None else req.temperature,
                             1.0 if req.top_p is None else req.top_p, max(req.top_k or 0, 0), max_tokens,
                             req.ignore_eos, req.logprobs or 0)
        ids = [f"{base_id}-{p_idx}"] if req.n == 1 else [f"{base_id}-{p_idx}-{c}" for c in range(req.n)]
        plans.append(Planned(prompt, engine_requests(prompt, ids, sampling, max_tokens, req.seed, info), stops, max_tokens))
    return plans


def _completion_logprobs(ids: list[int], done: Request, k: int, text: TokenText) -> dict:
    tokens, token_lps, tops, offsets, at = [], [], [], [], 0
    for i, tid in enumerate(ids):
        tokens.append(text(tid))
        token_lps.append(_clamp(done.logprobs[i]))
        # vLLM's dict: the sampled token first, then the top-k by rank; at most k + 1 entries
        entries: dict[int, float] = {tid: done.logprobs[i]}
        for alt, lp in zip(done.topk_ids[i], done.topk_logprobs[i]):
            entries.setdefault(alt, lp)
        tops.append({text(t): _clamp(lp) for t, lp in list(entries.items())[:k + 1]})
        offsets.append(at)
        at += len(tokens[-1])
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def render_completion(req: CompletionRequest, plans: list[Planned], tokenizer, info: ModelInfo,
                      response_id: str, created: int) -> dict:
    text_of = TokenText(tokenizer, bool(req.return_tokens_as_token_ids))
    choices, n_prompt, n_out = [], 0, 0
    for plan in plans:
        prompt_text = plan.prompt.text
        if prompt_text is None and req.echo:
            prompt_text = tokenizer.decode(plan.prompt.token_ids)
        for done in plan.requests:
            ids, finish, stop_reason = list(done.output_token_ids), done.finish_reason, None
            out_text = tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
            cut = apply_stop(tokenizer, ids, plan.stops, req.skip_special_tokens)
            if cut is not None:
                kept, out_text, stop_reason = cut
                ids, finish = ids[:kept], "stop"
            choices.append({
                "index": len(choices),
                "text": (prompt_text + out_text) if req.echo else out_text,
                "logprobs": None if req.logprobs is None else _completion_logprobs(ids, done, req.logprobs, text_of),
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": ids if req.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": plan.prompt.token_ids if req.return_token_ids else None,
            })
            n_out += len(ids)
        n_prompt += len(plan.prompt.token_ids)
    return {"id": response_id, "object": "text_completion", "created": created, "model": info.name,
            "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out, "completion_tokens": n_out,
                      "prompt_tokens_details": None},
            "kv_transfer_params": None}
