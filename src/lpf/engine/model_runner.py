"""Model runner: turns one `SchedulerOutput` into one forward pass and the step's samples.

It packs every scheduled request's tokens into one flat batch, classifies each request's phase,
builds the `ForwardContext`, runs the model, projects the last hidden state of each sampling request
to logits and samples. Phase classification is the fix from the seed bug: a request that has
computed nothing yet is a prefill, whatever its token count. Under `stale-state` the pre-fix rule
(1 scheduled token = decode) is used and reused slots are not zeroed. Fault events are recorded
where they happen, with the request ids the context carries; a stale read is recorded as
`corrupted` once the request samples from it, or as `discarded` when a preemption throws it away
first (recompute starts over from a zeroed prefill, so no output ever saw it). An offset-wrap
prefill is recorded as `wrapped` when its state write lands elsewhere and as `corrupted` when the
request then decodes from its own slot, which that write never reached (a request that finishes
on its prefill's sample never reads the wrong state).
"""

from __future__ import annotations

import torch

from lpf.engine.faults import FaultSet, GroundTruth
from lpf.engine.forward_context import ForwardContext, SeqMeta, set_forward_context
from lpf.engine.kv_cache import KVCache
from lpf.engine.sampler import sample
from lpf.engine.sched_output import ScheduledRequest, SchedulerOutput
from lpf.engine.state_cache import StateCache


def classify(s: ScheduledRequest, stale_state: bool) -> str:
    if stale_state:  # the pre-fix rule: only the number of scheduled tokens was looked at
        return "decode" if s.num_scheduled_tokens == 1 else ("prefill" if s.num_computed_tokens == 0 else "extend")
    if s.num_computed_tokens == 0:
        return "prefill"
    return "decode" if s.num_scheduled_tokens == 1 else "extend"


