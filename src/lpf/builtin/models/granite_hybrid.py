"""GraniteMoeHybrid (`GraniteMoeHybridForCausalLM`): Mamba2 and attention layers, shared MLP (+ MoE).

Contract: an `EngineModel` (see `base`) equal in float32, up to rounding, to HF's
`modeling_granitemoehybrid`: embeddings times `embedding_multiplier`; per layer pre-norm mixer
(Mamba2 or attention scaled by `attention_multiplier`, RoPE only when `position_embedding_type ==
"rope"`) and pre-norm MLP, each branch added back times `residual_multiplier`; the MLP is the shared
dense MLP, plus the sparse MoE when `num_local_experts > 0`; logits divided by `logits_scaling`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from lpf.builtin.models.attention import PagedAttention, Rotary
from lpf.builtin.models.base import EngineModel
from lpf.builtin.models.layers import FusedGatedMLP, GraniteMoE, RMSNorm, embedding
from lpf.builtin.models.mamba2 import Mamba2Mixer
from lpf.core.errors import LpfError

MAMBA_TYPES = ("mamba", "linear_attention")
ATTENTION_TYPES = ("attention", "full_attention")


class GraniteHybridLayer(nn.Module):
    def __init__(self, config, kind: str, ordinal: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.residual_multiplier = config.residual_multiplier
        self.is_mamba = kind == "mamba"
        if self.is_mamba:
            self.mamba = Mamba2Mixer(
                H,
                config.mamba_n_heads,
                config.mamba_d_head,
                config.mamba_n_groups,
                config.mamba_d_state,
                config.mamba_d_conv,
                int(config.mamba_expand * H),
                config.mamba_chunk_size,
                config.mamba_conv_bias,
                config.mamba_proj_bias,
                config.hidden_act,
                eps,
                config.time_step_limit,
                mamba_layer=ordinal,
            )
        else:
            n_heads = config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or H // n_heads
            self.self_attn = PagedAttention(
                H,
                n_heads,
                config.num_key_value_heads,
                head_dim,
                config.attention_multiplier,
                config.attention_bias,
                attn_layer=ordinal,
            )
        self.shared_mlp = FusedGatedMLP(H, config.shared_intermediate_size, config.hidden_act)
        if (config.num_local_experts or 0) > 0:
            self.block_sparse_moe = GraniteMoE(
                H, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok, config.hidden_act
            )
        else:
            self.block_sparse_moe = None

    def forward(self, h, rope):
        residual = h
        h = self.input_layernorm(h)
        h = self.mamba(h) if self.is_mamba else self.self_attn(h, rope)
        h = residual + h * self.residual_multiplier
        residual = h
        h = self.post_attention_layernorm(h)
        mlp = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            mlp = self.block_sparse_moe(h) + mlp
        return residual + mlp * self.residual_multiplier


def _layer_kinds(config) -> list[str]:
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    kinds = []
    for t in types:
        if t in MAMBA_TYPES:
            kinds.append("mamba")
        elif t in ATTENTION_TYPES:
            kinds.append("attention")
        else:
            raise LpfError(f"GraniteMoeHybrid layer type {t!r} is not supported by the built-in engine")
    return kinds


def _rotary(config, head_dim: int) -> Rotary | None:
    if getattr(config, "position_embedding_type", None) != "rope":
        return None
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return Rotary(head_dim, params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if rope_type.startswith("dynamic"):
        raise LpfError(f"rope type {rope_type!r} (length-dependent) is not supported by the built-in engine")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return Rotary(head_dim, 0.0, inv_freq=inv_freq, scaling=scaling)


class GraniteHybridModel(EngineModel):
    final_norm_name = "norm"

    def __init__(self, config):
        super().__init__(config)
        H = config.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = embedding(config.vocab_size, H)
        layers, counts = [], {"mamba": 0, "attention": 0}
        for kind in _layer_kinds(config):
            layers.append(GraniteHybridLayer(config, kind, counts[kind]))
            counts[kind] += 1
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)
        self.embedding_multiplier = config.embedding_multiplier
        self.logits_scaling = config.logits_scaling
        attn = self.attention_layers()
        self.rotary = _rotary(config, attn[0].head_dim) if attn else None

    def mamba_mixers(self):
        return [layer.mamba for layer in self.model.layers if layer.is_mamba]

    def attention_layers(self):
        return [layer.self_attn for layer in self.model.layers if not layer.is_mamba]

    def rename_checkpoint_keys(self, sd: dict) -> dict:
        # transformers >= 5 keeps experts as `experts.gate_up_proj` in memory; files saved by it
        # use the original GraniteMoe names, which are ours. Accept both.
        renames = [
            (r"block_sparse_moe\.experts\.gate_up_proj$", "block_sparse_moe.input_linear.weight"),
            (r"block_sparse_moe\.experts\.down_proj$", "block_sparse_moe.output_linear.weight"),
            (r"block_sparse_moe\.router\.weight$", "block_sparse_moe.router.layer.weight"),
        ]
        out = {}
        for k, v in sd.items():
            for pat, new in renames:
                k = re.sub(pat, new, k)
            out[k] = v
        return out
