"""A reference read from an engine's prompt logprobs: each request's prompt + output sent back as a prompt.

An engine that returns prompt logprobs scores a sequence teacher-forced, as the transformers reference
does: the answer's prompt position P + j (P prompt tokens) is output position j. Every reference that
works this way (a server: `lpf.pipeline.reference_http`; vLLM in-process: `lpf.pipeline.reference_vllm`)
turns its answers into the run's `reference/` rows here, one way.

Contract:
- `PromptReference` (base): subclasses give `where` (how errors name the reference) and `_answers(items)`
  yielding (item, `Completion`) pairs, each completion's `prompt_logprobs` / `prompt_topk_ids` /
  `prompt_topk_logprobs` / `prompt_ranks` covering positions 1..P+O-1 of the sequence sent.
  `score_all(items, tick)` yields `Scored` batches (output positions in `reference`, the prompt
  positions 1..P-1 of items that ask in `prompt_reference`; no seeded replay), `BATCH_REQUESTS` requests
  each; `score(items, tick)` the `reference` tables alone (attribution). `cost` counts requests, tokens
  sent and seconds.
- Rows (schema.REFERENCE): `ref_logprob` of the engine's token; `ref_top1_*` and `ref_topk_*` from the
  returned top-k; `ref_rank` the engine's own rank where the answer gives one (vLLM's), else the token's
  place in the top-k, else len(top-k) + 1 (a lower bound: it is outside the top-k); `ref_entropy` and
  `ref_logsumexp` null (a top-k does not give them).
- `LIMITATION`: the one line a self-reference's findings carry (it cannot tell a wrong model).
- `sent_back(engine, items, per)`: the (item, completion) answers of an in-process engine asked that way.
- A request that cannot be scored (no answer, no prompt logprobs, a position without a finite logprob or
  without top-k, an engine that saw other prompt tokens) is left unscored; once the rest are yielded,
  `LpfError` names how many and the first reason (`lpf rescore` scores what is left).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa

from lpf.core.errors import LpfError
from lpf.run import schema

BATCH_REQUESTS = 32  # requests per yielded batch (one reference part each): a crash loses at most these
# what any self-reference (the audited engine re-scoring itself) cannot see, in one line
LIMITATION = "a self-reference cannot tell a wrong model: add a transformers or trusted reference"


class PromptReference:
    """Scores from an engine's prompt logprobs (module docstring); subclasses say where and how to ask."""

    where = "the reference"
    topk = 1

    def __init__(self):
        self.cost = {"requests": 0, "tokens": 0, "seconds": 0.0}

    def _answers(self, items: list) -> Iterator[tuple[Any, Any]]:
        raise NotImplementedError

    def score_all(self, items: list, on_tokens: Callable[[int], None] | None = None) -> Iterable:
        from lpf.pipeline.reference import Scored

        if not items:
            return
        failed: list[tuple[str, str]] = []
        out, prompt = _Rows(), _Rows()
        n_done, t0, before = 0, time.monotonic(), self.cost["seconds"]  # seconds add up over calls (lpf watch's cycles)
        for it, c in self._answers(items):
            p, o = len(it.prompt_token_ids), len(it.output_token_ids)
            try:
                lps, ids, tlps, ranks = _read(c, p + o)
                out.add(it.request_id, range(o), it.output_token_ids, lps, ids, tlps, ranks, self.topk, p - 1)
                if it.score_prompt:
                    prompt.add(it.request_id, range(1, p), it.prompt_token_ids[1:], lps, ids, tlps, ranks, self.topk, 0)
            except _Unscored as e:
                failed.append((it.request_id, str(e)))
                out.drop(it.request_id)
                prompt.drop(it.request_id)
            self.cost["requests"] += 1
            self.cost["tokens"] += p + o
            self.cost["seconds"] = round(before + time.monotonic() - t0, 3)
            n_done += 1
            if on_tokens is not None:
                on_tokens(o)
            if n_done % BATCH_REQUESTS == 0 and out.n:
                yield Scored(out.table(), prompt.table() if prompt.n else None)
                out, prompt = _Rows(), _Rows()
        if out.n:
            yield Scored(out.table(), prompt.table() if prompt.n else None)
        if failed:
            rid, why = failed[0]
            raise LpfError(
                f"{self.where} could not score {len(failed)} of {len(items)} requests "
                f"(first: {rid}: {why}); the others are scored, `lpf rescore RUN` tries the rest again"
            )

    def score(self, items: list, on_tokens: Callable[[int], None] | None = None) -> Iterable[pa.Table]:
        for scored in self.score_all(items, on_tokens):
            yield scored.reference


