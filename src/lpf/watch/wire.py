"""What a sampled request asks the upstream beyond what its client asked, and how the answer is put back.

Contract (no I/O, no tokenizer):
- `sampleable(route, body)`: whether a parsed client body can be recorded at all (one prompt, one choice:
  `n` absent or 1, no `echo`, no `best_of`); the others pass through unsampled.
- `augment(route, body, k, refused) -> (sent, Added)`: the body sent upstream for a sampled request: the
  client's own, plus logprobs (completions `logprobs: k`; chat `logprobs: true, top_logprobs: k`) when it
  asked for none, plus vLLM's `return_token_ids` (lpf serve has it too) when it did not set it. Fields the
  upstream refused before (`refused`, names) are not added. The client's own values are never changed:
  a client that asked for `logprobs: 2` gets 2 alternatives and lpf records those 2.
- `strip(answer, added)`: the answer (a whole response, or one streamed chunk) with what `Added` says was
  added put back as vLLM renders it unasked, in place: `logprobs`, `token_ids`, `prompt_token_ids` null
  where they appear (vLLM sets them to None explicitly, so even its `exclude_unset` chunks carry them as
  null; a server that sends none of them is left as it is).
- `extra_chunk(route, chunk, body)`: whether a streamed chat chunk exists only because lpf asked for more
  (vLLM sends a chunk with an empty delta for tokens whose text it holds back only when logprobs or token
  ids were asked): dropped, so the client gets the events a direct call gets.
- `Collected`: the pieces of one answer a recording needs, fed whole responses (`add_answer`) or streamed
  chunks (`add_chunk`) in order: text, logprob blocks (each choice's `logprobs` value, merged position by
  position), token ids, prompt token ids, finish reason, usage, the response id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ID_FIELD = "return_token_ids"


@dataclass(frozen=True)
class Added:
    logprobs: bool = False  # lpf asked for logprobs the client did not
    token_ids: bool = False  # lpf asked for return_token_ids the client did not


def sampleable(route: str, body: Any) -> bool:
    if route not in (COMPLETIONS, CHAT) or not isinstance(body, dict):
        return False
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("echo"):
        return False
    if route == CHAT:
        return isinstance(body.get("messages"), list)
    prompt = body.get("prompt")
    return isinstance(prompt, str) or (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def client_asked_logprobs(route: str, body: dict) -> bool:
    value = body.get("logprobs")
    return bool(value) if route == CHAT else value is not None


def augment(route: str, body: dict, k: int, refused: frozenset = frozenset()) -> tuple[dict, Added]:
    sent = dict(body)
    add_lp = not client_asked_logprobs(route, body) and "logprobs" not in refused
    if add_lp:
        if route == CHAT:
            sent["logprobs"], sent["top_logprobs"] = True, k
        else:
            sent["logprobs"] = k
    add_ids = body.get(ID_FIELD) is None and ID_FIELD not in refused
    if add_ids:
        sent[ID_FIELD] = True
    return sent, Added(add_lp, add_ids)


def strip(answer: Any, added: Added) -> Any:
    if not isinstance(answer, dict) or not (added.logprobs or added.token_ids):
        return answer
    for choice in answer.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if added.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        if added.token_ids:
            for key in ("token_ids", "prompt_token_ids"):
                if key in choice:
                    choice[key] = None
    if added.token_ids and "prompt_token_ids" in answer:  # vLLM's chat route puts it at the top
        answer["prompt_token_ids"] = None
    return answer


def extra_chunk(route: str, chunk: Any, body: dict) -> bool:
    if route != CHAT or not isinstance(chunk, dict) or chunk.get("usage"):
        return False
    if client_asked_logprobs(route, body) or body.get(ID_FIELD):
        return False  # the client's own request makes vLLM send it too
    choices = chunk.get("choices")
    return (
        isinstance(choices, list)
        and bool(choices)
        and all(isinstance(c, dict) and c.get("delta") == {} and c.get("finish_reason") is None for c in choices)
    )


@dataclass
class Collected:
    route: str
    text: list[str] = field(default_factory=list)
    legacy: dict[str, list] = field(default_factory=dict)  # completions logprobs lists, concatenated
    content: list = field(default_factory=list)  # chat-shape logprobs entries, concatenated
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    response_id: str | None = None
    logprob_blocks: int = 0
    problems: list[str] = field(default_factory=list)

    def add_answer(self, answer: Any) -> None:
        self.add_chunk(answer, whole=True)

    def add_chunk(self, chunk: Any, whole: bool = False) -> None:
        if not isinstance(chunk, dict):
            self.problems.append(f"a {'response' if whole else 'chunk'} that is a JSON {type(chunk).__name__}")
            return
        self.response_id = self.response_id or chunk.get("id")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_token_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice, whole)

    def _choice(self, choice: dict, whole: bool) -> None:
        if self.route == CHAT:
            part = choice.get("message" if whole else "delta")
            text = part.get("content") if isinstance(part, dict) else None
        else:
            text = choice.get("text")
        if isinstance(text, str):
            self.text.append(text)
        if isinstance(choice.get("token_ids"), list):
            self.token_ids.extend(choice["token_ids"])
        if isinstance(choice.get("prompt_token_ids"), list):
            self.prompt_token_ids = choice["prompt_token_ids"]
        if choice.get("finish_reason") is not None:
            self.finish_reason = str(choice["finish_reason"])
        block = choice.get("logprobs")
        if isinstance(block, dict):
            self.logprob_blocks += 1
            if isinstance(block.get("content"), list):
                self.content.extend(block["content"])
            else:
                for key in ("tokens", "token_logprobs", "top_logprobs"):
                    if isinstance(block.get(key), list):
                        self.legacy.setdefault(key, []).extend(block[key])

    def logprobs_block(self) -> dict | None:
        """The merged logprobs in the shape `lpf.adapters.openai_shapes.read_logprobs` reads."""
        if self.content:
            return {"content": self.content}
        if self.legacy:
            return dict(self.legacy)
        return None
