"""Seeded generators of oracle tasks (exact expected answers) and filler text.

Contract:
- Every generator takes a `random.Random` and is deterministic given it; the public entry points take an
  integer seed and derive their RNG from a string namespace (`"oracle:SEED"`, `"train:SEED"`, ...), so oracle,
  stress and training streams never share a seed.
- An item is a dict: `id` (str, unique within a list), `task` (str), `prompt` (str: exactly the text before
  the answer), `expected` (str: exactly the text the model should produce before the EOS token `</s>`, or
  None), optional `max_tokens` (int).
- Task strings use one token per character with the bundled tokenizer: capitals, digits and the
  punctuation in `TASK_CHARS`, no spaces. The model's answer is terminated by `</s>`.

Formats (`<s>` is added by the tokenizer, `</s>` ends the answer):
    recall  R:A37,K12,B55|K          -> 12        key-value lookup over 4..16 pairs
    copy    C:QX7RT2MB=              -> QX7RT2MB  copy 8..24 characters
    add     A:37+58=                 -> 95        two-digit addition; a fixed set of pairs is held out

Training-only form (see `training_item`): recall with several queries in one sequence,
`R:A37,K12,B55|K12|A37|B55`, each queried value is an answer span; it is what makes recall learnable
quickly at this scale.
"""

from __future__ import annotations

import random
from typing import Iterable

TASKS = ("recall", "copy", "add")
KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DIGITS = "123456789"  # values use 1-9 only; 0 appears only in sums
COPY_ALPHABET = KEYS + DIGITS
TASK_CHARS = KEYS + "0123456789" + ":,|+="
EOS = "</s>"

# Final (oracle) difficulty; training ramps up to these.
RECALL_PAIRS = (4, 16)
COPY_LEN = (8, 24)


def add_held_out(a: int, b: int) -> bool:
    """True for the ~10% of unordered two-digit pairs reserved for evaluation (never trained on)."""
    import hashlib

    lo, hi = min(a, b), max(a, b)
    # A hash, not arithmetic on a and b: a rule like (a + b) % 10 == k would hold out a whole answer digit.
    return hashlib.sha256(f"add:{lo}+{hi}".encode()).digest()[0] % 10 == 0


# --- single tasks -----------------------------------------------------------------------------------


def recall(rng: random.Random, pairs: int | None = None, queries: int = 1) -> tuple[str, list[str]]:
    """`R:K1V1,K2V2,...|Q` with distinct keys; returns (text up to the first query key, answers).

    With queries > 1 the text continues `ANSWER|Q2` ... and the answers list holds every queried value;
    the caller splits it into spans (see `training_item`).
    """
    n = pairs if pairs is not None else rng.randint(*RECALL_PAIRS)
    keys = rng.sample(KEYS, n)
    vals = [rng.choice(DIGITS) + rng.choice(DIGITS) for _ in keys]
    body = ",".join(k + v for k, v in zip(keys, vals))
    qs = [rng.randrange(n) for _ in range(queries)]
    return "R:" + body + "|", [keys[i] + vals[i] for i in qs]


def copy_task(rng: random.Random, length: int | None = None) -> tuple[str, str]:
    n = length if length is not None else rng.randint(*COPY_LEN)
    s = "".join(rng.choice(COPY_ALPHABET) for _ in range(n))
    return "C:" + s + "=", s


def add_task(rng: random.Random, held_out: bool | None = None) -> tuple[str, str]:
    """Two-digit addition. held_out=True draws only reserved pairs, False never does, None either."""
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if held_out is None or add_held_out(a, b) == held_out:
            return f"A:{a}+{b}=", str(a + b)


def make_item(task: str, rng: random.Random, *, held_out: bool = True) -> dict:
    """One evaluation item of `task` at full difficulty (no id; callers add one)."""
    if task == "recall":
        prefix, answers = recall(rng)
        key, val = answers[0][0], answers[0][1:]
        return {"task": task, "prompt": prefix + key, "expected": val}
    if task == "copy":
        prompt, expected = copy_task(rng)
        return {"task": task, "prompt": prompt, "expected": expected}
    if task == "add":
        prompt, expected = add_task(rng, held_out=held_out)
        return {"task": task, "prompt": prompt, "expected": expected}
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


# --- filler text ------------------------------------------------------------------------------------

_SUBJ = [
    "the river",
    "a small boat",
    "the old mill",
    "my neighbour",
    "the north wind",
    "a grey cat",
    "the baker",
    "our teacher",
    "the village",
    "a tired horse",
    "the morning train",
    "her brother",
    "the garden",
    "a young fox",
    "the harbour",
    "the lamp",
    "his letter",
    "the market",
    "the bridge",
    "a quiet road",
]
_VERB = [
    "carried",
    "watched",
    "followed",
    "painted",
    "remembered",
    "crossed",
    "opened",
    "found",
    "left",
    "needed",
    "kept",
    "passed",
    "heard",
    "visited",
    "forgot",
    "turned toward",
]
_OBJ = [
    "the long field",
    "a basket of apples",
    "the empty house",
    "some warm bread",
    "the last light",
    "a few old songs",
    "the blue door",
    "the winter road",
    "a careful plan",
    "the open window",
    "the wet stones",
    "a story about the sea",
    "the evening bells",
    "the narrow path",
    "a pair of boots",
    "the little school",
]
_TAIL = [
    "before dinner",
    "after the rain",
    "in the early morning",
    "without a word",
    "once again",
    "near the water",
    "for a while",
    "at the edge of town",
    "as the clouds moved",
    "every spring",
    "with some care",
    "late that night",
]
_JOIN = ["and then", "but", "so", "while", "because", "although"]


