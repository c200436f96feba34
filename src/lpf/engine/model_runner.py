"""Model runner: turns one `SchedulerOutput` into one forward pass and the step's samples.

It packs every scheduled request's tokens into one flat batch, classifies each request's phase,
builds the `ForwardContext`, runs the model, projects the last hidden state of each sampling request
to logits and samples. Phase classification is the fix from the seed bug: a request that has
computed nothing yet is a prefill, whatever its token count. Under `stale-state` the pre-fix rule
(1 scheduled token = decode) is used and reused slots are not zeroed. Fault events are recorded
where they happen, with the request ids the context carries.
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

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> tuple[dict[str, str], dict[str, tuple]]:
        """({request_id: phase}, {request_id: (token, logprob, topk_ids, topk_logprobs)})."""
        f = self.faults
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

    def _record_faults(self, so: SchedulerOutput, s: ScheduledRequest, phase: str) -> None:
        f, t, step = self.faults, self.truth, so.step
        if f.stale_state and phase == "decode" and s.num_computed_tokens == 0 and s.slot_reused:
            t.record(s.request_id, step, "stale-state",
                     f"first step ran as decode on slot {s.state_slot}, which held an earlier request's state")
        if f.offset_wrap_bits is not None and phase in ("prefill", "extend") and self.state_cache.wraps(s.state_slot):
            sc = self.state_cache
            target = sc.base(s.state_slot, "prefill")
            t.record(s.request_id, step, "offset-wrap",
                     f"slot {s.state_slot}: state offset {s.state_slot * sc.slot_stride} wrapped to {target}")
            first, last = target // sc.slot_stride, (target + sc.slot_stride - 1) // sc.slot_stride
            for victim_slot in {first, last}:
                owner = so.slot_owners.get(victim_slot)
                if owner is not None and owner != s.request_id:
                    t.record(owner, step, "offset-wrap", f"slot {victim_slot} overwritten by {s.request_id}'s "
                             f"wrapped state write", role="overwritten")
        if f.batch_variant:
            t.record_once(s.request_id, step, "batch-variant", "logits from a batch-size-dependent split-K head")
        if f.processed_logprobs and s.will_sample and not s.sampling.greedy:
            t.record_once(s.request_id, step, "processed-logprobs", "reported logprobs are post-temperature/top-k/top-p")
