"""OpenAI /v1/chat/completions as vLLM 0.32 serves it: request model, planning, rendering.

Contract: `ChatRequest` parses the body (unknown fields ignored, as vLLM does; tools, grammars and other
features lpf serve lacks refused when non-neutral), `plan_chat` renders the messages to prompt token ids
with `lpf.core.chat.render` (the model's own chat template: what `lpf run --engine openai` scores a
chat workload against) and plans engine requests as /v1/completions does (`openai_api.plan_prompts`),
`render_chat` answers vLLM's chat JSON: `message` {role, content, ...}, `logprobs` {"content": [{token,
logprob, bytes, top_logprobs}]} with `top_logprobs` the first k of the token itself then its top-k (as
vLLM cuts its per-position dict), `token_ids` per choice and `prompt_token_ids` at the top when
`return_token_ids`. `chat_logprobs` renders positions for a streamed chunk too.
"""

from __future__ import annotations

from lpf.core.chat import check_messages, render
from lpf.core.errors import LpfError
from lpf.serve.openai_api import SamplingFields, choice_output, clamp, entry, plan_prompts, usage
from lpf.serve.protocol import ApiError, ModelInfo, Planned, PromptIn, TokenText, refuse_non_neutral

CHAT_NEUTRAL = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "min_p": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "best_of": (None, 1),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "include_stop_str_in_output": (None, False),
    "structured_outputs": (None,),
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
}


class ChatRequest(SamplingFields):
    messages: list | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


def top_k_of(req: ChatRequest) -> int | None:
    """The alternatives per position the request asks for (None: no logprobs)."""
    if not req.logprobs:
        if req.top_logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        return None
    k = req.top_logprobs or 0
    if not 0 <= k <= 20:
        raise ApiError(f"top_logprobs must be in 0..20, got {k}", param="top_logprobs")
    return k


def plan_chat(req: ChatRequest, tokenizer, info: ModelInfo, base_id: str) -> list[Planned]:
    refuse_non_neutral(req.model_extra, CHAT_NEUTRAL, "/v1/chat/completions")
    try:
        messages = check_messages(req.messages, "messages")
        ids = render(tokenizer, messages)
    except LpfError as e:
        raise ApiError(str(e), param="messages") from None
    if info.max_context is not None and len(ids) >= info.max_context:
        raise ApiError(
            f"This model's maximum context length is {info.max_context} tokens. However, your messages "
            f"render to {len(ids)} input tokens, which leaves no room for output tokens.",
            param="messages",
        )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return plan_prompts(req, [PromptIn(ids, None)], max_tokens, top_k_of(req), None, info, base_id)


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(rows: list[tuple[int, float, list, list]], k: int, text: TokenText) -> dict:
    """vLLM's chat `logprobs`: per position the token, its logprob and bytes, and `top_logprobs`."""
    content = []
    for tid, lp, ids, lps in rows:
        token = text(tid)
        tops = [
            {"token": text(t), "logprob": clamp(v), "bytes": _token_bytes(text(t))}
            for t, v in list(entry(tid, lp, ids, lps).items())[:k]
        ]
        content.append({"token": token, "logprob": clamp(lp), "bytes": _token_bytes(token), "top_logprobs": tops})
    return {"content": content}


def message(content: str) -> dict:
    return {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
        "reasoning_content": None,
    }


def render_chat(
    req: ChatRequest, plans: list[Planned], tokenizer, info: ModelInfo, response_id: str, created: int
) -> dict:
    text_of = TokenText(tokenizer, bool(req.return_tokens_as_token_ids))
    k = top_k_of(req)
    plan = plans[0]
    choices, n_out = [], 0
    for done in plan.requests:
        ids, out_text, finish, stop_reason = choice_output(tokenizer, plan, done, req.skip_special_tokens)
        rows = [(t, done.logprobs[i], done.topk_ids[i], done.topk_logprobs[i]) for i, t in enumerate(ids)]
        choices.append(
            {
                "index": len(choices),
                "message": message(out_text),
                "logprobs": None if k is None else chat_logprobs(rows, k, text_of),
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": ids if req.return_token_ids else None,
            }
        )
        n_out += len(ids)
    n_prompt = len(plan.prompt.token_ids)
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": info.name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(n_prompt, n_out),
        "prompt_logprobs": None,
        "prompt_token_ids": plan.prompt.token_ids if req.return_token_ids else None,
        "kv_transfer_params": None,
    }
