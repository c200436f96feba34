"""Wire formats of `lpf serve`: OpenAI /v1/completions as vLLM serves it, and SGLang's native /generate.

Contract: requests are parsed into pydantic models (unknown fields ignored, as both servers do), then
`plan_*` turns one HTTP request into engine `Request`s (one per prompt per choice) or raises `ApiError`
(400 with a one-line reason); `render_*` turns the finished engine requests back into the exact JSON
the real server returns (field names checked against vLLM 0.32 and SGLang sources). No torch here.

What lpf serve does not do is refused, never silently ignored: streaming, beam search, penalties,
logit bias, grammars, and prompt logprobs (`prompt_logprobs`, `echo` with `logprobs`, SGLang
`logprob_start_len` inside the prompt): the engine only projects the rows it samples from, so prompt
logprobs would need a second pass, and a reference model's numbers would be a lie about the engine.
Stop strings are applied to the finished output (tokens after the match are dropped), which gives
what a server that stops early returns, because a request's tokens never depend on later ones.

Logprobs are raw (log-softmax of the logits, before temperature / top-k / top-p), -inf clamped to
-9999.0 as vLLM does. Choice i of a seeded request uses the seed itself for i = 0 (so one request with
seed S reproduces `lpf run` with that request seed) and `request_seed(S, i)` for the others.
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from lpf.engine.request import Request
from lpf.errors import LpfError
from lpf.sampling import SamplingParams, request_seed

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


def _clamp(lp: float) -> float | None:
    """vLLM's JSON number for a logprob: -inf as -9999.0; NaN (a broken engine) as null, since JSON has
    no NaN and one bad number must not turn the whole answer into a 500."""
    return None if math.isnan(lp) else max(lp, -9999.0)


def _json_float(lp: float) -> float | None:
    """SGLang's (orjson) rendering of a logprob: non-finite numbers become null."""
    return lp if math.isfinite(lp) else None


def _refuse_non_neutral(extra: dict | None, neutral: dict[str, tuple], where: str) -> None:
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
            raise ApiError(f"This model's maximum context length is {info.max_context} tokens. However, your prompt "
                           f"contains {len(ids)} input tokens, which leaves no room for output tokens. Please reduce "
                           f"the length of the input prompt.", param="input_tokens")
        out.append(PromptIn(ids, p if isinstance(p, str) else None))
    return out


def _sampling(temperature: float, top_p: float, top_k: int, max_tokens: int, ignore_eos: bool,
              logprobs: int) -> SamplingParams:
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                              ignore_eos=ignore_eos, logprobs=logprobs)
    except LpfError as e:
        raise ApiError(str(e)) from None


def _requests(prompt: PromptIn, ids: list[str], sampling: SamplingParams, max_tokens: int, seed: int | None,
              info: ModelInfo) -> list[Request]:
    if seed is None:
        seeds = [secrets.randbits(31) for _ in ids]
    else:
        seeds = [seed if i == 0 else request_seed(seed, i) for i in range(len(ids))]
    return [Request(rid, list(prompt.token_ids), sampling, max_tokens, s, info.eos_token_id)
            for rid, s in zip(ids, seeds)]


def _budget(requested: int | None, prompt: PromptIn, info: ModelInfo, name: str) -> int:
    room = None if info.max_context is None else info.max_context - len(prompt.token_ids)
    if requested is None:
        if room is None:
            raise ApiError(f"{name} is required: the model config states no context length", param=name)
        return room
    if requested < 1:
        raise ApiError(f"{name} must be at least 1 (lpf serve generates at least one token), got {requested}", param=name)
    budget = requested if room is None else min(requested, room)
    if info.prefill_limit is not None and len(prompt.token_ids) + budget > info.prefill_limit:
        raise ApiError(f"prompt ({len(prompt.token_ids)} tokens) + {name} ({budget}) exceed max_num_batched_tokens "
                       f"({info.prefill_limit}) and chunked prefill is off: the engine could never schedule it",
                       param=name)
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


# -- OpenAI /v1/completions ----------------------------------------------------------------------
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
    _refuse_non_neutral(req.model_extra, COMPLETION_NEUTRAL, "/v1/completions")
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
        max_tokens = _budget(req.max_tokens if req.max_tokens is not None else 16, prompt, info, "max_tokens")
        sampling = _sampling(1.0 if req.temperature is None else req.temperature,
                             1.0 if req.top_p is None else req.top_p, max(req.top_k or 0, 0), max_tokens,
                             req.ignore_eos, req.logprobs or 0)
        ids = [f"{base_id}-{p_idx}"] if req.n == 1 else [f"{base_id}-{p_idx}-{c}" for c in range(req.n)]
        plans.append(Planned(prompt, _requests(prompt, ids, sampling, max_tokens, req.seed, info), stops, max_tokens))
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


