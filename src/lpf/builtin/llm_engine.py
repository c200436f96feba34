"""The engine loop: add requests, step (schedule -> run -> update), collect finished requests.

One step fits on a screen. Every step appends one trace row per scheduled request (and one per
preemption) so `lpf query` can answer "what happened to request X at each step"; with prefix caching
the row also says what the cache supplied, which checkpoint the request resumed from and who wrote
it (`prefix_trace`), and every row carries the write log (`stray_writes`: its state writes that
landed in memory outside its own slot, and whose slot that was). `abort(id)` cancels between steps; `cancel_after(id, tokens)` is a client
that cancels once the engine schedules the request past `tokens` prompt tokens: the cancel lands
while that step is in flight (after it was scheduled, before it runs), so the step runs without it.
"""

from __future__ import annotations

from dataclasses import replace
from math import prod
from pathlib import Path

import pyarrow as pa

from lpf.builtin.config import EngineConfig
from lpf.builtin.faults import FaultSet, GroundTruth
from lpf.builtin.model_runner import ModelRunner
from lpf.builtin.prefix_trace import trace_columns
from lpf.builtin.request import Request
from lpf.builtin.scheduler import Scheduler
from lpf.run.schema import SPEC_TRACE, TRACE, WRITE_LOG

# the run schema's trace, then the write log (state writes that landed outside the writer's slot)
TRACE_SCHEMA = pa.schema(list(TRACE) + [pa.field(n, t) for n, t in WRITE_LOG])
# with speculative decoding on, its columns after those (off, the trace is what it always was)
SPEC_TRACE_SCHEMA = pa.schema(list(TRACE_SCHEMA) + [pa.field(n, t) for n, t in SPEC_TRACE])


