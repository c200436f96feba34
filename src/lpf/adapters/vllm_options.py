"""What a user may set for the `vllm` engine, and the checks those settings pass before vLLM starts.

Contract: `VLLMOptions` is the engine's knob schema (vLLM's own names, passed to `vllm.LLM` as given, plus
lpf's: `cpu_kvcache_space`, the trace plugin's `trace`/`trace_dir`, its drills in `inject`, `lpf locate`'s
`capture`); an invalid combination raises `LpfError` in one line when the options are built, never after
a worker started. `VLLM_DRILLS` are the drills lpf-vllm-trace re-creates; the prefix-cache drills run
under `PREFIX_DRILL_KNOBS` on the CPU build and are named by the hypotheses in `PREFIX_DRILL_NAMED_BY`.
Running the worker is `lpf.adapters.vllm`'s job.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, field_validator, model_validator

from lpf.adapters.base import Options
from lpf.core.errors import LpfError
from lpf.core.knobs import knob

VLLM_DRILLS = ("stale-state", "offset-wrap", "publish-before-write", "unaligned-chunk-hashed")
# the prefix-cache drills: the knobs they run under on the CPU build (prefix caching on, a step budget below the
# 128-token Mamba block: docs/real-engines.md) and the hypothesis that names each (bench/bugs.py, the tests)
PREFIX_DRILL_KNOBS = {
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 48,
    "max_num_seqs": 4,
}
PREFIX_DRILL_NAMED_BY = {
    "publish-before-write": {"resumed_in_publishing_step"},
    "unaligned-chunk-hashed": {"resumed_truncated_state"},
}


class VLLMOptions(Options):
    # None: vLLM's own default (the knob is not passed to vllm.LLM)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = knob(
        "float32", help="vLLM's dtype (auto: the model's).", shrink_order=130, flag=True
    )
    seed: int | None = Field(None, description="Engine seed [default: the run's --seed].")
    gpu_memory_utilization: float | None = knob(
        None,
        gt=0,
        le=1,
        help="Share of GPU memory vLLM may take (its cache size on a GPU).",
        roles=("cache_size",),
        shrink_order=20,
    )
    max_num_seqs: int | None = knob(
        None, ge=1, help="Most requests in one engine step.", roles=("concurrency",), shrink_order=50, flag=True
    )
    max_num_batched_tokens: int | None = knob(
        None, ge=1, help="Token budget of one engine step.", roles=("step_budget",), shrink_order=60, flag=True
    )
    enable_chunked_prefill: bool | None = knob(
        None, help="Split long prompts over several steps.", shrink_order=70, flag=True
    )
    enable_prefix_caching: bool | None = knob(
        None, help="Automatic prefix caching (vLLM turns it on by default).", roles=("prefix_cache",), shrink_order=80
    )
    enforce_eager: bool = knob(True, help="No CUDA graphs / compile: faster start, same numerics.")
    max_model_len: int | None = knob(
        None,
        ge=1,
        help="Longest prompt + output a request may have.",
        roles=("context_length",),
        shrink_order=120,
        flag=True,
    )
    num_gpu_blocks_override: int | None = knob(
        None, ge=1, help="KV-cache blocks (state slots come from them too).", roles=("cache_size",), shrink_order=40
    )
    # not a named flag: `lpf audit --kv-cache-dtype` declares it, and for an engine lpf starts declaring is configuring
    # (pipeline.audit_options passes the declared value here); vLLM's CPU build runs fp8 on AVX-512 CPUs
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = knob(
        None, help="vLLM's kv_cache_dtype: the KV cache's precision (auto: the model's dtype) [default: vLLM's]."
    )
    tensor_parallel_size: int | None = knob(
        None, ge=1, help="GPUs one model is split over (vLLM's tensor parallelism)."
    )
    batch_invariant: bool = knob(
        False,
        help="vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1): a request's logprobs do not depend on what "
        "shares its batch, where this vLLM's kernels support it (vLLM refuses at start where they do not).",
    )
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = knob(
        "raw_logprobs", help="What vLLM returns as logprobs (raw: the model's, before any processing)."
    )
    cpu_kvcache_space: int = knob(
        1,
        ge=1,
        help="CPU build: KV-cache GiB, whole (VLLM_CPU_KVCACHE_SPACE; vLLM reads an int).",
        roles=("cache_size",),
        shrink_order=30,
    )
    start_timeout_s: float = knob(600.0, gt=0, help="Seconds vLLM may take to start.")
    trace: bool = knob(True, help="The lpf-vllm-trace plugin records the step trace.")
    trace_dir: str | None = knob(None, help="Where the plugin writes [default: a private temporary directory].")
    inject: str = knob(
        "",
        help="Drills through the plugin: stale-state, offset-wrap[:BITS], "
        "publish-before-write, unaligned-chunk-hashed (these two with -E enable_prefix_caching=true).",
        flag=True,
        repeatable=True,
        metavar="FAULT[:ARG]",
    )
    speculative_config: str | None = knob(
        None,
        help="vLLM's speculative decoding, a JSON object as vLLM takes it, e.g. "
        '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3} (vLLM checks the rest).',
        shrink_order=90,
        metavar="JSON",
    )
    capture: str | None = knob(
        None, help="lpf locate's capture spec (a JSON file) for lpf-vllm-trace: set by lpf locate, not by hand."
    )

    @field_validator("inject")
    @classmethod
    def _known_drills(cls, value: str) -> str:
        from lpf.builtin.faults import FaultSet

        names = [n.partition(":")[0] for n in FaultSet.parse(value).names()]  # unknown names: LpfError
        missing = [n for n in names if n not in VLLM_DRILLS]
        if missing:
            raise LpfError(
                f"the vllm engine has no drill {missing[0]!r}: it re-creates "
                f"{', '.join(VLLM_DRILLS)} through lpf-vllm-trace (the built-in engine has them all)"
            )
        return value

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_json(cls, value):
        # kept as canonical JSON text (options are frozen and hashable; shrink moves it to None: speculation
        # off); the worker hands vllm.LLM the object. Only its shape is checked here: vLLM's own
        # SpeculativeConfig says what it refuses, in one line, when the worker starts
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise LpfError(f"speculative_config must be a JSON object: {e.msg} at character {e.pos}") from None
        if not isinstance(value, dict) or not value:
            raise LpfError(
                'speculative_config must be a non-empty JSON object, e.g. {"method":"ngram","num_speculative_tokens":3}'
            )
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    @model_validator(mode="after")
    def _prefix_drills_need_the_cache(self):
        drills = [d for d in PREFIX_DRILL_NAMED_BY if d in self.inject.split(",")]
        if drills and self.enable_prefix_caching is False:
            raise LpfError(
                f"--inject {drills[0]} re-creates a prefix-caching bug: it needs -E enable_prefix_caching=true"
            )
        return self

    @model_validator(mode="after")
    def _step_budget_holds_every_sequence(self):
        # vLLM's own SchedulerConfig check (vllm/config/scheduler.py, verify_max_model_len), said before
        # vLLM starts; lpf shrink reads it as a refused move instead of a candidate that cannot start
        if (
            self.max_num_batched_tokens is not None
            and self.max_num_seqs is not None
            and self.max_num_batched_tokens < self.max_num_seqs
        ):
            raise LpfError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): vLLM refuses a step budget smaller than its sequence count"
            )
        return self