def _clause(rng: random.Random) -> str:
    c = f"{rng.choice(_SUBJ)} {rng.choice(_VERB)} {rng.choice(_OBJ)}"
    if rng.random() < 0.6:
        c += " " + rng.choice(_TAIL)
    return c


def filler_sentence(rng: random.Random) -> str:
    s = _clause(rng)
    if rng.random() < 0.4:
        s += ("," if rng.random() < 0.5 else "") + f" {rng.choice(_JOIN)} {_clause(rng)}"
    end = rng.choices([".", "!", "?"], weights=[8, 1, 1])[0]
    return s[0].upper() + s[1:] + end


def filler_text(rng: random.Random, n_words: int) -> str:
    """Natural-looking English prose of about `n_words` words (whole sentences, at least one)."""
    out: list[str] = []
    words = 0
    while words < n_words or not out:
        s = filler_sentence(rng)
        out.append(s)
        words += len(s.split())
    return " ".join(out)


# --- item lists -------------------------------------------------------------------------------------


def oracle_items(n: int, seed: int = 0, tasks: Iterable[str] = TASKS) -> list[dict]:
    """`n` held-out evaluation items, tasks in round-robin order. Ids `oracle-SEED-I-TASK`."""
    tasks = tuple(tasks)
    rng = random.Random(f"oracle:{seed}")
    items = []
    for i in range(n):
        item = make_item(tasks[i % len(tasks)], rng, held_out=True)
        items.append({"id": f"oracle-{seed}-{i:05d}-{item['task']}", **item})
    return items


def stress_items(
    n: int, seed: int = 0, *, filler_words: tuple[int, int] = (5, 260), max_tokens: tuple[int, int] = (4, 128)
) -> list[dict]:
    """`n` items for cache pressure: filler prose (about 8..450 tokens), a newline, then an oracle task.

    Prompt lengths and `max_tokens` are drawn log-uniformly so that short and long requests mix;
    `max_tokens` is never below len(expected) + 1, so a correct engine can always finish the answer and `</s>`
    (the models stop there: longer outputs need the engine to ignore EOS).
    `expected` is the task's answer; the zoo models are trained on short filler prefixes only, so
    accuracy on long ones is not a target (the point is the engine's cache, checked against a reference).
    """
    rng = random.Random(f"stress:{seed}")
    items = []
    for i in range(n):
        words = _log_uniform(rng, *filler_words)
        filler = filler_text(rng, words)
        item = make_item(TASKS[i % len(TASKS)], rng, held_out=True)
        items.append(
            {
                "id": f"stress-{seed}-{i:05d}-{item['task']}",
                "task": item["task"],
                "prompt": filler + "\n" + item["prompt"],
                "expected": item["expected"],
                "max_tokens": max(_log_uniform(rng, *max_tokens), len(item["expected"]) + 1),
            }
        )
    return items


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    import math

    return min(hi, max(lo, int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))))


# --- training ---------------------------------------------------------------------------------------


def training_item(rng: random.Random, progress: float, *, filler_p: float = 0.1) -> dict:
    """One training sequence at curriculum `progress` in [0, 1] (full difficulty from 0.4 on).

    Returns `text` (prompt + answers, without `</s>`), `spans`: (start, end) character offsets of the
    answer text that carries loss, and `eos`: whether the `</s>` appended after the text carries loss.
    In the multi-query form the `|` after a value carries no loss, so every loss-bearing position that
    follows a value says `</s>`, as in the single-query oracle form.
    Never draws a held-out addition pair. With probability `filler_p` a short filler prefix and a newline
    come first (so models learn to ignore prose before a task, as in `stress_items`).
    """
    ramp = min(1.0, progress / 0.4)
    task = rng.choices(["recall", "mq", "copy", "add"], weights=[2, 3, 3, 2])[0]
    prefix = ""
    if rng.random() < filler_p:
        prefix = filler_text(rng, rng.randint(3, 30)) + "\n"
    if task in ("recall", "mq"):
        hi = int(round(4 + ramp * (RECALL_PAIRS[1] - 4)))
        pairs = rng.randint(min(4, hi), hi)
        queries = 1 if task == "recall" else rng.randint(2, max(2, min(8, pairs)))
        head, answers = recall(rng, pairs, queries)
        text = prefix + head
        spans = []
        for j, kv in enumerate(answers):
            if j:
                text += "|"
            text += kv[0]
            spans.append((len(text), len(text) + len(kv) - 1))
            text += kv[1:]
        return {"task": "recall", "text": text, "spans": spans, "eos": True}
    if task == "copy":
        hi = int(round(8 + ramp * (COPY_LEN[1] - 8)))
        prompt, ans = copy_task(rng, rng.randint(min(4, hi), hi))
    else:
        prompt, ans = add_task(rng, held_out=False)
    text = prefix + prompt
    return {"task": task, "text": text + ans, "spans": [(len(text), len(text) + len(ans))], "eos": True}


def tokenizer_corpus(seed: int = 0, n_filler: int = 4000, n_tasks: int = 600) -> list[str]:
    """Deterministic text for training the BPE tokenizer: filler prose plus task strings."""
    rng = random.Random(f"tokenizer:{seed}")
    docs = [filler_text(rng, rng.randint(5, 80)) for _ in range(n_filler)]
    for i in range(n_tasks):
        it = make_item(TASKS[i % len(TASKS)], rng, held_out=False)
        docs.append(it["prompt"] + it["expected"])
    return docs
