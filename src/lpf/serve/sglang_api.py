"""SGLang's native /generate: request model, planning, rendering.

Contract: `GenerateRequest` parses the body (`text` or `input_ids`, single or batch; SGLang's
sampling params, where an unknown key is an error as it is there), `plan_generate` turns it into
engine `Request`s or raises `ApiError`, `render_generate` answers in SGLang's shape (text +
meta_info with `output_token_logprobs` as [logprob, token_id, text|null]; field names checked against
the sgl-project/sglang sources). Non-finite logprobs are rendered null, as SGLang's orjson does.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, StrictStr

from lpf.serve.protocol import (
    ApiError,
    ModelInfo,
    Planned,
    TokenId,
    TokenText,
    apply_stop,
    engine_requests,
    make_sampling,
    output_budget,
    prompt_entries,
    refuse_non_neutral,
    tokenize_prompts,
)


def _json_float(lp: float) -> float | None:
    """SGLang's (orjson) rendering of a logprob: non-finite numbers become null."""
    return lp if math.isfinite(lp) else None


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
    "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_new_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "stop_regex": (None, [], ""),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "no_stop_trim": (None, False),
    "spaces_between_special_tokens": (None, True),
    "custom_params": (None, {}),
    "stream_interval": (None,),
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
    logprob_start: int | None = None  # first prompt position whose logprob is returned (None: outputs only)


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
        refuse_non_neutral(sp.model_dump(), SGL_NEUTRAL, "/generate sampling_params")
        n = sp.n or 1
        if n < 1:
            raise ApiError(f"n must be at least 1, got {n}", param="n")
        start = _per_item(req.logprob_start_len, i, len(prompts), "logprob_start_len")
        want_lp = bool(_per_item(req.return_logprob, i, len(prompts), "return_logprob"))
        if want_lp and start is not None and start != -1:
            if start > len(prompt.token_ids) or start < -1:
                raise ApiError(
                    f"logprob_start_len ({start}) is higher than the number of input tokens "
                    f"({len(prompt.token_ids)}). Request with a lower logprob_start_len."
                )
        logprob_start = start if want_lp and start is not None and 0 <= start < len(prompt.token_ids) else None
        top_n = _per_item(req.top_logprobs_num, i, len(prompts), "top_logprobs_num") or 0
        temperature = 1.0 if sp.temperature is None else sp.temperature
        top_k = -1 if sp.top_k is None else sp.top_k
        if top_k == 0 or top_k < -1:
            raise ApiError(f"top_k must be -1 (disable) or at least 1, got {top_k}.", param="top_k")
        max_tokens = output_budget(sp.max_new_tokens, prompt, info, "max_new_tokens")
        sampling = make_sampling(
            temperature,
            1.0 if sp.top_p is None else sp.top_p,
            0 if top_k == -1 or top_k >= info.vocab_size else top_k,
            max_tokens,
            bool(sp.ignore_eos),
            top_n if want_lp else 0,
            logprob_start is not None,
        )
        rid = _per_item(req.rid, i, len(prompts), "rid") or uuid.uuid4().hex
        rids = [rid] if n == 1 else [f"{rid}-{c}" for c in range(n)]
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        plans.append(
            SglPlanned(
                prompt,
                engine_requests(prompt, rids, sampling, max_tokens, sp.sampling_seed, info),
                stops,
                max_tokens,
                rids=rids,
                return_logprob=want_lp,
                top_logprobs_num=top_n,
                skip_special=sp.skip_special_tokens is not False,
                logprob_start=logprob_start,
            )
        )
    return plans, batch or any(len(p.requests) > 1 for p in plans)


def render_generate(plans: list[SglPlanned], tokenizer, return_text: bool, now: float | None = None) -> list[dict]:
    now = time.time() if now is None else now
    out = []
    text_of = TokenText(tokenizer, False)

    def triple(lp: float | None, tid: int) -> list:
        return [None if lp is None else _json_float(lp), tid, text_of(tid) if return_text else None]

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
            meta: dict = {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(plan.prompt.token_ids),
                "weight_version": "default",
                "total_retractions": done.num_preemptions,
            }
            if plan.return_logprob:
                # SGLang: from logprob_start_len on, position 0's logprob null (nothing precedes it)
                prompt = (
                    []
                    if plan.logprob_start is None
                    else prompt_entries(plan.prompt.token_ids, done)[plan.logprob_start :]
                )
                meta["input_token_logprobs"] = [triple(lp, t) for t, lp, _, _, _ in prompt]
                meta["output_token_logprobs"] = [triple(done.logprobs[i], t) for i, t in enumerate(ids)]
                if plan.top_logprobs_num > 0:
                    meta["input_top_logprobs"] = [
                        None if lp is None else [triple(v, a) for a, v in zip(ia, va)] for _, lp, _, ia, va in prompt
                    ]
                    meta["output_top_logprobs"] = [
                        [triple(lp, t) for t, lp in zip(done.topk_ids[i], done.topk_logprobs[i])]
                        for i in range(len(ids))
                    ]
            meta.update(
                {
                    "completion_tokens": len(ids),
                    "cached_tokens": 0,
                    "e2e_latency": (done.t_finish or now) - done.t_arrival,
                }
            )
            out.append({"text": text, "output_ids": ids, "meta_info": meta})
    return out
