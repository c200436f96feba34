"""Chat prompts: a workload's messages, checked, and rendered the way the model's own tokenizer renders them.

Contract: `check_messages(value, at)` returns the messages as a tuple of {"role", "content"} dicts (both
strings, role one of ROLES) or raises `LpfError` naming `at`; `render(tokenizer, messages)` returns the
token ids of the conversation with the assistant's turn opened (`add_generation_prompt`), from the
tokenizer's own chat template, which is what a chat server renders for the same messages, so the
reference scores the answer after the same prompt. A tokenizer without a template is refused in one
line. The zoo models ship one (`chat_template.jinja` beside each model's tokenizer: `ROLE:content` lines
in capitals and digits the zoo tokenizer already has, one token per character, then `ASSISTANT:`), so a
chat server serving a zoo directory renders exactly this; adding it changed no token id (the
tokenizer's fingerprint, its token -> id map, is the same).
"""

from __future__ import annotations

from typing import Any

from lpf.core.errors import LpfError

ROLES = ("system", "user", "assistant")


def check_messages(value: Any, at: str) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise LpfError(f'{at}: \'messages\' must be a non-empty list of {{"role", "content"}} objects')
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not isinstance(m.get("content"), str):
            raise LpfError(f"{at}: messages[{i}] must be an object with a string 'content' and a 'role'")
        if m.get("role") not in ROLES:
            raise LpfError(f"{at}: messages[{i}] has role {m.get('role')!r}; roles are {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def wrap(prompt: str) -> tuple[dict, ...]:
    """A plain prompt as one user turn."""
    return ({"role": "user", "content": prompt},)


def render(tokenizer, messages: tuple[dict, ...] | list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise LpfError(
            "chat prompts need a chat template: the model's tokenizer has none (add chat_template.jinja "
            "to its directory, as a chat server would need too)"
        )
    ids = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict):  # some versions answer a BatchEncoding whatever return_dict says
        ids = ids["input_ids"]
    return [int(t) for t in ids]
