"""Kimi Delta Attention (Kimi Linear's `linear_attention` layers) as a state-slot mixer.

Contract: `KimiDeltaMixer` is a `MambaMixerBase`, like `GatedDeltaNetMixer`: the same prefill / extend /
decode / verify state protocol, prefix-cache checkpoints, speculative snapshots and drills, through the
same `StateCache` parts: "conv" the short conv's last `d_conv - 1` q/k/v inputs [3 H d, d_conv - 1],
"ssm" the delta-rule memory [H, d, d] (one matrix per head), in float32 (float64 for a float64 model).

What differs from Gated DeltaNet (transformers' `modeling_kimi_linear` torch path, step for step): the
forget gate is per key channel, not one scalar per head: g = -exp(A_log[h]) softplus(f_b(f_a(x)) +
dt_bias) [n, H, d] (a low-rank projection; softplus as HF writes it, x past 20 kept as is); q, k and v
are separate projections (convolved together), as many key as value heads, L2-normed as x / sqrt(|x|^2
+ eps); beta = sigmoid(b_proj(x)); the output norm is an RMS norm per head times sigmoid of a low-rank
gate g_b(g_a(x)), in float32. The recurrence is S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t (v_t -
k_t^T diag(exp(g_t)) S_{t-1}))^T, o_t = q_t^T S_t / sqrt(d), so the chunked form's pairwise decay is a
per-channel factor inside the q.k products (`chunk_kda`, a port of HF's `chunk_kimi_delta_attention`
with a batch dimension) rather than GDN's scalar one; decode and verify use the one-token recurrent
form (`recurrent_step`). A right-padded request in a batched prefill has zero q/k/v, g and beta on its
padding (exp(0) = 1, nothing written), so its final state is the one at its own end. The drills reach
it through the shared paths; `padding-updates-state` is GDN's and Mamba2's only (a KDA batch masks its
padding here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lpf.builtin.forward_context import probe
from lpf.builtin.models.layers import activation, wide
from lpf.builtin.models.mamba_base import MambaMixerBase

L2_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's (and HF's Kimi) l2norm: divide by sqrt, not multiply by rsqrt."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def chunk_kda(q, k, v, g, beta, chunk: int, init):
    """b requests at once: q, k, v, g [b, L, H, d], beta [b, L, H], init [b, H, d, d], all in the state
    dtype -> (out [b, L, H, d], final state [b, H, d, d])."""
    q, k, v, beta, g = (t.transpose(1, 2).contiguous() for t in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    b, H, L, d = k.shape
    pad = (chunk - L % chunk) % chunk
    q = F.pad(q, (0, 0, 0, pad)) * d**-0.5
    k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (k, v, g))
    beta = F.pad(beta, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, v, g, k_beta, v_beta = (t.reshape(b, H, -1, chunk, t.shape[-1]) for t in (q, k, v, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)
    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(0)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict[..., None], float("-inf")).exp()
    attn = -(k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(mask, 0)
    for i in range(1, chunk):  # the UT transform's forward substitution, row by row as HF does it
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    attn = attn + torch.eye(chunk, dtype=attn.dtype, device=attn.device)
    v = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp())
    state = init.to(v)
    out = torch.zeros_like(v)
    for i in range(q.shape[2]):
        q_i, k_i, v_i, g_i = q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i]
        inter = (q_i * g_i.exp()) @ state
        intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay[:, :, i]).sum(dim=-1).masked_fill(strict, 0)
        v_new = v_i - k_cumdecay[:, :, i] @ state
        out[:, :, i] = inter + intra @ v_new
        state = (
            state * g_i[:, :, -1].exp().unsqueeze(-1) + (k_i * (g_i[:, :, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
        )
    out = out.reshape(b, H, -1, out.shape[-1])[:, :, :L]
    return out.transpose(1, 2), state


def recurrent_step(q, k, v, g, beta, state):
    """One token per request: q, k, v, g [b, H, d], beta [b, H], state [b, H, d, d] -> (out [b, H, d],
    new state). HF's `recurrent_kimi_delta_attention` for one step."""
    q, k = l2norm(q), l2norm(k)
    q = q * (1 / (q.shape[-1] ** 0.5))
    state = state * g.exp()[..., None]
    kv_mem = (state * k[..., None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


class ForgetGate(nn.Module):
    """The per-channel forget gate's parameters under the checkpoint's names (`forget_gate.*`)."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int):
        super().__init__()
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, n_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(n_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, n_heads, 1))


class GatedHeadNorm(nn.Module):
    """Kimi's output norm: RMS over each head in float32, times weight, times sigmoid(gate)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = wide(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = wide(self.weight) * h
        return (h * torch.sigmoid(wide(gate))).to(dtype)


class KimiDeltaMixer(MambaMixerBase):
    def __init__(self, hidden: int, n_heads: int, head_dim: int, d_conv: int, act: str, eps: float, mamba_layer: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.qkv_dim = n_heads * head_dim
        self.conv_dim = 3 * self.qkv_dim
        self.d_inner, self.d_conv, self.chunk_size = self.qkv_dim, d_conv, 64
        self.mamba_layer = mamba_layer
        self.q_proj = nn.Linear(hidden, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.qkv_dim, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, bias=False)
        self.forget_gate = ForgetGate(hidden, n_heads, head_dim)
        self.b_proj = nn.Linear(hidden, n_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, self.qkv_dim, bias=False)
        self.o_norm = GatedHeadNorm(head_dim, eps)
        self.out_proj = nn.Linear(self.qkv_dim, hidden, bias=False)  # the checkpoint's o_proj (renamed at load)
        self.act = activation(act)

    def in_proj(self, x: torch.Tensor) -> torch.Tensor:
        fg = self.forget_gate
        return torch.cat(
            [
                self.q_proj(x),
                self.k_proj(x),
                self.v_proj(x),
                fg.f_b_proj(fg.f_a_proj(x)),
                self.b_proj(x),
                self.g_b_proj(self.g_a_proj(x)),
            ],
            dim=-1,
        )

    def state_spec(self):
        return [("conv", (self.conv_dim, self.d_conv - 1)), ("ssm", (self.n_heads, self.head_dim, self.head_dim))]

    def _split(self, proj):
        return proj.split([self.conv_dim, self.qkv_dim, self.n_heads, self.qkv_dim], dim=-1)  # qkv, f, b, gate

    def _rule_inputs(self, qkv, f, b):
        """(q, k, v, g [n, H, d], beta [n, H]) in the state dtype."""
        n, shape = qkv.shape[0], (qkv.shape[0], self.n_heads, self.head_dim)
        q, k, v = (t.reshape(shape) for t in wide(qkv).split(self.qkv_dim, dim=-1))
        g = (wide(f) + wide(self.forget_gate.dt_bias)).view(n, self.n_heads, self.head_dim)
        softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        g = -wide(self.forget_gate.A_log).view(1, self.n_heads, 1).exp() * softplus
        return q, k, v, g, wide(b.sigmoid())

    def _output(self, core: torch.Tensor, gate: torch.Tensor, dtype) -> torch.Tensor:
        probe(self, "ssm_out", core)
        n = core.shape[0]
        y = self.o_norm(core.to(dtype).reshape(-1, self.head_dim), gate.reshape(-1, self.head_dim))
        return y.reshape(n, self.qkv_dim)

    def prefill(self, proj, conv0, ssm0):
        qkv, f, b, gate = self._split(proj)
        qkv, conv = self.conv_prefill(qkv, conv0)
        out, ssm = chunk_kda(*(t[None] for t in self._rule_inputs(qkv, f, b)), self.chunk_size, ssm0[None])
        return self._output(out[0], gate, proj.dtype), conv, ssm[0]

    def prefill_batch(self, proj, lay, conv0, ssm0):
        qkv, f, b, gate = self._split(proj)
        qkv, conv = self.conv_prefill_batch(qkv, lay, conv0)
        q, k, v, g, beta = (lay.padded(t) for t in self._rule_inputs(qkv, f, b))
        out, ssm = chunk_kda(q, k, v, g, beta, self.chunk_size, ssm0)
        return self._output(lay.packed(out), gate, proj.dtype), conv, ssm

    def decode(self, proj, conv0, ssm0):
        qkv, f, b, gate = self._split(proj)
        qkv, conv = self.conv_step(qkv, conv0)
        out, ssm = recurrent_step(*self._rule_inputs(qkv, f, b), ssm0)
        return self._output(out, gate, proj.dtype), conv, ssm
