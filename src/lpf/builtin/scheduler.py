"""Continuous-batching scheduler (vLLM v1 style). Imports no torch: testable anywhere.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first, each asking for
`num_tokens - num_computed_tokens` (1 when decoding, the rest of the prompt when prefilling; cut to
the remaining budget when chunked prefill is on). Then waiting requests are admitted, oldest first,
while budget, `max_num_seqs`, a free state slot and enough KV blocks remain; a new request may get
whatever budget is left, even 1 token (this is how the seed's "imposter" arose). When KV blocks run
out for a running request, the most recently admitted request is preempted by recompute: its blocks
and slot are freed and it returns to the front of the waiting queue.

With prefix caching (`prefix_cache.PrefixCache`, which then owns the block and slot pools) a waiting
request is looked up when admitted and starts after its hit (one asking for prompt logprobs is never looked
up: every prompt position must be computed, as vLLM's `skip_reading_prefix_cache`); in align mode every prefill chunk is
clipped so it ends where a checkpoint is due (`chunk_align`); every step plans the checkpoint
entries it saves into, and `update` commits what the runner wrote (publication after the write).
`abort(id, in_flight=True)` drops a request whose step was scheduled but has not run (a client's
cancel landing while that step is in flight): nothing that step would have written is published.
A step that can schedule nothing while requests wait or run raises `SchedulerStallError` (the next
step would be the same one: a hang is worse than an error).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from lpf.builtin.config import EngineConfig
from lpf.builtin.faults import FaultSet
from lpf.builtin.kv_cache import BlockAllocator, blocks_needed
from lpf.builtin.prefix_cache import Hit, PrefixCache
from lpf.builtin.request import Request, Status
from lpf.builtin.sched_output import PromptRows, Sample, ScheduledRequest, SchedulerOutput, StateWrite
from lpf.builtin.speculative_propose import ngram_drafts
from lpf.builtin.state_cache import SlotPool


def never_runs_reason(
    need: int, num_blocks: int, config: EngineConfig, prompt_len: int | None = None, max_context: int | None = None
) -> str | None:
    """Why a request needing `need` tokens (prompt + max_tokens) could wait forever, None when it can
    run: a prompt that leaves no room for an output in the context (`max_context`: the model's,
    capped by max_model_len), more KV than the whole cache, or, without chunked prefill, more tokens
    than one step's budget (a recompute after preemption needs prompt + outputs in one step). Outputs
    stop at the context, so a request never needs more than it."""
    if max_context is not None:
        if prompt_len is not None and prompt_len >= max_context:
            return f"has a {prompt_len}-token prompt: no room for an output in a {max_context}-token context"
        need = min(need, max_context)
    if blocks_needed(need, config.block_size) > num_blocks:
        return f"needs {need} tokens of KV cache; the cache holds {num_blocks * config.block_size} (raise --cache-mb)"
    if not config.enable_chunked_prefill and need > config.max_num_batched_tokens:
        return (
            f"needs up to {need} tokens in one step without chunked prefill; "
            f"max_num_batched_tokens is {config.max_num_batched_tokens}"
        )
    return None


class SchedulerStallError(RuntimeError):
    """A step in which nothing can be scheduled while requests wait or run: every later step is the same."""


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_slots: int,
        num_blocks: int,
        max_context: int | None = None,
        double_free: bool = False,
        record: Callable[..., None] | None = None,
        faults: FaultSet | None = None,
        has_mamba: bool = True,
        proposer: Callable[[list[tuple[Request, int]]], list[list[int]]] | None = None,
    ):
        self.config = config
        # speculative decoding's draft proposer, one call per step [(req, k)] -> [drafts]: n-gram lookup
        # unless the engine gives a draft model's (torch lives there, never here)
        self.proposer = proposer or (
            lambda asks: [ngram_drafts(req.prompt_token_ids + req.output_token_ids, k) for req, k in asks]
        )
        self.record = record or (lambda *a, **k: None)
        self.prefix: PrefixCache | None = None
        if config.enable_prefix_caching:
            self.prefix = PrefixCache(
                config, num_slots, num_blocks, faults or FaultSet(), self.record, has_mamba, max_context
            )
            self.slots, self.blocks = self.prefix.slots, self.prefix.blocks
        else:
            self.slots = SlotPool(num_slots)
            self.blocks = BlockAllocator(num_blocks)
        self.max_context = max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step = 0
        # kv-double-free drill: a finished request's last block is freed twice
        self.double_free = double_free
        self._block_owner: dict[int, str] = {}

    # -- queue -------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def why_never_runs(self, req: Request) -> str | None:
        return never_runs_reason(
            len(req.prompt_token_ids) + req.max_tokens,
            self.blocks.num_blocks,
            self.config,
            len(req.prompt_token_ids),
            self.max_context,
        )

    def abort(self, request_id: str, in_flight: bool = False, reason: str = "aborted") -> Request | None:
        """Drop a request wherever it is (waiting or running), freeing its slot and KV blocks; the
        request, finished with an error, or None when the scheduler does not hold it. `in_flight`: its
        step was scheduled and will not run (the runner is not given it)."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._release(req, in_flight=in_flight)
                    req.status, req.finish_reason, req.error = Status.FINISHED, "error", reason
                    return req
        return None

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        plan: list[tuple[Request, int]] = []
        preempted: list[str] = []
        px = self.prefix
        if px is not None:
            px.new_pass()

        proposed = self._drafts(budget - 1)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = req.num_tokens - req.num_computed_tokens
            drafts = proposed.get(req.request_id, [])[: budget - 1]  # a tight budget verifies fewer
            want += len(drafts)
            if want > budget and not chunked:
                i += 1
                continue
            n = min(want, budget) if px is None else px.align(req, min(want, budget))
            drafts = drafts[: max(n - 1, 0)]
            if n == 0:  # no checkpoint boundary within reach this step
                i += 1
                continue
            while not self._grow(req, req.num_computed_tokens + n):
                victim = self.running.pop()  # the newest request yields first
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                plan.append((req, n, drafts))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: it was last, nothing after it

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hit = None
                if px is not None and req.num_computed_tokens == 0:
                    # a request asking for prompt logprobs needs every prompt position computed: it never reads
                    # the cache (vLLM's SamplingParams.skip_reading_prefix_cache, on for such requests), so a
                    # self-reference's second pass is a fresh prefill; what it computes is still published
                    hit = Hit() if req.sampling.prompt_logprobs else px.lookup(req)
                    px.acquire(req, hit)
                want = req.num_tokens - req.num_computed_tokens
                n = min(want, budget) if px is None else px.align(req, min(want, budget))
                slot = None if (want > budget and not chunked) or n == 0 else self.slots.allocate()
                if slot is None:
                    if hit is not None:
                        px.undo(req, hit)
                    break
                req.state_slot, req.slot_is_new = slot, True
                if not self._grow(req, req.num_computed_tokens + n):
                    self.slots.unallocate(slot)
                    req.state_slot = None
                    if hit is not None:
                        px.undo(req, hit)
                    break
                self.waiting.popleft()
                req.status = Status.RUNNING
                self.running.append(req)
                plan.append((req, n, []))
                budget -= n

        if not plan and not preempted and self.has_unfinished():
            # nothing here changes between steps, so the next step would be this one again: an engine
            # that waits forever answers nothing, so say it (requests that can never run were refused
            # at admission, `never_runs_reason`)
            raise SchedulerStallError(
                f"the scheduler made no progress: {len(self.waiting)} waiting, {len(self.running)} running, "
                f"none schedulable in a {self.config.max_num_batched_tokens}-token step"
            )
        self.step += 1
        scheduled = []
        for req, n, drafts in plan:
            start = req.num_computed_tokens
            last = min(start + n, len(req.prompt_token_ids) - 1)  # rows up to here predict a prompt token
            targets = req.prompt_token_ids[start + 1 : last + 1] if req.sampling.prompt_logprobs else []
            writes, table = px.plan(req, n, self.step, verify=bool(drafts)) if px is not None else ((), ())
            known = start + n - len(drafts)  # the drafts are a guess past what is known
            resume = req.prefix_hit_tokens if px is not None and req.resume_pending else 0
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=req.token_ids(start, known) + list(drafts),
                    num_computed_tokens=start,
                    state_slot=req.state_slot,
                    block_table=list(req.block_table),
                    slot_is_new=req.slot_is_new,
                    slot_reused=req.slot_is_new and req.state_slot in self.slots.ever_used,
                    will_sample=known == req.num_tokens,
                    output_position=len(req.output_token_ids),
                    sampling=req.sampling,
                    seed=req.seed,
                    prompt_targets=targets,
                    resume_tokens=resume,
                    state_table=table if resume else (),
                    state_writes=writes,
                    **_seen(req, known == req.num_tokens),
                    draft_token_ids=tuple(drafts),
                )
            )
            req.slot_is_new = False
        owners = {r.state_slot: r.request_id for r in self.running}
        return SchedulerOutput(
            step=self.step,
            scheduled=scheduled,
            preempted=preempted,
            slot_owners=owners,
            shared_blocks=self._shared_blocks(),
        )

    def _drafts(self, most: int) -> dict[str, list[int]]:
        """Speculative decoding: the drafts (the proposer's, one call for the step) each decoding request
        may verify this step, by request id (vLLM proposes after a request's first sample). None for a
        request still prefilling or recomputing, a penalized one (its chooser changes with every accepted
        token), or one whose drafts could not all be kept (the last output within max_tokens, the last
        position within the context); at most `most` (the step's budget past the sampled token)."""
        k_max = self.config.num_speculative_tokens
        asks = []
        for req in self.running if k_max else []:
            if req.num_tokens - req.num_computed_tokens != 1 or not req.output_token_ids or req.sampling.penalized:
                continue
            k = min(k_max, req.max_tokens - len(req.output_token_ids) - 1, most)
            if self.max_context is not None:
                k = min(k, self.max_context - req.num_tokens)
            if k > 0:
                asks.append((req, k))
        return {req.request_id: d for (req, _), d in zip(asks, self.proposer(asks) if asks else [])}

    def _shared_blocks(self) -> dict[int, list[str]]:
        """KV blocks two running requests hold at once (only a double free makes one): the write log's
        owners for a K/V write into such a block."""
        holders: dict[int, list[str]] = {}
        for r in self.running:
            for b in r.block_table:
                holders.setdefault(b, []).append(r.request_id)
        return {b: ids for b, ids in holders.items() if len(ids) > 1}

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = blocks_needed(num_tokens, self.config.block_size) - len(req.block_table)
        if need <= 0:
            return True
        got = self.blocks.allocate(need)
        if got is None:
            return False
        for b in got:
            if b in self._block_owner:  # only possible after a double free
                self.record(
                    req.request_id,
                    self.step + 1,
                    "kv-double-free",
                    f"KV block {b} handed out while {self._block_owner[b]} still holds it",
                    other=self._block_owner[b],
                )
            self._block_owner[b] = req.request_id
        req.block_table.extend(got)
        return True

    def _release(self, req: Request, double_free: bool = False, in_flight: bool = False) -> None:
        if self.prefix is not None:
            self.prefix.release(req, self.step, in_flight)
        for b in req.block_table:
            if self._block_owner.get(b) == req.request_id:
                del self._block_owner[b]
        if req.block_table:
            self.blocks.free(req.block_table)
            if double_free:
                self.blocks.free(req.block_table[-1:])
        req.block_table = []
        if req.state_slot is not None:
            self.slots.free(req.state_slot)
            req.state_slot = None

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # -- after the runner ------------------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, Sample],
        prompt_rows: dict[str, PromptRows] | None = None,
        state_writes: list[StateWrite] = (),
        resume_reads: dict[str, tuple[int, int | None]] | None = None,
        spec_samples: dict[str, list[Sample]] | None = None,
    ) -> list[Request]:
        """Advance computed tokens, record prompt logprobs, append samples, commit what the step wrote
        to the prefix cache, retire finished requests (returned)."""
        prompt_rows = prompt_rows or {}
        by_id = {r.request_id: r for r in self.running}
        finished, ran = [], []
        for s in out.scheduled:
            req = by_id.get(s.request_id)
            if req is None:  # preempted later in the same step
                continue
            emitted = (spec_samples or {}).get(s.request_id)
            # a verify step computed its last sampled token and the drafts it accepted (one fewer than
            # it emits); the KV entries of rejected drafts lie past num_computed_tokens: overwritten later
            computed = s.num_scheduled_tokens - len(s.draft_token_ids) + (len(emitted) - 1 if emitted else 0)
            req.num_computed_tokens += computed
            ran.append((req, computed))
            if s.request_id in prompt_rows:
                req.add_prompt_rows(prompt_rows[s.request_id])
            if s.will_sample and emitted:
                for smp in emitted:  # stops at an end of sequence or max_tokens, as one at a time would
                    req.append_output(smp)
                    if req.check_stop(self.max_context):
                        finished.append(req)
                        break
            elif s.will_sample and s.request_id in sampled:
                req.append_output(sampled[s.request_id])
                if req.check_stop(self.max_context):
                    finished.append(req)
        if self.prefix is not None:
            writes: dict[str, list[StateWrite]] = {}
            for w in state_writes:
                writes.setdefault(w.request_id, []).append(w)
            done = {id(r) for r in finished}
            for req, n in ran:
                self.prefix.commit(
                    req,
                    out.step,
                    n,
                    writes.get(req.request_id, ()),
                    (resume_reads or {}).get(req.request_id),
                    continues=id(req) not in done,
                )
        for req in finished:
            self.running.remove(req)
            self._release(req, double_free=self.double_free)
            req.status = Status.FINISHED
            req.t_finish = time.time()
        return finished


def _seen(req: Request, will_sample: bool) -> dict:
    """The context a penalized request's sample needs (nothing for the others: no copies per step)."""
    if not (will_sample and req.sampling.penalized):
        return {}
    return {"seen_prompt": tuple(req.prompt_token_ids), "seen_output": tuple(req.output_token_ids)}
