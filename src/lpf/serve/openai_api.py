"""OpenAI /v1/completions as vLLM 0.32 serves it: request model, planning, rendering.

Contract: `CompletionRequest` parses the body (unknown fields ignored, as vLLM does; non-neutral values
of what lpf serve cannot do refused, `echo` and `prompt_logprobs` with `stream` too; `repetition_penalty`, `presence_penalty` and `frequency_penalty` applied,
the repetition penalty defaulting to the server's own, `ModelInfo.repetition_penalty`), `plan_completion` turns it into engine `Request`s (one per prompt
per choice) or raises `ApiError`, `render_completion` turns the finished requests into vLLM's exact
JSON (field names checked against its source). -inf logprobs are rendered -9999.0, as vLLM does.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from lpf.serve.protocol import (
    ApiError,
    ModelInfo,
    Planned,
    PromptField,
    TokenText,
    apply_stop,
    engine_requests,
    make_sampling,
    output_budget,
    prompt_entries,
    refuse_non_neutral,
    tokenize_prompts,
)


def clamp(lp: float) -> float | None:
    """vLLM's JSON number for a logprob: -inf as -9999.0; NaN (a broken engine) as null, since JSON has
    no NaN and one bad number must not turn the whole answer into a 500."""
    return None if math.isnan(lp) else max(lp, -9999.0)


COMPLETION_NEUTRAL = {
    "min_p": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "include_stop_str_in_output": (None, False),
    "prompt_embeds": (None,),
    "response_format": (None,),
    "structured_outputs": (None,),
    "logprob_token_ids": (None, []),
    "truncate_prompt_tokens": (None,),
}


class SamplingFields(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share (vLLM's names; its extensions beside OpenAI's)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: dict | None = None
    request_id: str | None = None
    repetition_penalty: float | None = None  # vLLM's extension; None: the server's default
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CompletionRequest(SamplingFields):
    prompt: PromptField | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    prompt_logprobs: int | None = None


def _penalties(req, info: ModelInfo) -> dict:
    rep = info.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty
    return {
        "repetition_penalty": rep,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
    }


def plan_completion(req: CompletionRequest, tokenizer, info: ModelInfo, base_id: str) -> list[Planned]:
    refuse_non_neutral(req.model_extra, COMPLETION_NEUTRAL, "/v1/completions")
    prompt_k = prompt_top_k(req)
    if req.stream and (req.echo or prompt_k is not None):
        raise ApiError("echo and prompt_logprobs are not supported with stream=true by lpf serve", param="stream")
    prompts = tokenize_prompts(req.prompt, tokenizer, info, "prompt")
    return plan_prompts(
        req, prompts, req.max_tokens if req.max_tokens is not None else 16, req.logprobs, prompt_k, info, base_id
    )


def plan_prompts(
    req,
    prompts: list,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_k: int | None,
    info: ModelInfo,
    base_id: str,
) -> list[Planned]:
    """Engine requests for each prompt and choice of `req` (a completions or chat body: its sampling fields,
    `n`, `seed`, `stop`, `ignore_eos`, penalties); `max_tokens` None: the room the context leaves."""
    if req.n < 1:
        raise ApiError(f"n must be at least 1, got {req.n}", param="n")
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(f"top_k must be -1 (disable), or at least 1, got {req.top_k}", param="top_k")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    plans = []
    for p_idx, prompt in enumerate(prompts):
        budget = output_budget(max_tokens, prompt, info, "max_tokens")
        sampling = make_sampling(
            1.0 if req.temperature is None else req.temperature,
            1.0 if req.top_p is None else req.top_p,
            max(req.top_k or 0, 0),
            budget,
            req.ignore_eos,
            max(logprobs or 0, prompt_k or 0),
            prompt_k is not None,
            _penalties(req, info),
        )
        ids = [f"{base_id}-{p_idx}"] if req.n == 1 else [f"{base_id}-{p_idx}-{c}" for c in range(req.n)]
        plans.append(Planned(prompt, engine_requests(prompt, ids, sampling, budget, req.seed, info), stops, budget))
    return plans


def prompt_top_k(req: CompletionRequest) -> int | None:
    """The top-k of prompt logprobs the request asks for (vLLM: `prompt_logprobs`, or `logprobs` under
    `echo`), None when it asks for none."""
    k = req.prompt_logprobs
    if k is None and req.echo and req.logprobs is not None:
        k = req.logprobs
    if k is not None and not 0 <= k <= 20:
        raise ApiError(
            f"prompt_logprobs must be in 0..20 (lpf serve does not return the whole vocabulary), got {k}",
            param="prompt_logprobs",
        )
    return k


def entry(tid: int, lp: float, ids: list[int], lps: list[float]) -> dict[int, float]:
    """vLLM's per-position dict: the token itself first, then the top-k by rank."""
    entries: dict[int, float] = {tid: lp}
    for alt, alp in zip(ids, lps):
        entries.setdefault(alt, alp)
    return entries


