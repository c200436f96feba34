"""Stateless building blocks shared by the engine's models: norms and feed-forward blocks.

Contract: every module takes a packed batch `[T, hidden]` (no batch dimension: tokens of all requests
of a step are one flat batch) and returns `[T, hidden]`; none of them touches a cache. Parameter names
mirror the Hugging Face checkpoints (`weight`, `gate_proj`, `input_linear`, ...) so that
`load_state_dict` maps a checkpoint onto them one to one; the arithmetic (float32 upcasts, where eps
sits, which half of a fused projection is the gate) matches the HF modules it replaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def wide(t: torch.Tensor) -> torch.Tensor:
    """HF's float32 upcast, except that float64 stays float64 (so a float64 model is exact throughout)."""
    return t if t.dtype == torch.float64 else t.float()


ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}") from None


def embedding(vocab: int, hidden: int) -> nn.Embedding:
    """A token embedding whose weight comes from the checkpoint: no random init. (Models are built on the
    meta device, where `nn.Embedding`'s `normal_` init runs torch's decomposition and imports
    torch._dynamo: ~1.5 s of every `lpf run` that loads no transformers model.)"""
    return nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = wide(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2's output norm: gate first (norm_before_gate=False), then RMS over each of n_groups."""

    def __init__(self, size: int, n_groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = size // n_groups
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = wide(x) * F.silu(wide(gate))
        g = x.view(*x.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(x.shape).to(dtype)


class FusedGatedMLP(nn.Module):
    """GraniteMoeHybrid's shared MLP: one input projection whose first half is the gate."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class GatedMLP(nn.Module):
    """Jamba's (Llama-style) MLP with separate gate/up/down projections."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _dispatch_experts(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, expert_fn) -> torch.Tensor:
    """Run each hit expert on the tokens routed to it and sum the weighted outputs (no capacity limit)."""
    out = torch.zeros_like(x)
    flat_i = top_i.reshape(-1)
    for e in torch.unique(flat_i).tolist():
        token, k = torch.where(top_i == e)
        y = expert_fn(e, x[token]) * top_w[token, k, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class _Stacked(nn.Module):
    """A holder for one stacked expert weight, so its checkpoint key is `<name>.weight`."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class GraniteMoE(nn.Module):
    """GraniteMoeHybrid's sparse MoE: softmax over the top-k router logits (so the k weights sum to 1).
    Expert weights are stacked as in the checkpoint: input_linear.weight [E, 2I, H], output_linear.weight
    [E, H, I]."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str):
        super().__init__()
        self.router = nn.Module()
        self.router.layer = nn.Linear(hidden, num_experts, bias=False)
        self.input_linear = _Stacked(num_experts, 2 * intermediate, hidden)
        self.output_linear = _Stacked(num_experts, hidden, intermediate)
        self.top_k = top_k
        self.act = activation(act)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.input_linear.weight[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.output_linear.weight[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = wide(self.router.layer(x))
        top_logits, top_i = logits.topk(self.top_k, dim=-1)
        top_w = torch.softmax(top_logits, dim=-1).to(x.dtype)
        return _dispatch_experts(x, top_w, top_i, self._expert)


class JambaMoE(nn.Module):
    """Jamba's sparse MoE: top-k of the softmax over ALL experts, weights left unnormalised."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, act) for _ in range(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(wide(self.router(x)), dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        return _dispatch_experts(x, top_w.to(x.dtype), top_i, lambda e, h: self.experts[e](h))
