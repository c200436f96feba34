"""Engine configuration: knobs named as vLLM names them, validated once.

`cache_mb` plays the role of vLLM's `gpu_memory_utilization`: the bytes given to caches. Half goes
to Mamba state slots and half to paged KV blocks (all of it to one kind when the model has only
that kind of layer), so shrinking it makes slots and blocks recycle sooner.
"""

from __future__ import annotations

from dataclasses import dataclass

from lpf.errors import LpfError

# What `lpf.engine.models` implements; kept here (no torch) so a run can be refused before it starts.
SUPPORTED_ARCHITECTURES = ("GraniteMoeHybridForCausalLM", "JambaForCausalLM")


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    block_size: int = 16
    cache_mb: float = 64.0
    enable_chunked_prefill: bool = True
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise LpfError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.cache_mb > 0:
            raise LpfError(f"cache_mb must be > 0, got {self.cache_mb}")

    def cache_sizes(self, slot_bytes: int, block_bytes: int) -> tuple[int, int]:
        """(number of state slots, number of KV blocks) for this cache size."""
        total = int(self.cache_mb * 2**20)
        if slot_bytes and block_bytes:
            return max(1, total // 2 // slot_bytes), max(1, total // 2 // block_bytes)
        return (max(1, total // slot_bytes) if slot_bytes else 1), (max(1, total // block_bytes) if block_bytes else 1)