def cache_sizes(model, config: EngineConfig) -> tuple[int, int]:
    """(state slots, KV blocks) that `config.cache_mb` buys for `model` (weights or not: only the
    layer shapes count, so a model built on the meta device answers before any weight loads)."""
    from lpf.core.torch_utils import torch_dtype

    elem = torch_dtype(config.dtype).itemsize
    n_attn, n_kv, head_dim = model.kv_spec()
    slot_elem = torch_dtype(state_buffer_dtype(config)).itemsize
    slot_bytes = sum(prod(shape) for parts in model.state_specs() for _, shape in parts) * slot_elem
    # a model without attention layers (Kimi Linear's KDA-only tiny model) stores nothing per token: its
    # block tables are bookkeeping over the one-element placeholder KVCache allocates, which is what it costs
    row_bytes = head_dim * elem
    if config.kv_quantized:  # 1-byte codes and a float32 scale per tensor row or per 16 elements (kv_quant)
        row_bytes = head_dim + 4 * (1 if config.kv_cache_scales == "tensor" else -(-head_dim // 16))
    block_bytes = max(n_attn, 1) * 2 * config.block_size * n_kv * row_bytes
    return config.cache_sizes(slot_bytes, block_bytes)


def max_context(model_context: int | None, config: EngineConfig) -> int | None:
    """The longest prompt + output a request may have: the model's context, capped by max_model_len."""
    limits = [n for n in (model_context, config.max_model_len) if n is not None]
    return min(limits) if limits else None


def state_buffer_dtype(config: EngineConfig) -> str:
    """The state slots' buffer dtype: the engine's, or a wider `mamba_ssm_cache_dtype` (the SSM part
    then keeps that precision; the conv part is still rounded to the engine dtype)."""
    ssm = config.mamba_ssm_cache_dtype
    return "float32" if ssm == "float32" and config.dtype != "float32" else config.dtype


class LLMEngine:
    def __init__(self, model_path: Path, config: EngineConfig, faults: FaultSet = FaultSet()):
        from lpf.builtin.models import load_model
        from lpf.core.torch_utils import torch_dtype

        self.config = config
        self.faults = faults
        dtype = torch_dtype(config.dtype)
        self.model = load_model(model_path, dtype=dtype, device=config.device)
        self.max_context = max_context(getattr(self.model.config, "max_position_embeddings", None), config)
        self.num_slots, self.num_blocks = cache_sizes(self.model, config)
        self.truth = GroundTruth()
        has_mamba = bool(self.model.state_specs())
        self.proposer = None
        if config.draft_model:
            from lpf.builtin.speculative_draft import DraftProposer

            self.proposer = DraftProposer(config.draft_model, self.model.config.vocab_size, config.device)
        self.scheduler = Scheduler(
            config,
            self.num_slots,
            self.num_blocks,
            self.max_context,
            double_free=faults.kv_double_free,
            record=self.truth.record,
            faults=faults,
            has_mamba=has_mamba,
            proposer=self.proposer.propose if self.proposer else None,
        )
        px = self.scheduler.prefix
        ssm = config.mamba_ssm_cache_dtype
        self.runner = ModelRunner(
            self.model,
            self.num_slots,
            self.num_blocks,
            config.block_size,
            faults,
            self.truth,
            dtype,
            config.device,
            state_dtypes=(torch_dtype(state_buffer_dtype(config)), dtype if ssm == "auto" else torch_dtype(ssm)),
            mamba_block_size=px.mbs if px else None,
            num_speculative_tokens=config.num_speculative_tokens,
            draft_probs=self.proposer.probs if self.proposer else None,
            kv_cache_dtype=config.kv_quantized,
            kv_cache_scales=config.kv_cache_scales,
        )
        self._spec = bool(config.num_speculative_tokens)
        self._trace: list[dict] = []
        self._cancels: dict[str, int] = {}

    @classmethod
    def from_options(cls, model_path: Path, options) -> "LLMEngine":
        """The engine for validated options that carry the engine's own fields (`EngineConfig`) and
        `inject` (the drills): the builtin adapter's `BuiltinOptions`, as `lpf audit`, `lpf serve` and
        `lpf rl simulate` all build it. Other fields (the adapter's `threads`) are the caller's."""
        return cls(model_path, EngineConfig.of(options), FaultSet.parse(getattr(options, "inject", "")))

    def add_request(self, req: Request) -> Request | None:
        """Queue a request; returns it at once, finished with an error, if it could never run."""
        reason = self.scheduler.why_never_runs(req)
        if reason is not None:
            req.finish_reason, req.error = "error", reason
            return req
        self.scheduler.add(req)
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request between steps (a client that went away): its slot and blocks are freed."""
        self._cancels.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def cancel_after(self, request_id: str, prompt_tokens: int) -> None:
        """A client that cancels `request_id` once a step takes it past `prompt_tokens` prompt tokens;
        step() then returns it finished with an error saying so."""
        self._cancels[request_id] = prompt_tokens

    @property
    def num_free_slots(self) -> int:
        return self.scheduler.slots.num_free

    def step(self) -> list[Request]:
        so = self.scheduler.schedule()
        so, cancelled = self._land_cancels(so)
        result = self.runner.execute(so)
        n, tokens = (
            len(so.scheduled) + len(cancelled),
            so.total_tokens + sum(c.num_scheduled_tokens for c, _ in cancelled),
        )
        px = self.scheduler.prefix
        for s in so.scheduled:
            self._trace.append(
                {
                    "step": so.step,
                    "request_id": s.request_id,
                    "phase": result.phases[s.request_id],
                    "num_computed_tokens": s.num_computed_tokens,
                    "num_scheduled_tokens": s.num_scheduled_tokens,
                    "state_slot": s.state_slot,
                    "batch_size": n,
                    "batch_tokens": tokens,
                    "preempted": False,
                    **trace_columns(px, s, result.resume_reads.get(s.request_id)),
                    "stray_writes": result.stray_writes.get(s.request_id, []),
                    **self._spec_columns(s, result),
                }
            )
        for s, _ in cancelled:
            self._trace.append(
                {
                    "step": so.step,
                    "request_id": s.request_id,
                    "phase": None,
                    "num_computed_tokens": s.num_computed_tokens,
                    "num_scheduled_tokens": s.num_scheduled_tokens,
                    "state_slot": s.state_slot,
                    "batch_size": n,
                    "batch_tokens": tokens,
                    "preempted": False,
                    **trace_columns(px, s, None),
                    "aborted": True,
                    "stray_writes": [],  # its chunk never ran
                }
            )
        for rid in so.preempted:
            self._trace.append(
                {
                    "step": so.step,
                    "request_id": rid,
                    "phase": None,
                    "num_computed_tokens": 0,
                    "num_scheduled_tokens": 0,
                    "state_slot": None,
                    "batch_size": n,
                    "batch_tokens": tokens,
                    "preempted": True,
                    "stray_writes": [],
                }
            )
        finished = self.scheduler.update(
            so, result.samples, result.prompt_rows, result.state_writes, result.resume_reads, result.spec_samples
        )
        return [req for _, req in cancelled] + finished

    def _spec_columns(self, s, result) -> dict:
        """The speculative-decoding trace columns of one scheduled request (none when speculation is off)."""
        if not self._spec:
            return {}
        return result.spec_trace.get(s.request_id) or {"num_draft_tokens": len(s.draft_token_ids)}

    def _land_cancels(self, so):
        """(the step without the requests whose client cancels while it is in flight, [(their scheduled
        part, the request, finished with the cancel as its error)])."""
        if not self._cancels:
            return so, []
        keep, cancelled = [], []
        for s in so.scheduled:
            at = self._cancels.get(s.request_id)
            if at is None or s.num_computed_tokens + s.num_scheduled_tokens < at:
                keep.append(s)
                continue
            del self._cancels[s.request_id]
            req = self.scheduler.abort(
                s.request_id,
                in_flight=True,
                reason=(
                    f"cancelled by the client after {s.num_computed_tokens} of {at}+ prompt tokens, "
                    f"while its step {so.step} was in flight"
                ),
            )
            cancelled.append((s, req))
        return (replace(so, scheduled=keep), cancelled) if cancelled else (so, [])

    def drain_trace(self) -> pa.Table | None:
        if not self._trace:
            return None
        table = pa.Table.from_pylist(self._trace, schema=SPEC_TRACE_SCHEMA if self._spec else TRACE_SCHEMA)
        self._trace = []
        return table

    def describe(self) -> dict:
        out = {
            "num_state_slots": self.num_slots,
            "num_kv_blocks": self.num_blocks,
            "state_slot_stride": self.runner.state_cache.slot_stride,
            "faults": self.faults.names(),
        }
        if self._spec:
            out["num_speculative_tokens"] = self.config.num_speculative_tokens
            out["null_state_slot"] = self.runner.state_cache.null_slot
        mixers = self.model.mamba_mixers()
        if mixers:
            out["conv_width"] = mixers[0].d_conv
        if self.scheduler.prefix is not None:
            out["prefix_cache"] = self.scheduler.prefix.describe()
        return out
