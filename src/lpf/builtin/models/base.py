"""`EngineModel`: what the model runner sees of any engine model, and checkpoint loading.

Contract (the runner relies on nothing else):
- `forward(input_ids [T], positions [T]) -> [T, hidden]`: final-normed hidden states of a packed
  batch (tokens of several requests, laid out as `ForwardContext.seqs` says). Must run inside
  `set_forward_context`; attention layers use the paged KV cache, Mamba layers the state-slot cache.
  `positions` feed RoPE only; where K/V and state go comes from each SeqMeta (`num_computed`, slot,
  block table).
- `compute_logits(hidden [N, hidden]) -> [N, vocab]` float32 (float64 for a float64 model), with every
  post-op of the HF head.
- `state_specs()`: per Mamba layer (ordinal order) its named state parts, for `StateCache`.
- `kv_spec()`: (number of attention layers, n_kv_heads, head_dim), for `KVCache`.
- attributes `config` (the HF config), `vocab_size`, `eos_token_id`.
Subclasses build `self.model.embed_tokens`, `self.model.layers` (each `layer(h, rope) -> h`), the
final norm, `self.lm_head`, and name their checkpoint's keys like HF does, so loading is one strict
`load_state_dict`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lpf.builtin.models.layers import wide
from lpf.core.errors import LpfError


class EngineModel(nn.Module):
    final_norm_name = "norm"

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.eos_token_id = config.eos_token_id
        self.embedding_multiplier = 1.0
        self.logits_scaling = 1.0
        self.rotary = None  # attention.Rotary when the architecture uses RoPE

    # --- built by subclasses -------------------------------------------------------------------
    def mamba_mixers(self) -> list[nn.Module]:
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:
        raise NotImplementedError

    # --- the runner's interface ------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        rope = self.rotary(positions, h.dtype) if self.rotary is not None else None
        for layer in self.model.layers:
            h = layer(h, rope)
        return getattr(self.model, self.final_norm_name)(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return wide(logits)

    def state_specs(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        return [m.state_spec() for m in self.mamba_mixers()]

    def kv_spec(self) -> tuple[int, int, int]:
        attn = self.attention_layers()
        if not attn:
            return 0, 1, 1
        return len(attn), attn[0].n_kv, attn[0].head_dim

    # --- loading ---------------------------------------------------------------------------------
    def rename_checkpoint_keys(self, sd: dict) -> dict:
        """Map other serialisations of the same weights onto this module's names (default: none)."""
        return sd

    def load_checkpoint(self, path: Path, dtype, device) -> "EngineModel":
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise LpfError(f"model {path}: no *.safetensors weights (the built-in engine reads only safetensors)")
        sd = {}
        for f in files:
            sd.update(load_file(str(f)))
        sd = self.rename_checkpoint_keys(sd)
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        if tied:
            sd.pop("lm_head.weight", None)  # HF ties it to the embedding even when the file has one
        sd = {k: v.to(dtype) for k, v in sd.items()}
        missing, unexpected = self.load_state_dict(sd, strict=False, assign=True)
        missing = [k for k in missing if not (tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise LpfError(
                f"model {path}: checkpoint does not match the built-in {type(self).__name__} "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.to(device=device, dtype=dtype)
        self.requires_grad_(False)
        return self.eval()
