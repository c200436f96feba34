"""Engine configuration: knobs named as vLLM names them, validated once (a pydantic model: types,
ranges, unknown names refused).

`cache_mb` plays the role of vLLM's `gpu_memory_utilization`: the bytes given to caches. Half goes
to Mamba state slots and half to paged KV blocks (all of it to one kind when the model has only
that kind of layer), so shrinking it makes slots and blocks recycle sooner.
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
