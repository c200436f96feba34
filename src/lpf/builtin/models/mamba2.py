"""The Mamba2 mixer (as in GraniteMoeHybrid / Bamba) over the state-slot cache.

Contract: `Mamba2Mixer(x [T, hidden]) -> [T, hidden]` inside a forward context, with the
prefill/extend/decode state semantics of `mamba_base`. State parts: `conv` [conv_dim, d_conv - 1]
(conv_dim = d_inner + 2 * n_groups * d_state) and `ssm` [n_heads, head_dim, d_state], float32
(float64 for a float64 model).
Prefill/extend chunks use the SSD chunked scan (`ssd_scan`, HF's torch path with an initial state);
decodes take one recurrent step. dt is `softplus(dt + dt_bias)` clamped to `time_step_limit` on
both paths (HF's own decode step skips the clamp; with the default (0, inf) that is the same).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from lpf.builtin.forward_context import get_forward_context, probe
from lpf.builtin.models.layers import GatedRMSNorm, activation, wide
from lpf.builtin.models.mamba_base import MambaMixerBase


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [..., n, n] with out[i, j] = sum(x[j+1 .. i]) for j <= i, -inf above the diagonal
    (cumsum of a masked copy, as HF does, to avoid subtracting large cumulative sums)."""
    n = x.size(-1)
    x = x[..., None].expand(*x.shape, n)
    above_or_on, above = _triangles(n, x.device)
    out = torch.cumsum(x.masked_fill(above_or_on, 0), dim=-2)
    return out.masked_fill(above, -torch.inf)


