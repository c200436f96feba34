"""Streamed answers (`stream: true`) of /v1/completions and /v1/chat/completions, as vLLM 0.32 renders them.

Contract: `sse(loop, plans, req, tokenizer, info, response_id, created, chat)` is an async iterator of
server-sent events (`data: {json}\\n\\n`, then `data: [DONE]\\n\\n`). It submits the plans' requests to the
`EngineLoop` and, after each engine step, sends each choice the tokens it gained: text delta, logprobs
for exactly those positions (completions: `tokens`/`token_logprobs`/`top_logprobs`/`text_offset` with
offsets continuing the choice's text; chat: `content` entries), `token_ids` when `return_token_ids`
(`prompt_token_ids` in the choice's first chunk, or at the top of chat's first chunk). Chat opens each
choice with a `{"role": "assistant", "content": ""}` delta. The chunk with a choice's last tokens carries
its `finish_reason` and `stop_reason`; `stream_options.include_usage` adds a chunk with `choices: []` and
the usage. Text whose last token ends inside a UTF-8 character is held back until it completes (chat then
sends an empty delta only when logprobs or ids were asked, as vLLM does). A choice with stop strings is
sent when it finishes (cut where a stopping server stops; its tokens never depend on later ones). An
engine error mid-stream is sent as `data: {"error": {...}}` before `[DONE]`; a client that leaves takes
its requests back (the iterator is closed, the submit cancelled).
"""

from __future__ import annotations

import asyncio
import json
from contextlib import suppress

from lpf.serve.chat_api import chat_logprobs, top_k_of
from lpf.serve.openai_api import choice_output, completion_logprobs
from lpf.serve.protocol import ApiError, TokenText


def _event(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Choice:
    def __init__(self, index: int, plan, done):
        self.index, self.plan, self.req = index, plan, done
        self.sent_tokens, self.sent_text, self.opened, self.closed = 0, "", False, False


async def sse(loop, plans, req, tokenizer, info, response_id: str, created: int, chat: bool):
    k = top_k_of(req) if chat else req.logprobs
    text_of = TokenText(tokenizer, bool(req.return_tokens_as_token_ids))
    choices: list[_Choice] = []
    for p in plans:
        choices.extend(_Choice(len(choices) + i, p, r) for i, r in enumerate(p.requests))
    head = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created}
    head["model"] = info.name
    submit = asyncio.ensure_future(loop.submit([c.req for c in choices]))
    try:
        first = True
        while True:
            finished = submit.done()
            for c in choices:
                chunk = _advance(c, finished, chat, k, req, tokenizer, text_of)
                if chunk is None:
                    continue
                body = dict(head, choices=[chunk])
                if chat and first and req.return_token_ids:
                    body["prompt_token_ids"] = c.plan.prompt.token_ids
                if not chat:
                    body["usage"] = None
                first = False
                yield _event(body)
            if finished:
                break
            await asyncio.wait({submit, asyncio.ensure_future(loop.next_step())}, return_when=asyncio.FIRST_COMPLETED)
        error = submit.exception()
        failed = None if error is not None else next((r for r in submit.result() if r.error is not None), None)
        if error is not None or failed is not None:
            e = error if isinstance(error, ApiError) else ApiError(f"request {failed.request_id}: {failed.error}")
            if error is not None and not isinstance(error, ApiError):
                e = ApiError(f"{type(error).__name__}: {error}", 500, "InternalServerError")
            yield _event(e.body())
        elif (req.stream_options or {}).get("include_usage"):
            n_prompt = sum(len(p.prompt.token_ids) for p in plans)
            n_out = sum(c.sent_tokens for c in choices)
            usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out, "completion_tokens": n_out}
            yield _event(dict(head, choices=[], usage=usage))
        yield "data: [DONE]\n\n"
    finally:
        if not submit.done():  # the client left: the loop takes its requests out of the engine
            submit.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await submit


def _advance(c: _Choice, finished: bool, chat: bool, k, req, tokenizer, text_of) -> dict | None:
    """The chunk for what choice `c` gained since its last one, or None."""
    if c.closed:
        return None
    if chat and not c.opened:
        c.opened = True
        return {
            "index": c.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    done = finished and c.req.finish_reason is not None and c.req.error is None
    if finished and not done:  # refused or failed: the stream's error event says why
        c.closed = True
        return None
    if done:
        ids, text, finish, stop_reason = choice_output(tokenizer, c.plan, c.req, req.skip_special_tokens)
    elif c.plan.stops:
        return None  # sent whole once it finishes, cut at its stop string
    else:
        # the engine appends in its worker thread: take what every per-token list already holds
        r = c.req
        n = min(len(r.output_token_ids), len(r.logprobs), len(r.topk_ids), len(r.topk_logprobs))
        ids, finish, stop_reason = list(r.output_token_ids[:n]), None, None
        text = tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
        if text.endswith("\ufffd"):
            text = c.sent_text  # a character still incomplete: its bytes come with a later token
    new = ids[c.sent_tokens :]
    if not new and not done:
        return None
    delta = text[len(c.sent_text) :] if text.startswith(c.sent_text) else text
    r = c.req
    rows = [
        (t, r.logprobs[c.sent_tokens + i], r.topk_ids[c.sent_tokens + i], r.topk_logprobs[c.sent_tokens + i])
        for i, t in enumerate(new)
    ]
    ask_ids = bool(req.return_token_ids)
    if chat:
        if not delta and not done and k is None and not ask_ids:
            return None  # vLLM sends nothing for held-back text unless logprobs or ids were asked
        out = {
            "index": c.index,
            "delta": {"content": delta} if delta else {},
            "logprobs": None if k is None else chat_logprobs(rows, k, text_of),
            "finish_reason": finish,
        }
        if done:
            out["stop_reason"] = stop_reason
        if ask_ids:
            out["token_ids"] = new
    else:
        out = {
            "index": c.index,
            "text": delta,
            "logprobs": None if k is None else completion_logprobs(rows, k, text_of, len(c.sent_text)),
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "prompt_token_ids": c.plan.prompt.token_ids if ask_ids and c.sent_tokens == 0 and not c.sent_text else None,
            "token_ids": new if ask_ids else None,
        }
    c.sent_tokens, c.sent_text, c.closed = len(ids), c.sent_text + delta, done
    return out
