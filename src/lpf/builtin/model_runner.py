"""Model runner: turns one `SchedulerOutput` into one forward pass and the step's samples.

At construction the drills may edit the weights and say how K/V are stored. Each step it packs
every scheduled request's tokens into one flat batch, asks the drills (`faults.Drills`)
which phase each request runs in (the fixed rule unless a drill puts the old one back), builds the
`ForwardContext`, runs the model, projects the last hidden state of each sampling request to logits
and samples; when prompt logprobs are asked, the rows of prompt tokens are projected too (each
predicts the next prompt token). The reply is a `StepResult`. Every fault-drill decision and its ground truth lives
behind `Drills`; with no drill on, each of its hooks is the honest behaviour.
With prefix caching (`mamba_block_size` given) a request resuming from a checkpoint reads its initial
state from the entry of its Mamba block table that its hit ends in, the Mamba layers save the
states the scheduler asked for, and the reply says which slots were written and read
(`prefix_drills.PrefixDrills` holds those decisions and the drills that change them). It also reports
every state write that landed outside the writer's own slot, and every K/V write into a block another
request holds too, with whose memory it hit (the write log).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lpf.builtin.faults import Drills, FaultSet, GroundTruth
from lpf.builtin.forward_context import ForwardContext, SeqMeta, set_forward_context
from lpf.builtin.kv_cache import KVCache
from lpf.builtin.kv_drills import KVDrills
from lpf.builtin.prefix_drills import PrefixDrills
from lpf.builtin.sampler import sample
from lpf.builtin.sched_output import PromptRows, SchedulerOutput, StepResult
from lpf.builtin.speculative_decode import SpecDecode
from lpf.builtin.state_cache import StateCache
from lpf.core.torch_utils import logprob_rows, shape_stable_attention


class ModelRunner:
    def __init__(
        self,
        model,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        faults: FaultSet,
        truth: GroundTruth,
        dtype=torch.float32,
        device: str = "cpu",
        state_dtypes: tuple | None = None,
        mamba_block_size: int | None = None,
        num_speculative_tokens: int = 0,
        draft_probs=None,
        kv_cache_dtype: str | None = None,
        kv_cache_scales: str = "tensor",
    ):
        self.model = model
        self.device = device
        n_attn, n_kv, head_dim = model.kv_spec()
        # (buffer dtype, SSM state dtype): `mamba_ssm_cache_dtype` (EngineConfig); default both the engine's
        buffer, ssm = state_dtypes or (dtype, dtype)
        self.state_cache = StateCache(
            model.state_specs(),
            num_slots,
            buffer,
            device,
            wrap_bits=faults.offset_wrap_bits,
            # state-fp16: rounded to float16 as it is written, whatever the cache claims
            part_dtypes={"conv": dtype, "ssm": torch.float16 if faults.state_fp16 else ssm},
            null_slot=bool(num_speculative_tokens),
        )
        self.drills = Drills(faults, truth, self.state_cache)
        self.drills.edit_weights(model)
        # an fp8 KV cache (kv_cache_dtype) and the drills inside it: `kv_drills`
        self.kv_drills = KVDrills(faults, truth, kv_cache_dtype, kv_cache_scales, head_dim)
        self.kv_cache = KVCache(
            max(n_attn, 1),
            num_blocks,
            block_size,
            n_kv,
            head_dim,
            dtype,
            device,
            rounding=self.drills.kv_rounding(),
            quant=self.kv_drills.quant,
        )
        self.kv_drills.install(self.kv_cache)
        mixers = model.mamba_mixers()
        self.spec = (
            SpecDecode(faults, truth, self.state_cache, num_speculative_tokens, draft_probs)
            if num_speculative_tokens
            else None
        )
        self.prefix = (
            None
            if mamba_block_size is None
            else PrefixDrills(faults, block_size, mamba_block_size, mixers[0].d_conv if mixers else 1)
        )

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, capture=None) -> StepResult:
        """One step; `capture` (lpf locate) is handed to the layers through the forward context."""
        with shape_stable_attention():  # a new batch shape every step: no per-shape cuDNN plans
            return self._execute(so, capture)

    def _execute(self, so: SchedulerOutput, capture=None) -> StepResult:
        drills = self.drills
        drills.preempted(so.preempted)
        self.kv_drills.preempted(so.preempted)
        if self.spec is not None:
            self.spec.preempted(so.preempted)
        seqs, ids, pos, start = [], [], [], 0
        writes, reads = [], {}
        for s in so.scheduled:
            phase = drills.phase(s)
            if self.spec is not None:
                phase = self.spec.phase(s, phase)
                self.spec.scheduled(so, s)
            if drills.zero_new_slot(s):
                self.state_cache.zero(s.state_slot)
            drills.scheduled(so, s, phase)
            self.kv_drills.scheduled(so, s, phase)
            meta = SeqMeta(
                s.request_id,
                start,
                s.num_scheduled_tokens,
                s.num_computed_tokens,
                phase,
                self.spec.slot(s) if phase == "verify" else s.state_slot,
                s.block_table,
                self._has_initial_state(s, phase),
                conv_reads_slot=drills.conv_reads_slot(phase),
                state_transposed=drills.state_transposed(phase),
            )
            if self.prefix is not None and phase != "verify":  # a verify step's saves: SpecDecode.finish
                meta = self._with_prefix(s, meta, writes, reads)
            seqs.append(meta)
            ids.extend(s.token_ids)
            pos.extend(range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens))
            start += s.num_scheduled_tokens
        phases = {m.request_id: m.phase for m in seqs}
        if not seqs:
            return StepResult(phases)
        result = self._forward(so, seqs, ids, pos, phases, capture)
        return replace(
            result,
            state_writes=writes + result.state_writes,
            resume_reads=reads,
            stray_writes=self._stray_writes(so, seqs),
        )

    def _has_initial_state(self, s, phase: str) -> bool | None:
        """vLLM's has_initial_state for the step's kernels: a chunk's (the drills'), the verify path's
        (its slot, unless spec-verify-zero-state hands it a zero-filled buffer); None for a decode."""
        if phase == "decode":
            return None
        if phase == "verify":
            return not self.drills.faults.spec_verify_zero_state
        return self.drills.has_initial_state(s, phase)

    def _stray_writes(self, so: SchedulerOutput, seqs: list[SeqMeta]) -> dict[str, list[dict]]:
        """The write log: each prefill/extend whose final state went somewhere else than its own slot
        (offset arithmetic gone wrong), with the slots it landed in and who held them this step; and
        each K/V write into a block another running request holds too (a double free)."""
        out: dict[str, list[dict]] = {}
        bs = self.kv_cache.block_size
        for m in seqs:
            entries = []
            exact = m.phase in ("decode", "verify")
            landed = None if exact else self.state_cache.stray_write(m.state_slot, "prefill")
            if landed is not None:  # the decode path's offsets are exact
                start, end, slots = landed
                entries += [
                    {"memory": "state", "owner": so.slot_owners.get(slot), "slot": slot, "start": start, "end": end}
                    for slot in slots
                ]
            if so.shared_blocks:
                first, last = m.num_computed, m.num_computed + m.num_tokens - 1
                for index in range(first // bs, last // bs + 1):
                    block = m.block_table[index]
                    lo, hi = max(first, index * bs) - index * bs, min(last, index * bs + bs - 1) - index * bs
                    entries += [
                        {
                            "memory": "kv",
                            "owner": other,
                            "slot": block,
                            "start": block * bs + lo,
                            "end": block * bs + hi + 1,
                        }
                        for other in so.shared_blocks.get(block, ())
                        if other != m.request_id
                    ]
            if entries:
                out[m.request_id] = entries
        return out

    def _with_prefix(self, s, meta: SeqMeta, writes: list, reads: dict) -> SeqMeta:
        """The prefix cache's part of a request's step: where it resumes from, where its conv state and
        checkpoints go; what it writes is appended to `writes`, where it resumed to `reads`."""
        px = self.prefix
        if s.resume_tokens:
            index, slot = px.resume(s)
            reads[s.request_id] = (index, slot)
            if slot is None:  # the null block: nothing to resume from
                meta = replace(meta, has_initial_state=False)
            else:
                meta = replace(meta, initial_slot=slot)
        cps = px.checkpoints(s)
        conv_to = px.conv_write_slot(s, meta.phase, meta.initial_slot)
        writes.extend(px.writes(s, cps, conv_to))
        return replace(meta, checkpoints=cps, conv_write_slot=conv_to)

    def _forward(
        self,
        so: SchedulerOutput,
        seqs: list[SeqMeta],
        ids: list[int],
        pos: list[int],
        phases: dict[str, str],
        capture=None,
    ) -> StepResult:
        drills = self.drills
        ctx = ForwardContext(
            so.step,
            seqs,
            self.kv_cache,
            self.state_cache,
            capture=capture,
            unmasked_padding=drills.faults.padding_updates_state,
        )
        with set_forward_context(ctx):
            hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device))
        drills.padded(so, ctx.memo.get("padded_chunks", ()))
        asked = [(m, s) for m, s in zip(seqs, so.scheduled) if s.prompt_targets]
        prompt_rows = self._prompt_rows(hidden, asked, len(seqs)) if asked else {}
        spec = {}
        if self.spec is not None:
            verifying = [(m, s) for m, s in zip(seqs, so.scheduled) if m.phase == "verify"]
            samples, trace, writes = self.spec.finish(
                so, verifying, hidden, lambda rows, n: drills.logits(self.model, rows, batch_size=n), ctx, len(seqs)
            )
            spec = {"spec_samples": samples, "spec_trace": trace, "state_writes": writes}
        sampling = [(m, s) for m, s in zip(seqs, so.scheduled) if s.will_sample and not s.draft_token_ids]
        if not sampling:  # only prefill chunks that end before their prompts do (or only verify steps)
            return StepResult(phases, prompt_rows=prompt_rows, **spec)
        rows = hidden[torch.tensor([m.end - 1 for m, _ in sampling], device=self.device)]
        logits = drills.logits(self.model, rows, batch_size=len(seqs))
        samples = sample(
            logits,
            [s for _, s in sampling],
            processed=drills.processed_logprobs,
            temperature=drills.sampling_temperature,
        )
        decoding = [m.request_id for m, _ in sampling if m.phase == "decode"]
        return StepResult(phases, drills.deliver(so, decoding, samples), prompt_rows, **spec)

    def _prompt_rows(self, hidden, asked, batch_size: int) -> dict[str, PromptRows]:
        """Raw logprobs of the prompt tokens this step's rows predict (row i of a chunk starting at
        position c predicts prompt token c + i + 1), through the same LM head as samples."""
        idx = torch.cat([torch.arange(m.start, m.start + len(s.prompt_targets)) for m, s in asked]).to(self.device)
        targets = torch.tensor([t for _, s in asked for t in s.prompt_targets], device=self.device)
        logits = self.drills.logits(self.model, hidden[idx], batch_size=batch_size)
        chosen, top_ids, top_lp, rank, _ = logprob_rows(logits, targets, max(s.sampling.logprobs for _, s in asked))
        out, at = {}, 0
        for m, s in asked:
            n, k = len(s.prompt_targets), s.sampling.logprobs
            out[m.request_id] = PromptRows(
                s.num_computed_tokens + 1,
                chosen[at : at + n].tolist(),
                rank[at : at + n].tolist(),
                top_ids[at : at + n, :k].tolist(),
                top_lp[at : at + n, :k].tolist(),
            )
            at += n
        return out