@functools.lru_cache(maxsize=16)
def _triangles(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(j >= i, j > i) of an [n, n] grid: the masks `_segsum` applies, built once per size."""
    with torch.inference_mode(False):  # plain tensors: usable inside and outside inference mode
        ones = torch.ones(n, n, dtype=torch.bool, device=device)
        return ~torch.tril(ones, diagonal=-1), ~torch.tril(ones, diagonal=0)


def ssd_scan(x, dt, A, B, C, D, chunk: int, init):
    """One request: x [L, H, P], dt [L, H] (already softplus'd), A [H], B/C [L, H, N] (groups
    expanded to heads), D [H], init [H, P, N]. Returns (y [L, H, P], final state [H, P, N]).

    A line-by-line port of HF's torch path (same shapes, batch dim of 1, same einsums), so a one-step
    prefill rounds exactly like HF's teacher-forced forward."""
    y, final = ssd_scan_batch(x[None], dt[None], A, B[None], C[None], D, chunk, init[None])
    return y[0], final[0]


def ssd_scan_batch(x, dt, A, B, C, D, chunk: int, init):
    """`ssd_scan` of b requests at once: x [b, L, H, P], dt [b, L, H], B/C [b, L, H, N], init
    [b, H, P, N] -> (y [b, L, H, P], final [b, H, P, N]). A request shorter than L is right-padded
    with zeros (dt = 0 included): padded steps decay by exp(0) = 1 and add nothing, so its final
    state is the one at its own end."""
    L = x.shape[1]
    pad = (-L) % chunk
    y_skip = D[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None]
    A = A.to(x.dtype) * dt  # zero-padded steps decay by exp(0) = 1, so padding leaves the final state alone

    def chunks(t):
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])

    x, A, B, C = chunks(x), chunks(A), chunks(B), chunks(C)  # [b, c, l, ...]
    A = A.permute(0, 3, 1, 2)  # [b, h, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)
    # within-chunk ("diagonal block") outputs: a masked attention-like form
    decay = torch.exp(_segsum(A))
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    # each chunk's own contribution to the state at its end
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    # carry states across chunks, starting from the initial state
    states = torch.cat([init[:, None].to(states.dtype), states], dim=1)
    decay_chunk = torch.exp(_segsum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    starts, final = states[:, :-1], states[:, -1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, starts) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(y_diag.shape[0], -1, *y_diag.shape[-2:]) + y_skip
    return y[:, :L], final


class Mamba2Mixer(MambaMixerBase):
    def __init__(
        self,
        hidden: int,
        n_heads: int,
        head_dim: int,
        n_groups: int,
        d_state: int,
        d_conv: int,
        d_inner: int,
        chunk_size: int,
        conv_bias: bool,
        proj_bias: bool,
        act: str,
        eps: float,
        dt_limit,
        mamba_layer: int,
    ):
        super().__init__()
        self.n_heads, self.head_dim, self.n_groups, self.d_state = n_heads, head_dim, n_groups, d_state
        self.d_inner, self.d_conv, self.chunk_size = d_inner, d_conv, chunk_size
        self.conv_dim = d_inner + 2 * n_groups * d_state
        self.dt_limit = tuple(dt_limit) if dt_limit is not None else (0.0, float("inf"))
        self.mamba_layer = mamba_layer
        self.in_proj = nn.Linear(hidden, d_inner + self.conv_dim + n_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, bias=conv_bias, padding=d_conv - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(n_heads))
        self.A_log = nn.Parameter(torch.zeros(n_heads))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm = GatedRMSNorm(d_inner, n_groups, eps)
        self.out_proj = nn.Linear(d_inner, hidden, bias=proj_bias)
        self.act = activation(act)

    def state_spec(self):
        return [("conv", (self.conv_dim, self.d_conv - 1)), ("ssm", (self.n_heads, self.head_dim, self.d_state))]

    def _split(self, proj):
        return proj.split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)  # gate, xBC, dt

    def _ssm_inputs(self, xbc, dt):
        n = xbc.shape[0]
        gn = self.n_groups * self.d_state
        x, B, C = wide(xbc).split([self.d_inner, gn, gn], dim=-1)
        rep = self.n_heads // self.n_groups
        B = B.reshape(n, self.n_groups, self.d_state).repeat_interleave(rep, dim=1)
        C = C.reshape(n, self.n_groups, self.d_state).repeat_interleave(rep, dim=1)
        dt = F.softplus(wide(dt) + wide(self.dt_bias)).clamp(*self.dt_limit)
        probe(self, "dt", dt)
        return x.reshape(n, self.n_heads, self.head_dim), B, C, dt

    def prefill(self, proj, conv0, ssm0):
        gate, xbc, dt = self._split(proj)
        xbc, conv = self.conv_prefill(xbc, conv0)
        x, B, C, dt = self._ssm_inputs(xbc, dt)
        A = -torch.exp(wide(self.A_log))
        y, ssm = ssd_scan(x, dt, A, B, C, wide(self.D), self.chunk_size, ssm0)
        probe(self, "ssm_out", y)
        return self.norm(y.reshape(proj.shape[0], -1), gate).to(proj.dtype), conv, ssm

    def prefill_batch(self, proj, lay, conv0, ssm0):
        """The chunks right-padded with zeros to the longest (see `ssd_scan_batch`), in one scan."""
        gate, xbc_in, dt_in = self._split(proj)
        xbc, conv = self.conv_prefill_batch(xbc_in, lay, conv0)
        A = -torch.exp(wide(self.A_log))
        if get_forward_context().unmasked_padding:  # padding-updates-state: the padding runs as zero-projected tokens
            n, longest = len(lay.lens), lay.longest
            padded = self.conv_padded(xbc_in, lay, conv0).reshape(n * longest, -1)
            inputs = self._ssm_inputs(padded, lay.padded(dt_in).reshape(n * longest, -1))
            x, B, C, dt = (t.reshape(n, longest, *t.shape[1:]) for t in inputs)
        else:
            x, B, C, dt = self._ssm_inputs(xbc, dt_in)
            x, dt, B, C = (lay.padded(t) for t in (x, dt, B, C))
        y, ssm = ssd_scan_batch(x, dt, A, B, C, wide(self.D), self.chunk_size, ssm0)
        y = lay.packed(y)
        probe(self, "ssm_out", y)
        return self.norm(y.reshape(y.shape[0], -1), gate).to(proj.dtype), conv, ssm

    def decode(self, proj, conv0, ssm0):
        gate, xbc, dt = self._split(proj)
        xbc, conv = self.conv_step(xbc, conv0)
        x, B, C, dt = self._ssm_inputs(xbc, dt)  # x [b, h, p], B/C [b, h, n], dt [b, h]
        A = -torch.exp(wide(self.A_log))
        dA = torch.exp(dt * A)[..., None, None]
        ssm = ssm0 * dA + (dt[..., None] * x)[..., None] * B[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", ssm, C) + wide(self.D)[:, None] * x
        probe(self, "ssm_out", y)
        return self.norm(y.reshape(proj.shape[0], -1), gate).to(proj.dtype), conv, ssm
