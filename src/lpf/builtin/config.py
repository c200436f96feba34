"""Engine configuration: knobs named as vLLM names them, validated once (a pydantic model: types,
ranges, unknown names refused).

`cache_mb` plays the role of vLLM's `gpu_memory_utilization`: the bytes given to caches. Half goes
to Mamba state slots and half to paged KV blocks (all of it to one kind when the model has only
that kind of layer), so shrinking it makes slots and blocks recycle sooner. `max_state_slots` caps the
slots alone (the KV half unchanged).

Prefix caching (`enable_prefix_caching`, vLLM's name) shares attention KV blocks by content hash and
checkpoints every Mamba layer's conv + SSM state at Mamba block boundaries (`mamba_block_size`
tokens, a multiple of `block_size`; vLLM's `--mamba-block-size`), as vLLM does for hybrids;
`mamba_cache_mode` is vLLM's: `align` (the scheduler keeps chunk ends on the boundaries where a
checkpoint is due; the state is saved at chunk ends) or `all` (chunks end anywhere; the Mamba layers
save the state at every boundary a chunk crosses). See `prefix_cache` and docs/builtin-engine.md.

`kv_cache_dtype` is vLLM's knob of that name: "auto" keeps K/V in the engine dtype; fp8 (e4m3) and fp8_e5m2
store them as float8 codes with a scale (`kv_cache_scales`: per tensor or per 16-element block; `kv_quant`).

`mamba_ssm_cache_dtype` is vLLM's knob of that name: the dtype the SSM part of each state slot is
stored in ("auto": the engine dtype). Stored in bfloat16 under a float32 engine, every decode step
rounds the recurrent state, so the error compounds with position (the hybrid-model RL mismatch that
NeMo-RL's recipes fix with `mamba_ssm_cache_dtype: float32`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from lpf.core.knobs import knob

# What `lpf.builtin.models` implements; kept here (no torch) so a run can be refused before it starts.
SUPPORTED_ARCHITECTURES = (
    "GraniteMoeHybridForCausalLM",
    "JambaForCausalLM",
    "Qwen3_5ForCausalLM",
    "KimiLinearForCausalLM",
)


class EngineConfig(BaseModel):
    """The engine's knobs (the builtin adapter's `Options` adds its own); roles and flags: lpf.core.knobs.
    shrink_order numbers are shared by every engine's knob of the same name (shrink.config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = knob(
        64,
        ge=1,
        help="Most requests in one engine step (vLLM's name).",
        roles=("concurrency",),
        shrink_order=50,
        flag=True,
    )
    max_num_batched_tokens: int = knob(
        256,
        ge=1,
        help="Token budget of one engine step (vLLM's name).",
        roles=("step_budget",),
        shrink_order=60,
        flag=True,
    )
    block_size: int = knob(16, ge=1, help="Tokens per paged KV-cache block.", shrink_order=90)
    cache_mb: float = knob(
        64.0,
        gt=0,
        help="Built-in engine: cache size in MiB (the gpu_memory_utilization analogue).",
        roles=("cache_size",),
        shrink_order=10,
        flag=True,
    )
    # the state half of cache_mb capped at a slot count, its KV half left as it is: the slot pool is
    # FIFO, so a slot is reused only once all of them were handed out, and a shrink that keeps 3 of
    # 2,000 requests needs a pool of 2 to reach a reused slot without starving their KV blocks
    max_state_slots: int | None = knob(
        None,
        ge=1,
        help="Built-in engine: at most this many Mamba state slots [default: as many as --cache-mb's state half holds].",
        roles=("state_slots",),
        shrink_order=15,
    )
    enable_chunked_prefill: bool = knob(
        True, help="Split long prompts over several steps (vLLM's name).", shrink_order=70, flag=True
    )
    dtype: Literal["float32", "bfloat16", "float16"] = knob(
        "float32", help="Engine dtype: float32, bfloat16 or float16.", shrink_order=130, flag=True
    )
    # a wider state dtype buys fewer slots; not moved by shrink (a numeric choice, not a size)
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto",
        help="dtype the SSM state is kept in between steps (vLLM's name); auto = the engine dtype",
        roles=("cache_size",),
    )
    device: str = knob("cpu", help="Where the engine runs (cpu, cuda).")
    # K and V quantized as they are written to the paged cache, dequantized as attention reads them (vLLM's
    # and SGLang's fp8 KV caches): `kv_quant`; judged against its own floor (floors.json "kv=fp8_e4m3")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = knob(
        "auto",
        help="KV cache precision (vLLM's name): auto (the engine dtype) or fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2: "
        "K/V quantized on write with a scale, dequantized on read.",
    )  # not moved by shrink: the configuration a run is judged against (and the KV drills need)
    kv_cache_scales: Literal["tensor", "block"] = knob(
        "tensor",
        help="Built-in engine, with an fp8 KV cache: per-tensor scales (one per layer for K and V, from the first "
        "write's amax, as vLLM's calculate_kv_scales) or per-block scales (each 16 elements of a head's row).",
    )

    max_model_len: int | None = knob(
        None,
        ge=1,
        help="Longest prompt + output a request may have: outputs stop there "
        "and a longer prompt is refused (vLLM's name) [default: the model's context].",
        roles=("context_length",),
        shrink_order=120,
        flag=True,
    )
    # attention KV blocks shared by content hash, Mamba conv + SSM state checkpointed at Mamba block
    # boundaries; a request resumes from the deepest boundary every layer hits (checkpoint slots come
    # out of --cache-mb's state half)
    enable_prefix_caching: bool = knob(
        False,
        help=(
            "Reuse cached prefixes: KV blocks by hash, Mamba state checkpoints (vLLM's name; built-in: -E "
            "mamba_block_size=N, -E mamba_cache_mode=align|all)."
        ),
        roles=("prefix_cache",),
        shrink_order=80,
        flag=True,
    )
    mamba_block_size: int | None = knob(
        None,
        ge=1,
        help=(
            "Tokens per Mamba state checkpoint with prefix caching (vLLM's --mamba-block-size): a multiple of "
            "block_size; default: block_size."
        ),
        shrink_order=85,
    )  # the checkpoint granularity
    mamba_cache_mode: Literal["align", "all"] = knob(
        "align",
        help=(
            "vLLM's mamba_cache_mode: align (chunk ends kept on the boundaries where a checkpoint is due) or all "
            "(the Mamba layers checkpoint every boundary a chunk crosses)."
        ),
    )

    # speculative decoding (vLLM's speculative_config, methods "ngram" and "draft_model"): a decoding
    # request's next tokens proposed by prompt lookup or a draft model and verified, with its last sampled
    # token, in one pass of 1 + K positions
    speculative: str | None = knob(
        None,
        help=(
            "Speculative decoding: ngram:K (n-gram prompt lookup proposing up to K draft tokens per step) or "
            "draft:MODEL:K (a draft model with the target's vocabulary, e.g. draft:zoo:llama:4, proposing K "
            "tokens and their probabilities), verified in one forward pass (vLLM's speculative_config) "
            "[default: off]."
        ),
        roles=("speculative",),
        shrink_order=75,
    )

    @model_validator(mode="after")
    def _speculative_known(self) -> "EngineConfig":
        if self.speculative is not None:
            method, _, rest = self.speculative.partition(":")
            model, _, k = rest.rpartition(":")
            ok = k.isdigit() and 1 <= int(k) <= 16 and (method == "ngram" and not model or method == "draft" and model)
            if not ok:
                raise ValueError(
                    f"speculative must be ngram:K or draft:MODEL:K with K in 1..16, got {self.speculative!r}"
                )
        return self

    @property
    def kv_quantized(self) -> str | None:
        """The KV cache's quantized type in the manifest's spelling ("fp8" is e4m3), or None (the engine dtype)."""
        return (
            None if self.kv_cache_dtype == "auto" else {"fp8": "fp8_e4m3"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        )

    @property
    def num_speculative_tokens(self) -> int:
        """K, the draft tokens proposed per verify step (0: speculation off)."""
        return int(self.speculative.rpartition(":")[2]) if self.speculative else 0

    @property
    def draft_model(self) -> str | None:
        """The draft model's spec with -E speculative=draft:MODEL:K, else None."""
        if not self.speculative or not self.speculative.startswith("draft:"):
            return None
        return self.speculative.partition(":")[2].rpartition(":")[0]

    @model_validator(mode="after")
    def _mamba_blocks_hold_whole_kv_blocks(self) -> "EngineConfig":
        if self.mamba_block_size is not None and self.mamba_block_size % self.block_size:
            raise ValueError(
                f"mamba_block_size ({self.mamba_block_size}) must be a multiple of block_size "
                f"({self.block_size}): a checkpoint boundary must end a KV block"
            )
        return self

    @property
    def checkpoint_block_size(self) -> int:
        """Tokens per Mamba checkpoint block (mamba_block_size, or block_size when not given)."""
        return self.mamba_block_size or self.block_size

    @classmethod
    def of(cls, options: BaseModel) -> "EngineConfig":
        """The engine's own fields of a larger options model (the adapter's, which adds knobs)."""
        return cls(**{name: getattr(options, name) for name in cls.model_fields})

    def cache_sizes(self, slot_bytes: int, block_bytes: int) -> tuple[int, int]:
        """(number of state slots, number of KV blocks) for this cache size."""
        total = int(self.cache_mb * 2**20)
        if slot_bytes and block_bytes:
            slots, blocks = max(1, total // 2 // slot_bytes), max(1, total // 2 // block_bytes)
        else:
            slots = max(1, total // slot_bytes) if slot_bytes else 1
            blocks = max(1, total // block_bytes) if block_bytes else 1
        return (min(slots, self.max_state_slots) if self.max_state_slots else slots), blocks
