"""Jamba (`JambaForCausalLM`): Mamba1 (with dt/B/C RMSNorms) and attention layers, MLP or MoE FFNs.

Contract: an `EngineModel` (see `base`) equal in float32, up to rounding, to HF's `modeling_jamba`.
Layer i is attention when `i % attn_layer_period == attn_layer_offset`, else Mamba; its FFN is the
sparse MoE when `i % expert_layer_period == expert_layer_offset` (and num_experts > 1), else a dense
MLP. Attention has no positional embedding and the usual 1/sqrt(head_dim) scale; no multipliers.
"""

from __future__ import annotations

from torch import nn

from lpf.builtin.models.attention import PagedAttention
from lpf.builtin.models.base import EngineModel
from lpf.builtin.models.layers import GatedMLP, JambaMoE, RMSNorm, embedding
from lpf.builtin.models.mamba1 import JambaMambaMixer


class JambaLayer(nn.Module):
    def __init__(self, config, is_mamba: bool, ordinal: int, num_experts: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.is_mamba = is_mamba
        self.input_layernorm = RMSNorm(H, eps)
        self.pre_ff_layernorm = RMSNorm(H, eps)
        if is_mamba:
            self.mamba = JambaMambaMixer(
                H,
                config.mamba_expand * H,
                config.mamba_d_state,
                config.mamba_d_conv,
                config.mamba_dt_rank,
                config.mamba_conv_bias,
                config.mamba_proj_bias,
                config.hidden_act,
                eps,
                mamba_layer=ordinal,
            )
        else:
            n_heads = config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or H // n_heads
            self.self_attn = PagedAttention(
                H, n_heads, config.num_key_value_heads, head_dim, head_dim**-0.5, False, attn_layer=ordinal
            )
        if num_experts > 1:
            self.feed_forward = JambaMoE(
                H, config.intermediate_size, num_experts, config.num_experts_per_tok, config.hidden_act
            )
        else:
            self.feed_forward = GatedMLP(H, config.intermediate_size, config.hidden_act)

    def forward(self, h, rope):
        residual = h
        h = self.input_layernorm(h)
        h = residual + (self.mamba(h) if self.is_mamba else self.self_attn(h, None))
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class JambaModel(EngineModel):
    final_norm_name = "final_layernorm"

    def __init__(self, config):
        super().__init__(config)
        H = config.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = embedding(config.vocab_size, H)
        layers, counts = [], [0, 0]  # attention, mamba ordinals
        for i in range(config.num_hidden_layers):
            is_mamba = i % config.attn_layer_period != config.attn_layer_offset
            experts = config.num_experts if i % config.expert_layer_period == config.expert_layer_offset else 1
            layers.append(JambaLayer(config, is_mamba, counts[is_mamba], experts))
            counts[is_mamba] += 1
        self.model.layers = nn.ModuleList(layers)
        self.model.final_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)

    def mamba_mixers(self):
        return [layer.mamba for layer in self.model.layers if layer.is_mamba]

    def attention_layers(self):
        return [layer.self_attn for layer in self.model.layers if not layer.is_mamba]

    def rename_checkpoint_keys(self, sd: dict) -> dict:
        # transformers >= 5 fuses experts in memory (experts.gate_up_proj [E, 2I, H], experts.down_proj);
        # files it saves are per-expert, which is our layout. Split a fused one if we meet it.
        out = {}
        for k, v in sd.items():
            if k.endswith("feed_forward.experts.gate_up_proj"):
                stem = k[: -len("gate_up_proj")]
                for e in range(v.shape[0]):
                    gate, up = v[e].chunk(2, dim=0)
                    out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = gate, up
            elif k.endswith("feed_forward.experts.down_proj"):
                stem = k[: -len("down_proj")]
                for e in range(v.shape[0]):
                    out[f"{stem}{e}.down_proj.weight"] = v[e]
            else:
                out[k] = v
        return out