# -- SGLang /generate ----------------------------------------------------------------------------
class SglSampling(BaseModel):
    """SGLang's SamplingParams: an unknown key is an error there too."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = 128
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    stop: str | list[str] | None = None
    n: int | None = 1
    sampling_seed: int | None = None
    # accepted only at their neutral values (see SGL_NEUTRAL)
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    no_stop_trim: bool | None = None
    spaces_between_special_tokens: bool | None = None
    custom_params: dict | None = None
    stream_interval: int | None = None


SGL_NEUTRAL = {
    "min_p": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_new_tokens": (None, 0), "stop_token_ids": (None, []),
    "stop_regex": (None, [], ""), "json_schema": (None,), "regex": (None,), "ebnf": (None,),
    "structural_tag": (None,), "logit_bias": (None, {}), "no_stop_trim": (None, False),
    "spaces_between_special_tokens": (None, True), "custom_params": (None, {}), "stream_interval": (None,),
}


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False


@dataclass
class SglPlanned(Planned):
    rids: list[str] = field(default_factory=list)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    skip_special: bool = True


def _per_item(value, i: int, n: int, name: str):
    if isinstance(value, list):
        if len(value) != n:
            raise ApiError(f"{name} has {len(value)} entries for {n} prompts", param=name)
        return value[i]
    return value


def plan_generate(req: GenerateRequest, tokenizer, info: ModelInfo) -> tuple[list[SglPlanned], bool]:
    """(plans, batch): batch is True when the response must be a list."""
    if req.stream:
        raise ApiError("stream=true is not supported by lpf serve", param="stream")
    if (req.text is None) == (req.input_ids is None):
        raise ApiError("Either text or input_ids should be provided (exactly one).")
    key = "text" if req.text is not None else "input_ids"
    raw = req.text if req.text is not None else req.input_ids
    batch = isinstance(raw, list) and (key == "text" or (bool(raw) and isinstance(raw[0], list)))
    prompts = tokenize_prompts(raw, tokenizer, info, key)
    plans = []
    for i, prompt in enumerate(prompts):
        try:
            sp = SglSampling(**(_per_item(req.sampling_params, i, len(prompts), "sampling_params") or {}))
        except Exception as e:  # pydantic's ValidationError: name the bad keys in one line
            errors = getattr(e, "errors", lambda: [])()
            what = "; ".join(f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in errors) or str(e)
            raise ApiError(f"sampling_params: {what}", param="sampling_params") from None
        _refuse_non_neutral(sp.model_dump(), SGL_NEUTRAL, "/generate sampling_params")
        n = sp.n or 1
        if n < 1:
            raise ApiError(f"n must be at least 1, got {n}", param="n")
        start = _per_item(req.logprob_start_len, i, len(prompts), "logprob_start_len")
        want_lp = bool(_per_item(req.return_logprob, i, len(prompts), "return_logprob"))
        if want_lp and start is not None and start != -1:
            if start > len(prompt.token_ids):
                raise ApiError(f"logprob_start_len ({start}) is higher than the number of input tokens "
                               f"({len(prompt.token_ids)}). Request with a lower logprob_start_len.")
            if start < len(prompt.token_ids):
                raise ApiError("input (prompt) logprobs are not supported by lpf serve: use logprob_start_len=-1",
                               param="logprob_start_len")
        top_n = _per_item(req.top_logprobs_num, i, len(prompts), "top_logprobs_num") or 0
        temperature = 1.0 if sp.temperature is None else sp.temperature
        top_k = -1 if sp.top_k is None else sp.top_k
        if top_k == 0 or top_k < -1:
            raise ApiError(f"top_k must be -1 (disable) or at least 1, got {top_k}.", param="top_k")
        max_tokens = _budget(sp.max_new_tokens, prompt, info, "max_new_tokens")
        sampling = _sampling(temperature, 1.0 if sp.top_p is None else sp.top_p,
                             0 if top_k == -1 or top_k >= info.vocab_size else top_k, max_tokens,
                             bool(sp.ignore_eos), top_n if want_lp else 0)
        rid = _per_item(req.rid, i, len(prompts), "rid") or uuid.uuid4().hex
        rids = [rid] if n == 1 else [f"{rid}-{c}" for c in range(n)]
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        plans.append(SglPlanned(prompt, _requests(prompt, rids, sampling, max_tokens, sp.sampling_seed, info),
                                stops, max_tokens, rids=rids, return_logprob=want_lp, top_logprobs_num=top_n,
                                skip_special=sp.skip_special_tokens is not False))
    return plans, batch or any(len(p.requests) > 1 for p in plans)


def render_generate(plans: list[SglPlanned], tokenizer, return_text: bool, now: float | None = None) -> list[dict]:
    now = time.time() if now is None else now
    out = []
    text_of = TokenText(tokenizer, False)

    def triple(lp: float, tid: int) -> list:
        return [_json_float(lp), tid, text_of(tid) if return_text else None]

    for plan in plans:
        for rid, done in zip(plan.rids, plan.requests):
            ids = list(done.output_token_ids)
            text = tokenizer.decode(ids, skip_special_tokens=plan.skip_special)
            if done.finish_reason == "stop" and ids and ids[-1] == done.eos_token_id:
                finish = {"type": "stop", "matched": done.eos_token_id}
            else:
                finish = {"type": "length", "length": plan.max_tokens}
            cut = apply_stop(tokenizer, ids, plan.stops, plan.skip_special)
            if cut is not None:
                kept, text, matched = cut
                ids, finish = ids[:kept], {"type": "stop", "matched": matched}
            meta: dict = {"id": rid, "finish_reason": finish, "prompt_tokens": len(plan.prompt.token_ids),
                          "weight_version": "default", "total_retractions": done.num_preemptions}
            if plan.return_logprob:
                meta["input_token_logprobs"] = []
                meta["output_token_logprobs"] = [triple(done.logprobs[i], t) for i, t in enumerate(ids)]
                if plan.top_logprobs_num > 0:
                    meta["input_top_logprobs"] = []
                    meta["output_top_logprobs"] = [
                        [triple(lp, t) for t, lp in zip(done.topk_ids[i], done.topk_logprobs[i])]
                        for i in range(len(ids))]
            meta.update({"completion_tokens": len(ids), "cached_tokens": 0,
                         "e2e_latency": (done.t_finish or now) - done.t_arrival})
            out.append({"text": text, "output_ids": ids, "meta_info": meta})
    return out
