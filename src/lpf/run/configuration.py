"""The engine's configuration as a run records it (`manifest.json`'s `engine.configuration`): per field, its
value and where that value came from.

Contract: `FIELDS` are what an engine computes with that moves its floor: `dtype` (the dtype it computes
in, or lpf's GGUF type name for a quantized llama.cpp file), `kv_cache_dtype`, `kv_cache_scale` (the
per-tensor scale a quantized KV cache is written with, where the engine says: vLLM's layers hold 1.0 unless the
checkpoint gives scales; a number, or {"k", "v"}), `flash_attention` ("on" |
"off"), `weight_quantization` ("none" when the engine says its weights are a float type; else the scheme,
e.g. "Q4_K - Medium", "fp8", "awq") and `sampling_defaults` (the defaults the server applies to a request
that does not set them, e.g. llama-server's repeat_penalty, as a {name: value} dict; `penalty_scope`, where the
server says which tokens its penalties see: "output" for llama-cpp-python's server).
`block(read, declared)` is the block: {field: {"value", "source", "via"}} with source
- "engine": the engine said it (read in-process, over HTTP, or set by lpf on an engine lpf started);
  `via` names where ("GET /props model_ftype", "llama-server -fa on: ...", "vllm_config.cache_config").
  A declared value that disagrees is kept beside it (`declared`, `conflict: true`): the engine's own
  word wins, the disagreement is evidence for the analysis;
- "declared": only the user said it (`--dtype` for a server the user started, `--kv-cache-dtype`,
  `--flash-attention`, `--weight-quantization`); `via` names the option;
- "absent": neither (value null, via null).
Dtype names are canonical (`canonical_dtype`: "f32", "fp32", "torch.float32" -> "float32"; KV types such
as "q8_0" or "fp8_e4m3" kept as given, lower-cased; "fp8" is "fp8_e4m3", as vLLM means it). Pure: dicts in, a dict out.
"""

from __future__ import annotations

from typing import Any

FIELDS = ("dtype", "kv_cache_dtype", "kv_cache_scale", "flash_attention", "weight_quantization", "sampling_defaults")
DECLARED_BY = {
    "dtype": "--dtype",
    "kv_cache_dtype": "--kv-cache-dtype",
    "flash_attention": "--flash-attention",
    "weight_quantization": "--weight-quantization",
}
_ALIASES = {
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "fp8_e4m3",  # vLLM's and SGLang's "fp8" KV cache is e4m3 (fnuz on ROCm, the same format's range)
}


def canonical_dtype(value: Any) -> Any:
    """A dtype name in lpf's spelling ("float32", "bfloat16", "float16"); other names lower-cased as given."""
    if not isinstance(value, str):
        return value
    v = value.strip().lower().removeprefix("torch.")
    return _ALIASES.get(v, v)


def _canonical(field: str, value: Any) -> Any:
    if field in ("dtype", "kv_cache_dtype"):
        return canonical_dtype(value)
    if field == "flash_attention" and isinstance(value, bool):
        return "on" if value else "off"
    return value


def block(read: dict[str, tuple[Any, str]], declared: dict[str, Any] | None) -> dict[str, dict]:
    """The configuration block of a run: every field of `FIELDS`, from what the engine said (`read`:
    {field: (value, via)}) and what the user declared (`declared`: {field: value})."""
    declared = {k: _canonical(k, v) for k, v in (declared or {}).items() if v is not None}
    out: dict[str, dict] = {}
    for field in FIELDS:
        value, via = read.get(field, (None, None))
        value = _canonical(field, value)
        said = declared.get(field)
        if value is not None:
            entry = {"value": value, "source": "engine", "via": via}
            if said is not None and said != value:
                entry.update(declared=said, conflict=True)
        elif said is not None:
            entry = {"value": said, "source": "declared", "via": DECLARED_BY.get(field)}
        else:
            entry = {"value": None, "source": "absent", "via": None}
        out[field] = entry
    return out
