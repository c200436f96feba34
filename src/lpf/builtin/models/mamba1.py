"""The Mamba1 mixer as Jamba uses it (RMSNorms on dt, B and C) over the state-slot cache.

Contract: `JambaMambaMixer(x [T, hidden]) -> [T, hidden]` inside a forward context, with the
prefill/extend/decode state semantics of `mamba_base`. State parts: `conv` [d_inner, d_conv - 1]
and `ssm` [d_inner, d_state], float32 (float64 for a float64 model). A prefill/extend chunk is
discretised for all its tokens at once, then `scan` runs the recurrence token by token (see there
why); decodes take one step. dt gets no clamp (Jamba has no time_step_limit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lpf.builtin.forward_context import probe
from lpf.builtin.models.layers import RMSNorm, activation, wide
from lpf.builtin.models.mamba_base import MambaMixerBase


def scan(dA: torch.Tensor, u: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """All states of h_t = dA_t * h_{t-1} + u_t: dA, u [L, ...], h0 [...] -> [L, ...].

    A plain loop of one fused op per token. A blocked (chunk + carry) scan was tried and dropped:
    at Jamba's state sizes every extra pass over the [L, d_inner, d_state] tensors costs more than
    the per-token op overhead saved (400 tokens x 256 x 16: loop 2.9 ms, blocked 3-8 ms)."""
    out = torch.empty_like(u)
    h, steps = h0, zip(u.unbind(0), dA.unbind(0), out.unbind(0))  # unbind: one op for all the views
    for u_t, dA_t, out_t in steps:
        h = torch.addcmul(u_t, dA_t, h, out=out_t)
    return out


class JambaMambaMixer(MambaMixerBase):
    def __init__(
        self,
        hidden: int,
        d_inner: int,
        d_state: int,
        d_conv: int,
        dt_rank: int,
        conv_bias: bool,
        proj_bias: bool,
        act: str,
        eps: float,
        mamba_layer: int,
    ):
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
        probe(self, "dt", dt)
        return dt, wide(B), wide(C)

    def _discretise(self, x, dt, B):
        A = -torch.exp(wide(self.A_log))
        dA = torch.exp(A[None] * dt[..., None])
        u = (dt * wide(x))[..., None] * B[:, None, :]
        return dA, u

    def _output(self, states, x, C, z, dtype):
        y = torch.einsum("ldn,ln->ld", states, C) + wide(x) * wide(self.D)
        y = y * F.silu(wide(z))
        probe(self, "ssm_out", y)  # Mamba1's scan output is gated by z, as HF's selective scan returns it
        return y.to(dtype)

    def prefill(self, proj, conv0, ssm0):
        x, z = proj.chunk(2, dim=-1)
        x, conv = self.conv_prefill(x, conv0)
        dt, B, C = self._ssm_inputs(x)
        dA, u = self._discretise(x, dt, B)
        states = scan(dA, u, ssm0)
        return self._output(states, x, C, z, proj.dtype), conv, states[-1]

    def prefill_batch(self, proj, lay, conv0, ssm0):
        """Every chunk's tokens through the row-wise steps together; the scan over the chunks padded
        at their ends with steps that keep the state exactly (dA = 1, u = 0: h = 0 + 1 * h), so the
        last padded state is each chunk's final state, bit for bit the scan one chunk at a time."""
        x, z = proj.chunk(2, dim=-1)
        x, conv = self.conv_prefill_batch(x, lay, conv0)
        dt, B, C = self._ssm_inputs(x)
        dA, u = self._discretise(x, dt, B)
        states = scan(lay.padded(dA, 1.0, time_major=True), lay.padded(u, time_major=True), ssm0)
        packed = lay.packed(states, time_major=True)
        return self._output(packed, x, C, z, proj.dtype), conv, states[-1]

    def decode(self, proj, conv0, ssm0):
        x, z = proj.chunk(2, dim=-1)
        x, conv = self.conv_step(x, conv0)
        dt, B, C = self._ssm_inputs(x)
        dA, u = self._discretise(x, dt, B)
        ssm = torch.addcmul(u, dA, ssm0)
        return self._output(ssm, x, C, z, proj.dtype), conv, ssm
