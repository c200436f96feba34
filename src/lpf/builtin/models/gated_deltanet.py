"""Gated DeltaNet (Qwen3.5 / Qwen3-Next `linear_attention` layers) as a state-slot mixer.

Contract: `GatedDeltaNetMixer` is a `MambaMixerBase`: the same prefill / extend / decode / verify state
protocol, prefix-cache checkpoints and speculative snapshots as the Mamba layers, through the same
`StateCache` parts. Its "conv" part is the short causal conv's last `d_conv - 1` inputs [conv_dim,
d_conv - 1] (conv_dim = 2 * key_dim + value_dim: q, k and v are convolved together), its "ssm" part
the delta-rule memory, one matrix per value head: [num_v_heads, d_k, d_v], kept in float32 (float64
for a float64 model) like the SSM state of Mamba2.

The arithmetic is transformers' `modeling_qwen3_5` torch path: in_proj_qkv -> causal depthwise conv +
SiLU -> q, k [n, n_k, d_k], v [n, n_v, d_v]; beta = sigmoid(in_proj_b), g = -exp(A_log) *
softplus(in_proj_a + dt_bias); q and k repeated to the value heads, L2-normed (eps 1e-6), q scaled
by d_k^-1/2; the gated delta rule S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,
o_t = q_t^T S_t; then a per-head RMS norm (norm before gate) times SiLU(in_proj_z), out_proj.
Prefill and extend chunks use the chunked (UT-transform) form, `chunk_gated_delta_rule`, a port of
HF's `torch_chunk_gated_delta_rule` with a batch dimension; decode and verify the one-token recurrent
form, `recurrent_step` (HF's `torch_recurrent_gated_delta_rule` for one token). A right-padded
request in a batched prefill has zero q/k/v, g and beta on its padding: a padded step decays by
exp(0) = 1 and writes nothing, so its final state is the one at its own end.

The four input projections stay separate modules (the checkpoint's names); `in_proj` concatenates
their outputs, which is the fused projection `MambaMixerBase` splits per request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lpf.builtin.forward_context import get_forward_context, probe
from lpf.builtin.models.layers import activation, wide
from lpf.builtin.models.mamba_base import MambaMixerBase

L2_EPS = 1e-6  # HF's l2norm (and FLA's) eps


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _heads_and_norm(q, k, n_v: int):
    """q, k [b, L, n_k, d_k] -> [b, n_v, L, d_k]: repeated to the value heads, L2-normed, in the state dtype."""
    if q.shape[-2] != n_v:
        q = q.repeat_interleave(n_v // q.shape[-2], dim=-2)
        k = k.repeat_interleave(n_v // k.shape[-2], dim=-2)
    return l2norm(q.transpose(1, 2).contiguous()), l2norm(k.transpose(1, 2).contiguous())


def chunk_gated_delta_rule(q, k, v, g, beta, chunk: int, init):
    """b requests at once: q, k [b, L, n_k, d_k], v [b, L, n_v, d_v], g, beta [b, L, n_v], init [b, n_v,
    d_k, d_v], all in the state dtype -> (out [b, L, n_v, d_v], final state [b, n_v, d_k, d_v]).
    HF's `torch_chunk_gated_delta_rule`, step for step (so a one-step prefill rounds as HF's forward)."""
    L = q.shape[1]
    q, k = _heads_and_norm(q, k, v.shape[2])
    v, beta, g = (t.transpose(1, 2).contiguous() for t in (v, beta, g))
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - L % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(t.shape[0], t.shape[1], -1, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp()[..., None]
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    state = init.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :L]
    return out.transpose(1, 2), state


def recurrent_step(q, k, v, g, beta, state):
    """One token per request: q, k [b, n_k, d_k], v [b, n_v, d_v], g, beta [b, n_v], state [b, n_v, d_k,
    d_v] -> (out [b, n_v, d_v], new state). HF's `torch_recurrent_gated_delta_rule` for one step."""
    q, k = _heads_and_norm(q[:, None], k[:, None], v.shape[1])
    q, k = q[:, :, 0], k[:, :, 0]
    q = q / (q.shape[-1] ** 0.5)
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


