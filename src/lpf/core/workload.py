"""Workloads: a JSONL prompts file or a bundled `zoo:NAME` generator, validated and tokenized.

Each JSONL line is an object with `prompt` (text, tokenized with the model tokenizer's special tokens,
e.g. a leading BOS, as an engine would) or `prompt_token_ids` (used as given), optional `id`, `expected`
(the known right answer), `max_tokens` and `abort_after_tokens` (a client that cancels the request
once the engine has scheduled it past that many prompt tokens, mid-prefill, then resends it: the
resend's answer is the request's; honoured by the built-in engine, sent once by the others). A chat
workload (`chat=True`, or any item with `messages`: a list of {"role", "content"}) is rendered with the
tokenizer's chat template (`lpf.core.chat`); a plain `prompt` becomes one user turn. The text and messages
travel with each prompt (`text`, `messages`), for engines that send text or chat turns instead of token
ids. A run's own `workload.jsonl` (`normalized`: the ids, with `text` or `messages` beside them) is a
workload too: fed back, its text or turns are tokenized again and must give the same ids (another
tokenizer is refused, never silently re-tokenized). Every problem is reported with its line number
before any engine starts. `expand()` turns prompts
into engine requests: `n` rollouts each, arrival index `seq`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lpf.core.errors import LpfError
from lpf.core.sampling import SamplingParams, request_seed

DEFAULT_WORKLOAD = "zoo:oracle"


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    expected: str | None = None
    max_tokens: int | None = None
    text: str | None = None  # the prompt's text as given (None for token-id prompts)
    messages: tuple | None = None  # chat turns (a chat workload); prompt_token_ids are their rendering
    abort_after_tokens: int | None = None

    def to_json(self) -> dict:
        d = {
            "id": self.prompt_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "expected": self.expected,
            "max_tokens": self.max_tokens,
        }
        if self.text is not None:
            d["text"] = self.text
        if self.messages is not None:
            d["messages"] = list(self.messages)
        if self.abort_after_tokens is not None:
            d["abort_after_tokens"] = self.abort_after_tokens
        return d


@dataclass(frozen=True)
class EngineRequest:
    """One request as handed to an engine: the unit that is completed, stored and resumed."""

    request_id: str
    seq: int
    prompt_id: str
    rollout: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    seed: int
    expected: str | None = None
    text: str | None = None
    messages: tuple | None = None
    abort_after_tokens: int | None = None  # the client cancels once past this many prompt tokens, then resends


def read_items(spec: str) -> tuple[list[tuple[int, dict]], dict]:
    """(line number, raw item) pairs and a description of the source, for a path or `zoo:NAME`."""
    if spec.startswith("zoo:"):
        from lpf.zoo import registry

        items = registry.workload_items(spec[4:])
        return list(enumerate(items, 1)), {"source": spec}
    path = Path(spec).expanduser()
    if not path.is_file():
        raise LpfError(f"prompts file {spec!r} does not exist (bundled workloads are named zoo:NAME)")
    raw = path.read_bytes()
    items = []
    for lineno, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise LpfError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise LpfError(f"{path}:{lineno}: each line must be a JSON object, got {type(obj).__name__}")
        items.append((lineno, obj))
    if not items:
        raise LpfError(f"{path}: no prompts (the file is empty)")
    return items, {"source": str(path.resolve()), "sha256": hashlib.sha256(raw).hexdigest()}


def load_prompts(
    spec: str, tokenizer, vocab_size: int, max_context: int | None, chat: bool | None = False, limit: int | None = None
) -> tuple[list[Prompt], dict]:
    """Validate and tokenize a workload. Raises LpfError naming the line of the first bad item.
    `chat`: render chat turns (None: when any item has `messages`); `source["chat"]` says which.
    `limit`: only the first `limit` items are read (`--limit`; `source["limit"]` records it)."""
    items, source = read_items(spec)
    if limit is not None:
        items, source["limit"] = items[:limit], limit
    where = source["source"]
    if chat is None:
        chat = any("messages" in obj for _, obj in items)
    source["chat"] = bool(chat)
    prompts, seen = [], set()
    for lineno, obj in items:
        at = f"{where}:{lineno}"
        unknown = set(obj) - {
            "id",
            "prompt",
            "prompt_token_ids",
            "messages",
            "expected",
            "max_tokens",
            "task",
            "abort_after_tokens",
            "group",
            "text",
        }
        if unknown:
            # a key with a newline would break the one-line error: such keys are shown quoted
            shown = (k if k.isprintable() else repr(k) for k in sorted(unknown))
            raise LpfError(f"{at}: unknown field(s) {', '.join(shown)}")
        messages = None
        stored = _stored_item(obj, at)  # a run's own workload.jsonl fed back: its ids, with their text/turns
        if stored is not None:
            obj = stored
        if sum(k in obj for k in ("prompt", "prompt_token_ids", "messages")) != 1:
            raise LpfError(f"{at}: give exactly one of 'prompt' (text), 'prompt_token_ids' or 'messages'")
        if "messages" in obj or chat:
            from lpf.core import chat as chat_prompts

            if not chat:
                raise LpfError(f"{at}: 'messages' are chat turns: this engine takes no chat prompts")
            if "prompt_token_ids" in obj:
                raise LpfError(f"{at}: a chat workload needs text: give 'prompt' or 'messages', not token ids")
            if "prompt" in obj and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
                raise LpfError(f"{at}: 'prompt' must be a non-empty string")
            messages = (
                chat_prompts.check_messages(obj["messages"], at)
                if "messages" in obj
                else chat_prompts.wrap(obj["prompt"])
            )
            ids = chat_prompts.render(tokenizer, messages)
        elif "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise LpfError(f"{at}: 'prompt' must be a string")
            if not obj["prompt"]:  # checked on the text: a BOS alone is still an empty prompt
                raise LpfError(f"{at}: empty prompt")
            # the tokenizer's own convention (BOS where it adds one), as vLLM does for text prompts
            ids = tokenizer.encode(obj["prompt"])
        else:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise LpfError(f"{at}: 'prompt_token_ids' must be a list of integers")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise LpfError(f"{at}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        if not ids:
            raise LpfError(f"{at}: empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]  # text: the tokenizer may know more ids than the model
        if bad:
            raise LpfError(
                f"{at}: the tokenizer gives token id {bad[0]}, outside the model's vocabulary (0..{vocab_size - 1})"
            )
        if max_context is not None and len(ids) >= max_context:
            raise LpfError(f"{at}: prompt has {len(ids)} tokens, the model context is {max_context}")
        pid = str(obj.get("id", f"p{lineno:05d}"))
        if pid in seen:
            raise LpfError(f"{at}: duplicate id {pid!r}")
        seen.add(pid)
        expected = obj.get("expected")
        if expected is not None and not isinstance(expected, str):
            raise LpfError(f"{at}: 'expected' must be a string")
        mt = obj.get("max_tokens")
        if mt is not None and (not isinstance(mt, int) or mt < 1):
            raise LpfError(f"{at}: 'max_tokens' must be a positive integer")
        abort = obj.get("abort_after_tokens")
        if abort is not None and (not isinstance(abort, int) or isinstance(abort, bool) or not 1 <= abort < len(ids)):
            raise LpfError(
                f"{at}: 'abort_after_tokens' must be an integer from 1 to the prompt length - 1 "
                f"({len(ids) - 1}): the cancel lands mid-prefill"
            )
        text = obj["prompt"] if isinstance(obj.get("prompt"), str) and messages is None else None
        if stored is not None and list(ids) != obj["_ids"]:
            raise LpfError(
                f"{at}: this item's text or messages tokenize to other ids than its 'prompt_token_ids' "
                f"(another tokenizer wrote this workload?): keep only one of them"
            )
        prompts.append(Prompt(pid, tuple(ids), expected, mt, text, messages, abort))
    return prompts, source


def _stored_item(obj: dict, at: str) -> dict | None:
    """A run's `workload.jsonl` item (`Prompt.to_json`: the ids with the prompt's `text` or `messages`
    beside them) as the item it was made from, its ids kept in `_ids` to check the tokenization against;
    None for any other item. `text` needs `prompt_token_ids` (it is their text, not a prompt of its own)."""
    ids = obj.get("prompt_token_ids")
    if "text" in obj and ids is None:
        raise LpfError(
            f"{at}: 'text' is the text of 'prompt_token_ids' (a run's workload.jsonl): give 'prompt' instead"
        )
    extra = [k for k in ("text", "messages") if k in obj and obj[k] is not None]
    if ids is None or not extra:
        return None
    if len(extra) > 1 or "prompt" in obj:
        raise LpfError(f"{at}: give exactly one of 'prompt' (text), 'prompt_token_ids' or 'messages'")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise LpfError(f"{at}: 'prompt_token_ids' must be a list of integers")
    item = {k: v for k, v in obj.items() if k not in ("prompt_token_ids", "text")}
    if extra == ["text"]:
        if not isinstance(obj["text"], str):
            raise LpfError(f"{at}: 'text' must be a string")
        item["prompt"] = obj["text"]
    item["_ids"] = ids
    return item


def expand(
    prompts: list[Prompt], n: int, sampling: SamplingParams, max_context: int | None = None
) -> list[EngineRequest]:
    """n rollouts per prompt, in arrival order; ids and seeds depend only on the workload and seed.

    An item's own `max_tokens` wins over the run's default (the workload's author chose it).
    """
    if n < 1:
        raise LpfError(f"--n must be >= 1, got {n}")
    out = []
    for i, p in enumerate(prompts):
        budget = p.max_tokens or sampling.max_tokens
        if max_context is not None and len(p.prompt_token_ids) + budget > max_context:
            raise LpfError(
                f"prompt {p.prompt_id!r}: {len(p.prompt_token_ids)} prompt tokens + max_tokens "
                f"{budget} exceed the model context {max_context}"
            )
        for r in range(n):
            seq = i * n + r
            out.append(
                EngineRequest(
                    request_id=f"{p.prompt_id}-r{r}",
                    seq=seq,
                    prompt_id=p.prompt_id,
                    rollout=r,
                    prompt_token_ids=p.prompt_token_ids,
                    max_tokens=budget,
                    seed=request_seed(sampling.seed, seq),
                    expected=p.expected,
                    text=p.text,
                    messages=p.messages,
                    abort_after_tokens=p.abort_after_tokens,
                )
            )
    return out


def normalized(prompts: list[Prompt]) -> bytes:
    """The tokenized workload as JSONL, stored in the run so resume never depends on the original file."""
    return "".join(json.dumps(p.to_json()) + "\n" for p in prompts).encode()


def read_normalized(path: Path) -> list[Prompt]:
    out = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            messages = tuple(d["messages"]) if d.get("messages") is not None else None
            out.append(
                Prompt(
                    d["id"],
                    tuple(d["prompt_token_ids"]),
                    d.get("expected"),
                    d.get("max_tokens"),
                    d.get("text"),
                    messages,
                    d.get("abort_after_tokens"),
                )
            )
    return out
