"""Engine adapters behind one interface (`base.Engine`), found through a lazy registry.

The registry maps names to "module:Class" strings so that `lpf --help` or an `hf` run never
imports vLLM, httpx or anything else another adapter needs.
"""

from __future__ import annotations

import importlib

from lpf.core.errors import LpfError, did_you_mean

REGISTRY: dict[str, str] = {
    "builtin": "lpf.adapters.builtin:BuiltinEngine",
    "hf": "lpf.adapters.hf:HFEngine",
    "vllm": "lpf.adapters.vllm:VLLMEngine",
    "openai": "lpf.adapters.openai:OpenAIEngine",
    "sglang": "lpf.adapters.sglang:SGLangEngine",
    "llamacpp": "lpf.adapters.llamacpp:LlamaCppEngine",
}


def engine_names() -> list[str]:
    return sorted(REGISTRY)


def capability(name: str, attr: str, default=None):
    """An engine's capability (a class attribute of its adapter, `lpf.adapters.base.Engine`), or `default`
    for a name no adapter is registered under (a run `lpf.compare` or `lpf watch` wrote)."""
    return getattr(get_engine_class(name), attr) if name in REGISTRY else default


def engines_with(attr: str) -> list[str]:
    """The registered engines whose capability `attr` is set (imports every adapter module: not for --help)."""
    return [n for n in engine_names() if getattr(get_engine_class(n), attr)]


def get_engine_class(name: str):
    if name not in REGISTRY:
        raise LpfError(f"unknown engine {name!r}{did_you_mean(name, REGISTRY)}; available: {', '.join(engine_names())}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)
