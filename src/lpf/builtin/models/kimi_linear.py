"""Kimi Linear (`KimiLinearForCausalLM`) with Kimi Delta Attention layers and dense MLPs.

Contract: an `EngineModel` (see `base`) equal in float32, up to rounding, to transformers'
`modeling_kimi_linear` for a config whose every layer is `linear_attention` (KDA, `kimi_delta`, its
state in the state-slot cache) with a `dense` MLP: per layer a pre-norm KDA mixer and a pre-norm
gated MLP, each added back, plain RMS norms. Kimi Linear's full-attention layers (multi-head latent
attention) and its MoE layers are not in the built-in engine: a config with either raises `LpfError`
(the real checkpoints have both; this serves tiny:kimi-linear, the KDA layer under audit).
"""

from __future__ import annotations

from torch import nn

from lpf.builtin.models.base import EngineModel
from lpf.builtin.models.kimi_delta import KimiDeltaMixer
from lpf.builtin.models.layers import GatedMLP, RMSNorm, embedding
from lpf.core.errors import LpfError


class KimiLayer(nn.Module):
    def __init__(self, config, ordinal: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = KimiDeltaMixer(
            H,
            config.linear_num_heads,
            config.linear_head_dim,
            config.linear_conv_kernel_dim,
            config.hidden_act,
            eps,
            mamba_layer=ordinal,
        )
        self.mlp = GatedMLP(H, config.intermediate_size, config.hidden_act)

    def forward(self, h, rope):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class KimiLinearModel(EngineModel):
    final_norm_name = "norm"

    def __init__(self, config):
        super().__init__(config)
        n = config.num_hidden_layers
        kinds = set(config.layer_types[:n])
        if kinds != {"linear_attention"}:
            raise LpfError(
                "the built-in engine runs Kimi Linear's KDA layers only; its full-attention (MLA) layers are not "
                f"implemented (layer types: {sorted(kinds)})"
            )
        if set(config.mlp_layer_types[:n]) != {"dense"}:
            raise LpfError(
                "the built-in engine runs Kimi Linear with dense MLPs only; its MoE layers are not implemented"
            )
        H = config.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = embedding(config.vocab_size, H)
        self.model.layers = nn.ModuleList(KimiLayer(config, i) for i in range(n))
        self.model.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)

    def mamba_mixers(self):
        return [layer.self_attn for layer in self.model.layers]

    def attention_layers(self):
        return []

    def rename_checkpoint_keys(self, sd: dict) -> dict:
        """transformers saves Kimi Linear in the original layout: q/k/v convs apart (concatenated here, q
        then k then v, as HF's conversion does), the forget gate's weights on the layer, the dense MLP under
        `block_sparse_moe`; o_proj is the base's out_proj. HF's own module names are accepted too."""
        import torch

        out = {}
        for key, value in sd.items():
            head, sep, tail = key.partition(".self_attn.")
            if sep and tail in ("A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight"):
                key = f"{head}.self_attn.forget_gate.{tail}"
            elif sep and tail == "o_proj.weight":
                key = f"{head}.self_attn.out_proj.weight"
            elif sep and tail in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
                continue
            out[key.replace(".block_sparse_moe.", ".mlp.")] = value
        for i in range(len(self.model.layers)):
            parts = [sd.get(f"model.layers.{i}.self_attn.{x}_conv1d.weight") for x in "qkv"]
            if all(p is not None for p in parts):
                out[f"model.layers.{i}.self_attn.conv1d.weight"] = torch.cat(parts)
        return out
