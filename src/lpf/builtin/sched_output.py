"""The only message from the scheduler to the model runner, one per step.

`ScheduledRequest` is everything the runner needs about one request this step: which tokens to
compute (from which position), where its KV blocks and state slot are, and whether this step ends
with a sample. The runner never sees `Request` objects, so it cannot depend on scheduler state.
Its reply is a `StepResult`: the phase it ran each request in and a `Sample` per sampling request,
and, with prefix caching, which state slots it wrote (`StateWrite`: who, how many tokens the state
covers) and which slot each resuming request read its state from: the provenance the prefix cache
keeps and the trace reports; and the state writes that landed outside the writer's own slot (the
trace's write log, `stray_writes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lpf.core.sampling import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    num_computed_tokens: int  # position of token_ids[0]
    state_slot: int
    block_table: list[int]
    slot_is_new: bool  # the slot was (re)allocated for this request since its last step
    slot_reused: bool  # ...and an earlier request had left its state in it
    will_sample: bool  # these tokens reach the end of what is known: sample the next token
    output_position: int  # index of the output token a sample would produce
    sampling: SamplingParams
    seed: int
    # prompt logprobs asked (sampling.prompt_logprobs): the prompt tokens this step's rows predict, row
    # i predicting token num_computed_tokens + i + 1 (empty when not asked or past the prompt)
    prompt_targets: list[int] = field(default_factory=list)
    # prefix caching: tokens the cache supplied when this is the first step after a hit (0 otherwise),
    # the request's Mamba block table then ((Mamba block index, slot) of the checkpoints it holds; the
    # runner picks the entry to resume from), and where this step's states must be saved
    # ((position, slot): the state after `position` tokens goes to `slot`)
    resume_tokens: int = 0
    state_table: tuple[tuple[int, int], ...] = ()
    state_writes: tuple[tuple[int, int], ...] = ()
    # penalties (sampling.penalized) on a sampling step: the tokens already in the prompt and the output
    seen_prompt: tuple[int, ...] = ()
    seen_output: tuple[int, ...] = ()
    # speculative decoding: the draft tokens appended to this step's tokens (token_ids = [its last
    # sampled token, *drafts]) for the verify pass; empty when the request is not speculating
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest]
    preempted: list[str] = field(default_factory=list)
    slot_owners: dict[int, str] = field(default_factory=dict)  # every held slot -> request id
    shared_blocks: dict[int, list[str]] = field(default_factory=dict)  # KV block -> its holders, when > 1

    @property
    def total_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


@dataclass(frozen=True)
class Sample:
    """One sampled token: its id, its logprob as reported (raw unless a drill says otherwise), the top-k;
    `raw_logprob` is the raw one when the reported one is not (the processed-logprobs drill's ground truth)."""

    token_id: int
    logprob: float
    topk_ids: list[int]
    topk_logprobs: list[float]
    raw_logprob: float | None = None


@dataclass(frozen=True)
class PromptRows:
    """Prompt logprobs computed this step for one request: prompt positions `first`, `first + 1`, ..."""

    first: int
    logprobs: list[float]
    ranks: list[int]  # 1 = the prompt token was the model's argmax there
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]


@dataclass(frozen=True)
class StateWrite:
    """A state the runner wrote this step: into `slot`, by `request_id`, covering its first `covers`
    tokens; `part` is "state" (conv + SSM), or "conv" / "ssm" when only one part went there."""

    slot: int
    request_id: str
    covers: int
    part: str = "state"


@dataclass(frozen=True)
class StepResult:
    """The runner's reply to one `SchedulerOutput`."""

    phases: dict[str, str] = field(default_factory=dict)  # request id -> prefill | extend | decode
    samples: dict[str, Sample] = field(default_factory=dict)  # request id -> this step's sample
    prompt_rows: dict[str, PromptRows] = field(default_factory=dict)  # request id -> its prompt logprobs
    state_writes: list[StateWrite] = field(default_factory=list)  # with prefix caching
    # request id -> (Mamba block index, slot it read; None = the null block) of a resuming request
    resume_reads: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    # request id -> its state writes this step that landed outside its own slot (the trace's
    # `stray_writes`: {"memory", "owner", "slot", "start", "end"} per slot or KV block the range
    # overlaps; owner None = free)
    stray_writes: dict[str, list[dict]] = field(default_factory=dict)
    # speculative decoding: request id -> the tokens a verify step emits (accepted drafts, then the
    # bonus / recovered token), and -> its trace columns (`schema.SPEC_TRACE`)
    spec_samples: dict[str, list[Sample]] = field(default_factory=dict)
    spec_trace: dict[str, dict] = field(default_factory=dict)