def completion_logprobs(rows: list[tuple[int, float | None, list, list]], k: int, text: TokenText, at: int = 0) -> dict:
    """`rows`: per position (token id, its logprob or None (echoed prompt position 0), top-k ids, logprobs);
    `at`: the text offset of the first (a streamed chunk's offsets continue the choice's text)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp, ids, lps in rows:
        tokens.append(text(tid))
        token_lps.append(None if lp is None else clamp(lp))
        # at most k + 1 entries, as vLLM cuts them
        tops.append(
            None if lp is None else {text(t): clamp(v) for t, v in list(entry(tid, lp, ids, lps).items())[: k + 1]}
        )
        offsets.append(at)
        at += len(tokens[-1])
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def _prompt_logprobs(entries, k: int, text: TokenText) -> list:
    """vLLM's `choices[].prompt_logprobs`: None for position 0, then {token id: {logprob, rank, decoded_token}}
    (`decoded_token` is the token's text whatever return_tokens_as_token_ids says: vLLM passes its
    Logprob objects through as they are)."""
    out: list = [None]
    for tid, lp, rank, ids, lps in entries[1:]:
        rows = list(entry(tid, lp, ids[:k], lps[:k]).items())
        out.append(
            {
                str(t): {"logprob": clamp(v), "rank": rank if t == tid else 1 + ids.index(t), "decoded_token": text(t)}
                for t, v in rows
            }
        )
    return out


def choice_output(tokenizer, plan: Planned, done, skip_special: bool) -> tuple[list[int], str, str, str | None]:
    """A finished choice as answered: (token ids, text, finish_reason, stop_reason), cut at a stop string."""
    ids, finish, stop_reason = list(done.output_token_ids), done.finish_reason, None
    out_text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    cut = apply_stop(tokenizer, ids, plan.stops, skip_special)
    if cut is not None:
        kept, out_text, stop_reason = cut
        ids, finish = ids[:kept], "stop"
    return ids, out_text, finish, stop_reason


def usage(n_prompt: int, n_out: int) -> dict:
    """The answer's `usage` block, as vLLM writes it on both routes."""
    return {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": None,
    }


def render_completion(
    req: CompletionRequest, plans: list[Planned], tokenizer, info: ModelInfo, response_id: str, created: int
) -> dict:
    text_of = TokenText(tokenizer, bool(req.return_tokens_as_token_ids))
    plain_text = TokenText(tokenizer, False)
    choices, n_prompt, n_out = [], 0, 0
    for plan in plans:
        prompt_text = plan.prompt.text
        if prompt_text is None and req.echo:
            prompt_text = tokenizer.decode(plan.prompt.token_ids)
        prompt_k = prompt_top_k(req)
        for done in plan.requests:
            entries = prompt_entries(plan.prompt.token_ids, done) if prompt_k is not None else None
            ids, out_text, finish, stop_reason = choice_output(tokenizer, plan, done, req.skip_special_tokens)
            rows = [(t, done.logprobs[i], done.topk_ids[i], done.topk_logprobs[i]) for i, t in enumerate(ids)]
            if req.echo and entries is not None:
                rows = [(t, lp, a, b) for t, lp, _, a, b in entries] + rows
            choices.append(
                {
                    "index": len(choices),
                    "text": (prompt_text + out_text) if req.echo else out_text,
                    "logprobs": None if req.logprobs is None else completion_logprobs(rows, req.logprobs, text_of),
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                    "token_ids": ids if req.return_token_ids else None,
                    "prompt_logprobs": None if entries is None else _prompt_logprobs(entries, prompt_k, plain_text),
                    "prompt_token_ids": plan.prompt.token_ids if req.return_token_ids else None,
                }
            )
            n_out += len(ids)
        n_prompt += len(plan.prompt.token_ids)
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": info.name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(n_prompt, n_out),
        "kv_transfer_params": None,
    }
