"""Qwen3.5 text model (`Qwen3_5ForCausalLM`): Gated DeltaNet layers and gated full attention.

Contract: an `EngineModel` (see `base`) equal in float32, up to rounding, to transformers'
`modeling_qwen3_5` text model: per layer a pre-norm mixer, either `linear_attention` (Gated DeltaNet,
`gated_deltanet`, its state in the state-slot cache like a Mamba layer's) or `full_attention` (the
gated attention below, K/V in the paged cache), and a pre-norm gated MLP, each added back; every
RMS norm but the GDN output norm is zero-centred (weight applied as 1 + w, in float32). The full
attention projects q and a per-head output gate together (q_proj has 2 x heads x head_dim rows, each
head's [q | gate]), RMS-norms q and k per head, applies RoPE to the first `partial_rotary_factor` of
each head's dims only, and multiplies the attention output by sigmoid(gate) before o_proj. Text only:
Qwen3.5's multimodal RoPE has equal positions on all three grids for text, where it is plain RoPE;
other rope types raise `LpfError`. The MTP head (`mtp.*` in a full checkpoint) is not loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from lpf.builtin.models.attention import PagedAttention, Rotary, apply_rope
from lpf.builtin.models.base import EngineModel
from lpf.builtin.models.gated_deltanet import GatedDeltaNetMixer
from lpf.builtin.models.layers import GatedMLP, embedding, wide
from lpf.core.errors import LpfError


class CenteredRMSNorm(nn.Module):
    """Qwen3.5's RMS norm: weight stored as an offset from 1, the product taken in float32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = wide(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + wide(self.weight))).to(x.dtype)


class GatedAttention(PagedAttention):
    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool, eps: float, layer: int):
        super().__init__(hidden, n_heads, n_kv_heads, head_dim, head_dim**-0.5, bias, attn_layer=layer)
        self.q_proj = nn.Linear(hidden, 2 * n_heads * head_dim, bias=bias)
        self.q_norm = CenteredRMSNorm(head_dim, eps)
        self.k_norm = CenteredRMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        T = x.shape[0]
        q, gate = self.q_proj(x).view(T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(T, self.n_kv, self.head_dim))
        v = self.v_proj(x).view(T, self.n_kv, self.head_dim)
        q, k = _partial_rope(q, rope), _partial_rope(k, rope)
        out = self.attend(q, k, v).reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(out)


def _partial_rope(x: torch.Tensor, rope) -> torch.Tensor:
    """RoPE on the first `cos.shape[-1]` dims of each head; the rest pass through."""
    cos, sin = rope
    n = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :n], cos, sin), x[..., n:]], dim=-1)


class Qwen35Layer(nn.Module):
    def __init__(self, config, kind: str, ordinal: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = CenteredRMSNorm(H, eps)
        self.post_attention_layernorm = CenteredRMSNorm(H, eps)
        self.is_mamba = kind == "linear_attention"
        if self.is_mamba:
            self.linear_attn = GatedDeltaNetMixer(
                H,
                config.linear_num_key_heads,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                config.linear_conv_kernel_dim,
                config.hidden_act,
                eps,
                mamba_layer=ordinal,
            )
        else:
            self.self_attn = GatedAttention(
                H,
                config.num_attention_heads,
                config.num_key_value_heads,
                _head_dim(config),
                config.attention_bias,
                eps,
                ordinal,
            )
        self.mlp = GatedMLP(H, config.intermediate_size, config.hidden_act)

    def forward(self, h, rope):
        mixer = (
            self.linear_attn(self.input_layernorm(h))
            if self.is_mamba
            else self.self_attn(self.input_layernorm(h), rope)
        )
        h = h + mixer
        return h + self.mlp(self.post_attention_layernorm(h))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rotary(config) -> Rotary:
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise LpfError(f"Qwen3.5 rope type {rope_type!r} is not supported by the built-in engine (default only)")
    dim = int(_head_dim(config) * params.get("partial_rotary_factor", 1.0))
    return Rotary(dim, params.get("rope_theta", 10000.0))


class Qwen35Model(EngineModel):
    final_norm_name = "norm"

    def __init__(self, config):
        super().__init__(config)
        H = config.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = embedding(config.vocab_size, H)
        layers, counts = [], {"linear_attention": 0, "full_attention": 0}
        for kind in config.layer_types[: config.num_hidden_layers]:
            if kind not in counts:
                raise LpfError(f"Qwen3.5 layer type {kind!r} is not supported by the built-in engine")
            layers.append(Qwen35Layer(config, kind, counts[kind]))
            counts[kind] += 1
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = CenteredRMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)
        self.rotary = _rotary(config)

    def mamba_mixers(self):
        return [layer.linear_attn for layer in self.model.layers if layer.is_mamba]

    def attention_layers(self):
        return [layer.self_attn for layer in self.model.layers if not layer.is_mamba]

    def rename_checkpoint_keys(self, sd: dict) -> dict:
        # a full Qwen3.5 checkpoint also holds the MTP head and (multimodal) the vision tower, which
        # HF's Qwen3_5ForCausalLM ignores too
        return {k: v for k, v in sd.items() if not k.startswith(("mtp.", "model.visual."))}
