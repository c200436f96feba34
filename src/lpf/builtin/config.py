"""Engine configuration: knobs named as vLLM names them, validated once (a pydantic model: types,
ranges, unknown names refused).

`cache_mb` plays the role of vLLM's `gpu_memory_utilization`: the bytes given to caches. Half goes
to Mamba state slots and half to paged KV blocks (all of it to one kind when the model has only
that kind of layer), so shrinking it makes slots and blocks recycle sooner.

`mamba_ssm_cache_dtype` is vLLM's knob of that name: the dtype the SSM part of each state slot is
stored in ("auto": the engine dtype). Stored in bfloat16 under a float32 engine, every decode step
rounds the recurrent state, so the error compounds with position (the hybrid-model RL mismatch that
NeMo-RL's recipes fix with `mamba_ssm_cache_dtype: float32`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# What `lpf.builtin.models` implements; kept here (no torch) so a run can be refused before it starts.
SUPPORTED_ARCHITECTURES = ("GraniteMoeHybridForCausalLM", "JambaForCausalLM")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(256, ge=1)
    block_size: int = Field(16, ge=1)
    cache_mb: float = Field(64.0, gt=0)
    enable_chunked_prefill: bool = True
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # sizes the cache (a wider state dtype buys fewer slots)
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype the SSM state is kept in between steps (vLLM's name); auto = the engine dtype")
    device: str = "cpu"

    @classmethod
    def of(cls, options: BaseModel) -> "EngineConfig":
        """The engine's own fields of a larger options model (the adapter's, which adds knobs)."""
        return cls(**{name: getattr(options, name) for name in cls.model_fields})

    def cache_sizes(self, slot_bytes: int, block_bytes: int) -> tuple[int, int]:
        """(number of state slots, number of KV blocks) for this cache size."""
        total = int(self.cache_mb * 2**20)
        if slot_bytes and block_bytes:
            return max(1, total // 2 // slot_bytes), max(1, total // 2 // block_bytes)
        return (max(1, total // slot_bytes) if slot_bytes else 1), (max(1, total // block_bytes) if block_bytes else 1)
