"""The Mamba1 mixer as Jamba uses it (RMSNorms on dt, B and C) over the state-slot cache.

Contract: `JambaMambaMixer(x [T, hidden]) -> [T, hidden]` inside a forward context, with the
prefill/extend/decode state semantics of `mamba_base`. State parts: `conv` [d_inner, d_conv - 1]
and `ssm` [d_inner, d_state], float32 (float64 for a float64 model). The selective scan of a
prefill/extend chunk is `scan`, a two-level blocked recurrence (about 2*sqrt(L) vectorised steps
instead of L); decodes take one step. dt gets no clamp (Jamba has no time_step_limit).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lpf.engine.models.layers import RMSNorm, activation, wide
from lpf.engine.models.mamba_base import MambaMixerBase


def scan(dA: torch.Tensor, u: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """All states of h_t = dA_t * h_{t-1} + u_t: dA, u [L, ...], h0 [...] -> [L, ...].

    Blocks of length b: scan inside all blocks at once (b steps), carry block-end states across
    blocks (L/b steps), then add each block's carried-in state times the running product of dA.
    Only products of decays in (0, 1] appear (no division by a cumulative decay), so nothing
    overflows; the result differs from the plain loop by float reassociation only."""
    L = dA.shape[0]
    b = max(1, math.isqrt(L - 1) + 1) if L > 1 else 1
    nb = -(-L // b)
    pad = nb * b - L
    if pad:
        dA = torch.cat([dA, dA.new_ones(pad, *dA.shape[1:])])
        u = torch.cat([u, u.new_zeros(pad, *u.shape[1:])])
    dA, u = dA.view(nb, b, *dA.shape[1:]), u.view(nb, b, *u.shape[1:])
    local = torch.empty_like(u)
    local[:, 0] = u[:, 0]
    for i in range(1, b):
        torch.addcmul(u[:, i], dA[:, i], local[:, i - 1], out=local[:, i])
    run = torch.cumprod(dA, dim=1)
    carried = torch.empty_like(u[:, 0])
    h = h0
    for k in range(nb):
        carried[k] = h
        h = torch.addcmul(local[k, -1], run[k, -1], h)
    states = torch.addcmul(local, run, carried[:, None])
    return states.reshape(nb * b, *states.shape[2:])[:L]


class JambaMambaMixer(MambaMixerBase):
    def __init__(self, hidden: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int, conv_bias: bool,
                 proj_bias: bool, act: str, eps: float, mamba_layer: int):
        super().__init__()
        self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_inner, d_state, d_conv, dt_rank
        self.mamba_layer = mamba_layer
        self.in_proj = nn.Linear(hidden, 2 * d_inner, bias=proj_bias)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, bias=conv_bias, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d_inner, d_state))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, hidden, bias=proj_bias)
        self.dt_layernorm = RMSNorm(dt_rank, eps)
        self.b_layernorm = RMSNorm(d_state, eps)
        self.c_layernorm = RMSNorm(d_state, eps)
        self.act = activation(act)

    def state_spec(self):
        return [("conv", (self.d_inner, self.d_conv - 1)), ("ssm", (self.d_inner, self.d_state))]

    def _ssm_inputs(self, x):
        """dt [n, D] (softplus'd), B and C [n, N], from the conv output x [n, D]."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        # the bias is added after the projection (in float32), as HF's scan does with delta_bias
        dt = F.softplus(wide(F.linear(dt, self.dt_proj.weight)) + wide(self.dt_proj.bias))
        return dt, wide(B), wide(C)

    def _discretise(self, x, dt, B):
        A = -torch.exp(wide(self.A_log))
        dA = torch.exp(A[None] * dt[..., None])
        u = (dt * wide(x))[..., None] * B[:, None, :]
        return dA, u

    def _output(self, states, x, C, z, dtype):
        y = torch.einsum("ldn,ln->ld", states, C) + wide(x) * wide(self.D)
        return (y * F.silu(wide(z))).to(dtype)

    def prefill(self, proj, conv0, ssm0):
        x, z = proj.chunk(2, dim=-1)
        x, conv = self.conv_prefill(x, conv0)
        dt, B, C = self._ssm_inputs(x)
        dA, u = self._discretise(x, dt, B)
        states = scan(dA, u, ssm0)
        return self._output(states, x, C, z, proj.dtype), conv, states[-1]

    def decode(self, proj, conv0, ssm0):
        x, z = proj.chunk(2, dim=-1)
        x, conv = self.conv_step(x, conv0)
        dt, B, C = self._ssm_inputs(x)
        dA, u = self._discretise(x, dt, B)
        ssm = torch.addcmul(u, dA, ssm0)
        return self._output(ssm, x, C, z, proj.dtype), conv, ssm
