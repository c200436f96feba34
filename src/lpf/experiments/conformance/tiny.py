"""Tiny checkpoints of every hybrid architecture, each from that architecture's own default config.

Contract: `build_tiny(model_type) -> Path` returns a local HF directory (config.json, safetensors,
lpf's zoo tokenizer, a neutral generation config) for `transformers.AutoConfig.for_model(model_type)`
with only its sizes scaled down (`SCALE[model_type]`, the table in `tiny_recipes`, which says what it
scales and its few exceptions) and the vocabulary set to the zoo tokenizer's. Every other field keeps
the architecture's default, because a field the engine ignores is exactly what conformance looks for.
Weights are random with seed 0 and `initializer_range` 0.25 (peaked next-token distributions, as
the `tiny:` models: a flat distribution hides a lie). Deterministic and cached under
`$LPF_CACHE/conformance/<model_type>-<key>`, the key hashing the config and the tokenizer, built in a
temporary directory and renamed (a concurrent or killed build never leaves half a model). Nothing is
downloaded. `known_model_types()` lists the recipes; `LpfError` for any other. `build_tiny(model_type,
overrides)` builds a config variant (`variants.Variant.overrides` over the recipe's fields), cached
under its own key, and with `random_biases` every bias the init leaves at zero drawn at random (the
variants' builds: a zero bias is one an engine could drop unseen); `tiny_default_config(model_type)` is
the recipe's whole config as a dict.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lpf.core.errors import LpfError, did_you_mean
from lpf.experiments.conformance.tiny_recipes import SCALE

__all__ = ["SCALE", "build_tiny", "known_model_types", "tiny_config", "tiny_default_config"]

INIT_RANGE = 0.25


def known_model_types() -> list[str]:
    return sorted(SCALE)


def tiny_config(model_type: str, vocab_size: int, special: dict, overrides: dict | None = None) -> dict:
    """The scaled-down config's fields: `SCALE[model_type]` over the architecture's defaults, and a
    config variant's `overrides` (lpf.experiments.conformance.variants) over those."""
    if model_type not in SCALE:
        raise LpfError(
            f"no tiny recipe for model type {model_type!r}{did_you_mean(model_type, SCALE)}; "
            f"recipes: {', '.join(known_model_types())}"
        )
    return {
        **SCALE[model_type],
        "vocab_size": vocab_size,
        "initializer_range": INIT_RANGE,
        **special,
        **(overrides or {}),
    }


def tiny_default_config(model_type: str) -> dict:
    """The tiny recipe's full config as a dict (every field, defaults included), without building weights."""
    from transformers import AutoConfig

    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    return AutoConfig.for_model(model_type, **tiny_config(model_type, 512, {})).to_dict()


def _randomise_zero_biases(model, torch) -> None:
    """Every bias the init left at exactly zero drawn from N(0, INIT_RANGE) (seed 1): a zero bias is one an
    engine could ignore unseen, and a variant that switches a bias on must make it count."""
    gen = torch.Generator().manual_seed(1)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "bias" in name.rsplit(".", 1)[-1] and t.is_floating_point() and t.numel() and not t.any():
            with torch.no_grad():
                t.copy_(torch.empty_like(t).normal_(0.0, INIT_RANGE, generator=gen))


def build_tiny(model_type: str, overrides: dict | None = None, random_biases: bool = False) -> Path:
    from lpf.core.model_specs import ModelRef, cache_root, load_tokenizer, save_model_dir
    from lpf.zoo.registry import tokenizer_dir

    tok_dir = tokenizer_dir()
    tok_hash = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()[:12]
    tok = load_tokenizer(ModelRef("zoo tokenizer", tok_dir))
    special = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    fields = tiny_config(model_type, len(tok), special, overrides)
    import transformers

    payload = [model_type, fields, tok_hash, transformers.__version__] + (["random_biases"] if random_biases else [])
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_root() / "conformance" / f"{model_type}-{key}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    try:
        config = AutoConfig.for_model(model_type, **fields)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if random_biases:
            _randomise_zero_biases(model, torch)
    except Exception as e:  # noqa: BLE001 - a recipe this transformers cannot build: one line, not a trace
        raise LpfError(
            f"transformers {transformers.__version__} cannot build a tiny {model_type}: "
            f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        ) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_model_dir(model, tok, special, out)