class ModelRunner:
    def __init__(self, model, num_slots: int, num_blocks: int, block_size: int, faults: FaultSet,
                 truth: GroundTruth, dtype=torch.float32, device: str = "cpu"):
        self.model = model
        self.faults = faults
        self.truth = truth
        self.device = device
        n_attn, n_kv, head_dim = model.kv_spec()
        self.kv_cache = KVCache(max(n_attn, 1), num_blocks, block_size, n_kv, head_dim, dtype, device)
        self.state_cache = StateCache(model.state_specs(), num_slots, dtype, device, wrap_bits=faults.offset_wrap_bits)
        # stale-state reads not yet followed by a sample: {request_id: (step, detail)}
        self._stale_reads: dict[str, tuple[int, str]] = {}
        # offset-wrap prefills not yet followed by a decode that reads the (unwritten) slot
        self._wrapped: dict[str, tuple[int, str]] = {}

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> tuple[dict[str, str], dict[str, tuple]]:
        """({request_id: phase}, {request_id: (token, logprob, topk_ids, topk_logprobs)})."""
        f = self.faults
        for rid in so.preempted:
            self._discard_stale_read(rid)
            self._wrapped.pop(rid, None)  # recompute prefills again (and records again if it wraps)
        seqs, ids, pos, start = [], [], [], 0
        for s in so.scheduled:
            phase = classify(s, f.stale_state)
            if s.slot_is_new and not f.stale_state:
                self.state_cache.zero(s.state_slot)  # defence in depth: a reused slot starts clean
            self._record_faults(so, s, phase)
            seqs.append(SeqMeta(s.request_id, start, s.num_scheduled_tokens, s.num_computed_tokens, phase,
                                s.state_slot, s.block_table))
            ids.extend(s.token_ids)
            pos.extend(range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens))
            start += s.num_scheduled_tokens
        phases = {m.request_id: m.phase for m in seqs}
        if not seqs:
            return phases, {}
        ctx = ForwardContext(so.step, seqs, self.kv_cache, self.state_cache)
        with set_forward_context(ctx):
            hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device))
        sampling = [(m, s) for m, s in zip(seqs, so.scheduled) if s.will_sample]
        if not sampling:
            return phases, {}
        rows = hidden[torch.tensor([m.end - 1 for m, _ in sampling], device=self.device)]
        logits = self._logits(rows, batch_size=len(seqs))
        samples = sample(logits, [s for _, s in sampling], processed=f.processed_logprobs)
        if f.swap_outputs_period and so.step % f.swap_outputs_period == 0:
            decoding = [m.request_id for m, _ in sampling if m.phase == "decode"]
            if len(decoding) >= 2:
                a, b = decoding[:2]
                samples[a], samples[b] = samples[b], samples[a]
                self.truth.record(a, so.step, "swap-outputs", f"sample of {a} and {b} delivered to each other", other=b)
        return phases, samples

    def _logits(self, rows: torch.Tensor, batch_size: int) -> torch.Tensor:
        if not self.faults.batch_variant:
            return self.model.compute_logits(rows)
        # A split-K head: the hidden dimension is cut into `splits` pieces whose partial logits are
        # rounded to float16 before summing, and the split count follows the batch size, as a GEMM
        # heuristic would pick it. The head is linear, so masking the input splits it exactly.
        splits = 2 + batch_size % 3
        h = rows.shape[-1]
        edges = [round(i * h / splits) for i in range(splits + 1)]
        total = None
        for lo, hi in zip(edges, edges[1:]):
            masked = torch.zeros_like(rows)
            masked[:, lo:hi] = rows[:, lo:hi]
            part = self.model.compute_logits(masked).half().float()
            total = part if total is None else total + part
        return total

    def _discard_stale_read(self, request_id: str) -> None:
        """Preempted before sampling: recompute restarts from a prefill, so the stale read never
        reached an output. Kept in the ground truth with its own role, never silently dropped."""
        if request_id in self._stale_reads:
            step, detail = self._stale_reads.pop(request_id)
            self.truth.record(request_id, step, "stale-state", detail + "; preempted before its first sample, "
                              "so recompute discarded the stale state", role="discarded")

    def _record_faults(self, so: SchedulerOutput, s: ScheduledRequest, phase: str) -> None:
        f, t, step = self.faults, self.truth, so.step
        if f.stale_state and phase == "decode" and s.num_computed_tokens == 0 and s.slot_reused:
            self._stale_reads[s.request_id] = (step, f"first step ran as decode on slot {s.state_slot}, "
                                                     f"which held an earlier request's state")
        if s.will_sample and s.request_id in self._stale_reads:
            read_step, detail = self._stale_reads.pop(s.request_id)
            t.record(s.request_id, read_step, "stale-state", detail)
        if f.offset_wrap_bits is not None and phase in ("prefill", "extend") and self.state_cache.wraps(s.state_slot):
            sc = self.state_cache
            target = sc.base(s.state_slot, "prefill")
            detail = f"slot {s.state_slot}: state offset {s.state_slot * sc.slot_stride} wrapped to {target}"
            t.record(s.request_id, step, "offset-wrap", detail, role="wrapped")
            self._wrapped.setdefault(s.request_id, (step, detail))
            first, last = target // sc.slot_stride, (target + sc.slot_stride - 1) // sc.slot_stride
            for victim_slot in {first, last}:
                owner = so.slot_owners.get(victim_slot)
                if owner is not None and owner != s.request_id:
                    t.record(owner, step, "offset-wrap", f"slot {victim_slot} overwritten by {s.request_id}'s "
                             f"wrapped state write", role="overwritten")
        if phase == "decode" and s.num_computed_tokens > 0 and s.request_id in self._wrapped:
            wrap_step, detail = self._wrapped.pop(s.request_id)
            t.record(s.request_id, wrap_step, "offset-wrap", detail + f"; step {step} decoded from slot "
                     f"{s.state_slot}, which its prefill never wrote")
        if f.batch_variant:
            t.record_once(s.request_id, step, "batch-variant", "logits from a batch-size-dependent split-K head")
        if f.processed_logprobs and s.will_sample and not s.sampling.greedy:
            t.record_once(s.request_id, step, "processed-logprobs", "reported logprobs are post-temperature/top-k/top-p")
