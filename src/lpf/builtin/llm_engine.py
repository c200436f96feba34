"""The engine loop: add requests, step (schedule -> run -> update), collect finished requests.

One step fits on a screen. Every step appends one trace row per scheduled request (and one per
preemption) so `lpf query` can answer "what happened to request X at each step".
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import pyarrow as pa

from lpf.builtin.config import EngineConfig
from lpf.builtin.faults import FaultSet, GroundTruth
from lpf.builtin.model_runner import ModelRunner
from lpf.builtin.request import Request
from lpf.builtin.scheduler import Scheduler
from lpf.run.schema import TRACE


def cache_sizes(model, config: EngineConfig) -> tuple[int, int]:
    """(state slots, KV blocks) that `config.cache_mb` buys for `model` (weights or not: only the
    layer shapes count, so a model built on the meta device answers before any weight loads)."""
    from lpf.torch_utils import torch_dtype

    elem = torch_dtype(config.dtype).itemsize
    n_attn, n_kv, head_dim = model.kv_spec()
    slot_elem = torch_dtype(state_buffer_dtype(config)).itemsize
    slot_bytes = sum(prod(shape) for parts in model.state_specs() for _, shape in parts) * slot_elem
    block_bytes = n_attn * 2 * config.block_size * n_kv * head_dim * elem
    return config.cache_sizes(slot_bytes, block_bytes)


def state_buffer_dtype(config: EngineConfig) -> str:
    """The state slots' buffer dtype: the engine's, or a wider `mamba_ssm_cache_dtype` (the SSM part
    then keeps that precision; the conv part is still rounded to the engine dtype)."""
    ssm = config.mamba_ssm_cache_dtype
    return "float32" if ssm == "float32" and config.dtype != "float32" else config.dtype


class LLMEngine:
    def __init__(self, model_path: Path, config: EngineConfig, faults: FaultSet = FaultSet()):
        from lpf.builtin.models import load_model
        from lpf.torch_utils import torch_dtype

        self.config = config
        self.faults = faults
        dtype = torch_dtype(config.dtype)
        self.model = load_model(model_path, dtype=dtype, device=config.device)
        self.max_context = getattr(self.model.config, "max_position_embeddings", None)
        self.num_slots, self.num_blocks = cache_sizes(self.model, config)
        self.truth = GroundTruth()
        self.scheduler = Scheduler(config, self.num_slots, self.num_blocks, self.max_context,
                                   double_free=faults.kv_double_free, record=self.truth.record)
        ssm = config.mamba_ssm_cache_dtype
        self.runner = ModelRunner(self.model, self.num_slots, self.num_blocks, config.block_size, faults,
                                  self.truth, dtype, config.device,
                                  state_dtypes=(torch_dtype(state_buffer_dtype(config)),
                                                dtype if ssm == "auto" else torch_dtype(ssm)))
        self._trace: list[dict] = []

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
        return self.scheduler.abort(request_id)

    @property
    def num_free_slots(self) -> int:
        return self.scheduler.slots.num_free

    def step(self) -> list[Request]:
        so = self.scheduler.schedule()
        result = self.runner.execute(so)
        n, tokens = len(so.scheduled), so.total_tokens
        for s in so.scheduled:
            self._trace.append({"step": so.step, "request_id": s.request_id, "phase": result.phases[s.request_id],
                                "num_computed_tokens": s.num_computed_tokens,
                                "num_scheduled_tokens": s.num_scheduled_tokens, "state_slot": s.state_slot,
                                "batch_size": n, "batch_tokens": tokens, "preempted": False})
        for rid in so.preempted:
            self._trace.append({"step": so.step, "request_id": rid, "phase": None, "num_computed_tokens": 0,
                                "num_scheduled_tokens": 0, "state_slot": None, "batch_size": n,
                                "batch_tokens": tokens, "preempted": True})
        return self.scheduler.update(so, result.samples, result.prompt_rows)

    def drain_trace(self) -> pa.Table | None:
        if not self._trace:
            return None
        table = pa.Table.from_pylist(self._trace, schema=TRACE)
        self._trace = []
        return table

    def describe(self) -> dict:
        return {"num_state_slots": self.num_slots, "num_kv_blocks": self.num_blocks,
                "state_slot_stride": self.runner.state_cache.slot_stride, "faults": self.faults.names()}