class HeadGatedRMSNorm(nn.Module):
    """Qwen3.5's GDN output norm: RMS over each value head, times weight, THEN times SiLU(gate)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = wide(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(wide(gate))).to(dtype)


class GatedDeltaNetMixer(MambaMixerBase):
    def __init__(
        self,
        hidden: int,
        n_k: int,
        n_v: int,
        d_k: int,
        d_v: int,
        d_conv: int,
        act: str,
        eps: float,
        mamba_layer: int,
        chunk_size: int = 64,
    ):
        super().__init__()
        if n_v % n_k:
            raise ValueError(f"value heads ({n_v}) must be a multiple of key heads ({n_k})")
        self.n_k, self.n_v, self.d_k, self.d_v = n_k, n_v, d_k, d_v
        self.key_dim, self.value_dim = n_k * d_k, n_v * d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.d_inner, self.d_conv, self.chunk_size = self.value_dim, d_conv, chunk_size
        self.mamba_layer = mamba_layer
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(n_v))
        self.A_log = nn.Parameter(torch.zeros(n_v))
        self.norm = HeadGatedRMSNorm(d_v, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, n_v, bias=False)
        self.in_proj_a = nn.Linear(hidden, n_v, bias=False)
        self.act = activation(act)

    def in_proj(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)], dim=-1)

    def state_spec(self):
        return [("conv", (self.conv_dim, self.d_conv - 1)), ("ssm", (self.n_v, self.d_k, self.d_v))]

    def _split(self, proj):
        return proj.split([self.conv_dim, self.value_dim, self.n_v, self.n_v], dim=-1)  # qkv, z, b, a

    def _rule_inputs(self, qkv, b, a, observed: bool = True):
        """(q [n, n_k, d_k], k, v [n, n_v, d_v], g [n, n_v], beta [n, n_v]) in the state dtype; the gates
        go to a capture (`lpf locate`) when the rows are the step's own (`observed`), not padded ones."""
        n = qkv.shape[0]
        q, k, v = wide(qkv).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = wide(b.sigmoid())
        g = -wide(self.A_log).exp() * F.softplus(wide(a) + wide(self.dt_bias))
        if observed:
            probe(self, "g", g)
            probe(self, "beta", beta)
        return q.view(n, self.n_k, self.d_k), k.view(n, self.n_k, self.d_k), v.view(n, self.n_v, self.d_v), g, beta

    def _output(self, core: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
        probe(self, "ssm_out", core)
        n = core.shape[0]
        y = self.norm(core.to(dtype).reshape(-1, self.d_v), z.reshape(-1, self.d_v)).reshape(n, self.value_dim)
        probe(self, "gate_norm", y)  # the output gate; a hook on `norm` would see [n * n_v, d_v] rows
        return y

    def prefill(self, proj, conv0, ssm0):
        qkv, z, b, a = self._split(proj)
        qkv, conv = self.conv_prefill(qkv, conv0)
        q, k, v, g, beta = self._rule_inputs(qkv, b, a)
        out, ssm = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], self.chunk_size, ssm0[None])
        return self._output(out[0], z, proj.dtype), conv, ssm[0]

    def prefill_batch(self, proj, lay, conv0, ssm0):
        """The chunks right-padded with zeros (q/k/v, g and beta) to the longest, in one chunked scan
        (under padding-updates-state the padding's own q/k/v, g and beta instead)."""
        qkv_in, z, b, a = self._split(proj)
        qkv, conv = self.conv_prefill_batch(qkv_in, lay, conv0)
        if get_forward_context().unmasked_padding:  # padding-updates-state: the padding runs as zero-projected tokens
            n, longest = len(lay.lens), lay.longest
            padded = self.conv_padded(qkv_in, lay, conv0).reshape(n * longest, -1)
            if get_forward_context().capture is not None:  # the gates of the real tokens, for `lpf locate`
                self._rule_inputs(qkv, b, a)
            inputs = self._rule_inputs(
                padded, lay.padded(b).reshape(n * longest, -1), lay.padded(a).reshape(n * longest, -1), observed=False
            )
            q, k, v, g, beta = (t.reshape(n, longest, *t.shape[1:]) for t in inputs)
        else:
            q, k, v, g, beta = (lay.padded(t) for t in self._rule_inputs(qkv, b, a))
        out, ssm = chunk_gated_delta_rule(q, k, v, g, beta, self.chunk_size, ssm0)
        return self._output(lay.packed(out), z, proj.dtype), conv, ssm

    def decode(self, proj, conv0, ssm0):
        qkv, z, b, a = self._split(proj)
        qkv, conv = self.conv_step(qkv, conv0)
        out, ssm = recurrent_step(*self._rule_inputs(qkv, b, a), ssm0)
        return self._output(out, z, proj.dtype), conv, ssm
