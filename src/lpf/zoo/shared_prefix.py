"""`zoo:shared-prefix`: requests that share prefixes, the traffic that exercises prefix caching.

Contract: `shared_prefix_items(n, seed)` -> `n` items (the `lpf.zoo.tasks` item dicts: id, task,
prompt, expected, plus `group` and, on some, `abort_after_tokens`), deterministic given the seed
(RNG namespace "shared-prefix:SEED"). Every prompt is a recall task (`R:K1V1,K2V2,...|Q`, one token
per character with the zoo tokenizer, so lengths are exact in tokens after the BOS), optionally after
a "system prompt" of filler prose ending in a newline (a newline ends a token, so every prompt that
extends a shared text shares its tokens exactly). Groups of requests come in turn:

  fanout        a system prompt and a list of pairs shared by 4 requests, each adding pairs of its
                own and asking a different key: shared prefixes of every length, straddling block
                boundaries wherever they fall
  straddle      a 4-turn conversation after a one-line title of j capitals, sized so its third turn is
                33, 34, 35, 65, 66 or 67 tokens long (1-3 tokens past a 16-, 32- and 64-token boundary),
                then turns 3 and 4 resent: resumes that leave 1-3 tokens (or 5-7) to compute
  short         2-5 requests sharing only "R:" and one or two pairs: prefixes shorter than a block
  conversation  3-4 turns of one conversation (the multi-query recall form): turn t is turn t-1's
                prompt, its right answer and the next key, so each turn extends the one before it
  resend        one long prompt sent three times (exact resends); the first is cancelled by its
                client mid-prefill and resent (`abort_after_tokens`: an aborted-then-retried prefill)

Arrival order is group by group, so a group's later requests arrive after its first one has
usually computed (and cached) the shared part.
"""

from __future__ import annotations

import random

from lpf.zoo.tasks import DIGITS, KEYS, filler_text

KINDS = ("fanout", "straddle", "short", "conversation", "resend")
STRADDLE = (
    (5, 1),
    (4, 4),
    (5, 2),
    (13, 1),
    (12, 4),
    (13, 2),
)  # (pairs, title letters): turn 3 of 34, 33, 35, 66, 65, 67


def _pairs(rng: random.Random, keys: list[str]) -> list[str]:
    return [k + rng.choice(DIGITS) + rng.choice(DIGITS) for k in keys]


def _system(rng: random.Random, lo: int, hi: int) -> str:
    return filler_text(rng, rng.randint(lo, hi)) + "\n"


def _recall(system: str, pairs: list[str], asked: str) -> tuple[str, str]:
    """(prompt, expected) of a recall over `pairs` asking for key `asked`."""
    value = next(p[1:] for p in pairs if p[0] == asked)
    return system + "R:" + ",".join(pairs) + "|" + asked, value


def shared_prefix_items(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(f"shared-prefix:{seed}")
    items: list[dict] = []
    g = 0
    while len(items) < n:
        kind = KINDS[g % len(KINDS)]
        group = f"sp-{seed}-g{g:04d}-{kind}"
        for j, item in enumerate(_group(rng, kind)):
            items.append({"id": f"{group}-{j}", "task": "recall", "group": group, **item})
        g += 1
    return items[:n]


def _group(rng: random.Random, kind: str) -> list[dict]:
    keys = rng.sample(KEYS, 16)
    if kind == "fanout":
        system = _system(rng, 3, 30) if rng.random() < 0.7 else ""
        shared = _pairs(rng, keys[: rng.randint(2, 9)])
        out = []
        for own_keys in (keys[9 : 9 + rng.randint(0, 3)], keys[12 : 12 + rng.randint(1, 4)], [], keys[9:11]):
            pairs = shared + _pairs(rng, own_keys)
            prompt, expected = _recall(system, pairs, rng.choice(pairs)[0])
            out.append({"prompt": prompt, "expected": expected})
        return out
    if kind == "short":
        shared = _pairs(rng, keys[: rng.randint(1, 2)])
        out = []
        for k in range(rng.randint(2, 5)):
            pairs = shared + _pairs(rng, keys[2 + 3 * k : 2 + 3 * k + rng.randint(1, 3)])
            prompt, expected = _recall("", pairs, rng.choice(pairs)[0])
            out.append({"prompt": prompt, "expected": expected})
        return out
    if kind in ("conversation", "straddle"):
        straddle = kind == "straddle"
        # turn t of a conversation over k pairs after a title of j letters is 4k + 4t + (j + 1 if j) tokens
        k, j = rng.choice(STRADDLE) if straddle else (rng.randint(4, 10), 0)
        system = (
            "".join(rng.choice(KEYS) for _ in range(j)) + "\n"
            if j
            else (_system(rng, 3, 20) if not straddle and rng.random() < 0.5 else "")
        )
        pairs = _pairs(rng, keys[:k])
        text = system + "R:" + ",".join(pairs)
        out = []
        for asked in rng.sample(pairs, 4 if straddle else rng.randint(3, 4)):
            text += "|" + asked[0]
            out.append({"prompt": text, "expected": asked[1:]})
            text += asked[1:]
        return out + [dict(t) for t in out[2:]] if straddle else out
    system = _system(rng, 20, 60)
    pairs = _pairs(rng, keys[: rng.randint(6, 12)])
    prompt, expected = _recall(system, pairs, rng.choice(pairs)[0])
    # the client gives up somewhere in the system prompt (~4 characters per token there)
    cancel = max(2, rng.randint(len(system) // 8, len(system) // 4))
    return [
        {"prompt": prompt, "expected": expected, "abort_after_tokens": cancel},
        {"prompt": prompt, "expected": expected},
        {"prompt": prompt, "expected": expected},
    ]
