"""The built-in engine's own model implementations, loading Hugging Face checkpoints.

Contract: `load_model(path, dtype=torch.float32, device="cpu") -> EngineModel` reads `config.json`
and the `*.safetensors` weights of an HF directory and dispatches on `architectures[0]`:
`GraniteMoeHybridForCausalLM` (Mamba2 + attention, `granite_hybrid`) and `JambaForCausalLM`
(Mamba1 + attention + MoE, `jamba`), `Qwen3_5ForCausalLM` (Gated DeltaNet + gated attention,
`qwen3_5`) and `KimiLinearForCausalLM` (Kimi Delta Attention layers only, `kimi_linear`). Anything else raises `LpfError`. The models run only inside the
engine: per-step metadata comes from `lpf.builtin.forward_context`, attention K/V live in the paged
`KVCache`, Mamba (and Gated DeltaNet) conv/SSM state in the `StateCache` slots (see `base.EngineModel` for the interface).

Modules: `layers` (norms, MLPs, MoE), `attention` (paged causal attention, RoPE), `mamba_base` (the
prefill/extend/decode state protocol), `mamba2` (SSD scan), `mamba1` (selective scan, token by token), `gated_deltanet` (the gated delta rule,
a matrix state per head, on the same state protocol), `qwen3_5` (the Qwen3.5 text model), `kimi_delta`
(KDA: the delta rule with a per-channel decay), `kimi_linear` (the Kimi Linear model, KDA layers).
"""

from __future__ import annotations

import json
from pathlib import Path

from lpf.builtin.config import SUPPORTED_ARCHITECTURES
from lpf.builtin.models.base import EngineModel
from lpf.core.errors import LpfError

__all__ = ["EngineModel", "load_model", "model_shape", "SUPPORTED_ARCHITECTURES"]


def _model_class(arch: str):
    if arch == "GraniteMoeHybridForCausalLM":
        from lpf.builtin.models.granite_hybrid import GraniteHybridModel

        return GraniteHybridModel
    if arch == "JambaForCausalLM":
        from lpf.builtin.models.jamba import JambaModel

        return JambaModel
    if arch == "Qwen3_5ForCausalLM":
        from lpf.builtin.models.qwen3_5 import Qwen35Model

        return Qwen35Model
    if arch == "KimiLinearForCausalLM":
        from lpf.builtin.models.kimi_linear import KimiLinearModel

        return KimiLinearModel
    raise LpfError(
        f"the built-in engine runs GraniteMoeHybrid, Jamba, Qwen3.5 and Kimi Linear (KDA) models; {arch} is not supported"
    )


def model_shape(path) -> EngineModel:
    """The `EngineModel` of the HF directory `path` on the meta device: its layer shapes (cache
    sizes) without reading a weight."""
    import torch

    cls, config = _class_and_config(Path(path))
    with torch.device("meta"):
        return cls(config)


def _class_and_config(path: Path):
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise LpfError(f"model {path}: unreadable config.json ({e})") from None
    arch = (raw.get("architectures") or ["<no architectures in config.json>"])[0]
    cls = _model_class(arch)
    from transformers import AutoConfig

    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    return cls, AutoConfig.from_pretrained(path)


def load_model(path, dtype=None, device="cpu") -> EngineModel:
    """An `EngineModel` with the weights of the HF directory `path`, in eval mode, no grads."""
    import torch

    path = Path(path)
    cls, config = _class_and_config(path)
    with torch.device("meta"):  # weights come from the checkpoint; skip random init
        model = cls(config)
    return model.load_checkpoint(path, dtype or torch.float32, device)
