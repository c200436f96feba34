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

from pydantic import BaseModel, ConfigDict

from lpf.core.knobs import knob

# What `lpf.builtin.models` implements; kept here (no torch) so a run can be refused before it starts.
SUPPORTED_ARCHITECTURES = ("GraniteMoeHybridForCausalLM", "JambaForCausalLM")


class EngineConfig(BaseModel):
    """The engine's knobs (the builtin adapter's `Options` adds its own); roles and flags: lpf.core.knobs.
    shrink_order numbers are shared by every engine's knob of the same name (shrink.config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = knob(64, ge=1, help="Most requests in one engine step (vLLM's name).",
                             roles=("concurrency",), shrink_order=50, flag=True)
    max_num_batched_tokens: int = knob(256, ge=1, help="Token budget of one engine step (vLLM's name).",
                                       roles=("step_budget",), shrink_order=60, flag=True)
    block_size: int = knob(16, ge=1, help="Tokens per paged KV-cache block.", shrink_order=90)
    cache_mb: float = knob(64.0, gt=0, help="Built-in engine: cache size in MiB (the gpu_memory_utilization analogue).",
                           roles=("cache_size",), shrink_order=10, flag=True)
    enable_chunked_prefill: bool = knob(True, help="Split long prompts over several steps (vLLM's name).",
                                        shrink_order=70, flag=True)
    dtype: Literal["float32", "bfloat16", "float16"] = knob("float32", help="Engine dtype: float32, bfloat16 or float16.",
                                                            shrink_order=130, flag=True)
    # a wider state dtype buys fewer slots; not moved by shrink (a numeric choice, not a size)
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", help="dtype the SSM state is kept in between steps (vLLM's name); auto = the engine dtype",
        roles=("cache_size",))
    device: str = knob("cpu", help="Where the engine runs (cpu, cuda).")
    max_model_len: int | None = knob(None, ge=1, help="Longest prompt + output a request may have: outputs stop there "
                                     "and a longer prompt is refused (vLLM's name) [default: the model's context].",
                                     roles=("context_length",), shrink_order=120, flag=True)

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
