"""Request state inside the built-in engine.

There are no prefill/decode phases here, only `num_computed_tokens` against the tokens known so far
(prompt + outputs), as in vLLM v1: a request needs `num_tokens - num_computed_tokens` more tokens of
compute before it can sample. Preemption by recompute resets `num_computed_tokens` to 0 and keeps the
outputs, so the request later recomputes prompt + outputs and continues where it stopped.
With prefix caching the request also carries its block hashes and the prefix cache's bookkeeping
(`prefix_cache` reads and writes those fields; nothing else does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from lpf.builtin.sched_output import Sample
from lpf.core.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    seed: int
    eos_token_id: int | None
    seq: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)  # only when a drill reports other than raw ones
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    state_slot: int | None = None
    slot_is_new: bool = False  # slot allocated since the last step: the runner may zero it
    block_table: list[int] = field(default_factory=list)
    # prompt position -> (logprob, rank, top-k ids, top-k logprobs), when sampling.prompt_logprobs; a
    # recompute after preemption computes them again and the later values stand (what the engine last computed)
    prompt_logprobs: dict[int, tuple[float, int, list[int], list[float]]] = field(default_factory=dict)
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    # prefix caching (see prefix_cache): chained hashes of its full KV blocks, the checkpoint entries it
    # holds (Mamba block index -> slot; the hit's entry too until its first step ran), the entries it
    # published but still holds until its step is committed, the checkpoint slot its next step resumes
    # from, tokens the cache supplied at its last admission, how many of its blocks are published, what
    # its in-flight step published at schedule time, and (drills) why its state is wrong
    block_hashes: list[int] = field(default_factory=list)
    state_entries: dict[int, int] = field(default_factory=dict)
    held_published: list[int] = field(default_factory=list)
    resume_slot: int | None = None
    resume_pending: bool = False
    prefix_hit_tokens: int = 0
    published_blocks: int = 0
    in_flight: dict | None = None
    state_taint: tuple[str, str] | None = None
    pending_taint: tuple[str, str] | None = None
    t_arrival: float = field(default_factory=time.time)
    t_first_token: float | None = None
    t_finish: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        return (
            self.prompt_token_ids[start:end] if end <= p else (self.prompt_token_ids + self.output_token_ids)[start:end]
        )

    def append_output(self, sample: Sample) -> None:
        if self.t_first_token is None:
            self.t_first_token = time.time()
        self.output_token_ids.append(sample.token_id)
        self.logprobs.append(sample.logprob)
        self.topk_ids.append(sample.topk_ids)
        self.topk_logprobs.append(sample.topk_logprobs)
        if sample.raw_logprob is not None:
            self.raw_logprobs.append(sample.raw_logprob)

    def add_prompt_rows(self, rows) -> None:
        for i, lp in enumerate(rows.logprobs):
            self.prompt_logprobs[rows.first + i] = (lp, rows.ranks[i], rows.topk_ids[i], rows.topk_logprobs[i])

    def prompt_rows(self) -> list[tuple[float, int, list[int], list[float]]] | None:
        """(logprob, rank, top-k ids, top-k logprobs) of prompt positions 1..P-1, None when not asked."""
        if not self.sampling.prompt_logprobs:
            return None
        rows = [self.prompt_logprobs.get(p) for p in range(1, len(self.prompt_token_ids))]
        if any(r is None for r in rows):  # never: every prompt row is computed before the first sample
            raise RuntimeError(f"{self.request_id}: prompt logprobs missing for some positions")
        return rows

    def check_stop(self, max_context: int | None) -> bool:
        """Sets finish_reason when the last output ends the request."""
        if (
            not self.sampling.ignore_eos
            and self.eos_token_id is not None
            and self.output_token_ids
            and self.output_token_ids[-1] == self.eos_token_id
        ):
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        elif max_context is not None and self.num_tokens >= max_context:
            self.finish_reason = "length"
        return self.finish_reason is not None