class _Unscored(Exception):
    """Why one request's answer cannot be the reference's scores."""


def _read(c, n: int) -> tuple[list, list, list, list | None]:
    """The answer's prompt logprobs, top-k ids and logprobs, and ranks (index i: position i + 1), checked."""
    if c.error is not None:
        raise _Unscored(c.error)
    if c.inconsistency and "prompt_tokens:" in c.inconsistency:
        raise _Unscored(c.inconsistency)
    if c.prompt_logprobs is None or len(c.prompt_logprobs) != n - 1:
        raise _Unscored(c.inconsistency or "the answer has no prompt logprobs for every position")
    if len(c.prompt_topk_ids) != n - 1:
        raise _Unscored("the answer has no top-k for every prompt position")
    ranks = c.prompt_ranks if c.prompt_ranks is not None and len(c.prompt_ranks) == n - 1 else None
    return c.prompt_logprobs, c.prompt_topk_ids, c.prompt_topk_logprobs, ranks


class _Rows:
    """Reference rows gathered request by request, as one schema.REFERENCE table."""

    def __init__(self):
        self.cols: dict[str, list] = {name: [] for name in schema.REFERENCE.names}
        self.n = 0

    def add(self, rid, positions, targets, lps, ids, tlps, ranks, k, at) -> None:
        """Rows at `positions` (target tokens `targets`) from answer index `at` on (index i: the answer's
        prompt position i + 1)."""
        rows = []
        for j, (pos, tok) in enumerate(zip(positions, targets)):
            i = at + j
            lp, top_ids, top_lps = lps[i], list(ids[i])[:k], list(tlps[i])[:k]
            if not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-6:
                raise _Unscored(f"the logprob of position {pos} is {lp!r}")
            if not top_ids:
                raise _Unscored(f"no top-k at position {pos}")
            rank = (
                ranks[i] if ranks is not None and ranks[i] is not None else _rank(tok, min(lp, 0.0), top_ids, top_lps)
            )
            rows.append((rid, pos, min(lp, 0.0), rank, top_ids[0], top_lps[0], top_ids, top_lps))
        for rid_, pos, lp, rank, t1, l1, top_ids, top_lps in rows:
            c = self.cols
            c["request_id"].append(rid_)
            c["position"].append(pos)
            c["ref_logprob"].append(lp)
            c["ref_rank"].append(rank)
            c["ref_entropy"].append(None)
            c["ref_top1_id"].append(t1)
            c["ref_top1_logprob"].append(l1)
            c["ref_topk_ids"].append(top_ids)
            c["ref_topk_logprobs"].append(top_lps)
            c["ref_logsumexp"].append(None)
        self.n += len(rows)

    def drop(self, rid: str) -> None:
        keep = [i for i, r in enumerate(self.cols["request_id"]) if r != rid]
        if len(keep) != self.n:
            self.cols = {name: [v[i] for i in keep] for name, v in self.cols.items()}
            self.n = len(keep)

    def table(self) -> pa.Table:
        return pa.table(self.cols, schema=schema.REFERENCE)


def _rank(tok: int, lp: float, top_ids: list, top_lps: list) -> int:
    """1 + the alternatives above the token where it is in the top-k; else len(top-k) + 1 (a lower bound)."""
    if tok in top_ids:
        return 1 + sum(1 for v in top_lps if v > lp)
    return len(top_ids) + 1


def sent_back(engine, items: list, per: int) -> Iterator[tuple[Any, Any]]:
    """(item, completion) for each item's prompt + output sent to an in-process `engine` as one prompt
    (`max_tokens` 1: its prompt logprobs are the answer), `per` requests to a `generate` call."""
    from lpf.core.workload import EngineRequest

    by_id = {it.request_id: it for it in items}
    for at in range(0, len(items), per):
        requests = [
            EngineRequest(
                it.request_id,
                at + i,
                it.request_id,
                0,
                tuple(it.prompt_token_ids) + tuple(it.output_token_ids),
                max_tokens=1,
                seed=0,
            )
            for i, it in enumerate(items[at : at + per])
        ]
        for c in engine.generate(requests):
            yield by_id[c.request_id], c
