"""The arithmetic of the substitution drills: what a quantized or fine-tuned model, or a quantized KV
cache, does to the numbers. `faults.Drills` decides when each applies; this module only computes.

Contract (torch tensors in, new tensors out, inputs untouched):
  rtn_groupwise(w, bits, group)   group-wise asymmetric round-to-nearest along the last dimension
                                  (min/max per group of `group` inputs, clipped to the layer's
                                  input width; 2**bits levels, zero point):
                                  the weight format of GPTQ/AWQ-style 4- and 8-bit checkpoints
                                  without their error correction, so it is the plainest such model
  perturb(w, scale, generator)    w * (1 + scale * N(0, 1)) elementwise: another fine-tune's stand-in
  round_kv(x, bits)               symmetric absmax rounding per (token, head) row of K or V, as an
                                  int8/int4 KV cache stores them (the scale kept in full precision)
  linear_weights(model)           the weights those edits apply to: every linear layer's weight in
                                  the decoder (attention, MLP, MoE experts, Mamba projections), not
                                  the embeddings, the LM head or an MoE router, as quantization
                                  recipes leave those in full precision
Everything is computed in float32 and cast back to the weight's own dtype.
"""

from __future__ import annotations

import torch


def rtn_groupwise(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    x = w.float()
    n_in = x.shape[-1]
    g = min(group, n_in)
    pad = (-n_in) % g
    if pad:  # the last group is shorter: pad with its own last value (changes neither min nor max)
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    grouped = x.reshape(*x.shape[:-1], -1, g)
    lo = grouped.amin(dim=-1, keepdim=True)
    hi = grouped.amax(dim=-1, keepdim=True)
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float32).tiny)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(grouped / scale) + zero, 0, levels)
    out = ((q - zero) * scale).reshape(*x.shape[:-1], -1)[..., :n_in]
    return out.to(w.dtype)


def perturb(w: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(w.shape, generator=generator, dtype=torch.float32)
    return (w.float() * (1.0 + scale * noise)).to(w.dtype)


def round_kv(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; each (token, head) row gets its own scale."""
    f = x.float()
    qmax = 2 ** (bits - 1) - 1
    scale = (f.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.clamp(torch.round(f / scale), -qmax, qmax) * scale).to(x.dtype)


def linear_weights(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, weight) of every decoder linear layer (2-D; stacked experts 3-D), in module order."""
    out = []
    for name, m in model.named_modules():
        is_linear = isinstance(m, torch.nn.Linear) or type(m).__name__ == "_Stacked"  # stacked MoE experts
        if not is_linear or name.startswith("lm_head") or "router" in name or "embed" in name:
            continue
        out.append((f"{name}.weight", m.weight))
    return out
