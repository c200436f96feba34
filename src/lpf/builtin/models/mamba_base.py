"""What every Mamba mixer does with the state-slot cache; subclasses supply only the SSM arithmetic.

Contract (the fault drills depend on it exactly; see DESIGN.md "Built-in engine"):
- `prefill`: no prior state. The initial conv and SSM state are ZERO whatever the slot holds; the
  final state is written to the slot with `path="prefill"`.
- `extend` (a later chunk of a chunked prefill): the initial state is READ from the slot with
  `path="prefill"`; the final state is written back with `path="prefill"`. Whether a chunk reads
  its initial state is `SeqMeta.reads_initial_state` (vLLM's has_initial_state), which the runner
  sets (the lost-chunk-state drill says no for an extend).
- `decode` (exactly one token): all decode requests of the step are read in one `read` with
  `path="decode"`, stepped together, written back in one `write`. Whatever the slot holds is used,
  also for a brand-new request that the runner (mis)classified as decode: never special-cased.
Prefill/extend requests run first, one at a time, then the decode batch, as vLLM orders them: a
prefill's (possibly misplaced) final-state write is visible to a decode of the same step.

Under a capture (`lpf locate`, `forward_context.probe`) the state each request starts a step from
(`state_in`, `conv_state_in`: what it read, or the zeros of a prefill) and the state it ends the
step with (`state_out`, `conv_state_out`: what it writes) are probed, one row per request, with
`ctx.rows` naming the request (or the decode batch) while its chunk runs; nothing else changes.

The conv state is the last `d_conv - 1` conv inputs (the front zero-filled when fewer tokens came).
Subclasses implement `prefill(proj [L, P], conv0, ssm0) -> (y [L, d_inner], conv, ssm)` and
`decode(proj [B, P], conv [B, ...], ssm [B, ...]) -> (y, conv, ssm)`, where `proj` is the in_proj
output of the tokens concerned; the base applies `out_proj` to the whole packed batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lpf.builtin.forward_context import get_forward_context, probe
from lpf.builtin.models.layers import wide


class MambaMixerBase(nn.Module):
    # set by subclasses: in_proj, conv1d (depthwise, weight [C, 1, K]), out_proj, act, mamba_layer,
    # d_inner, d_conv, and state_spec() -> [("conv", shape), ("ssm", shape)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        cache, layer = ctx.state_cache, self.mamba_layer
        proj = self.in_proj(x)
        y = x.new_zeros(x.shape[0], self.d_inner)
        shapes = dict(self.state_spec())
        ssm_dtype = wide(proj[:0]).dtype
        for s in ctx.non_decodes:
            if s.phase not in ("prefill", "extend"):
                raise ValueError(f"unknown phase {s.phase!r} for request {s.request_id}")
            if s.reads_initial_state:
                conv0 = cache.read(layer, "conv", [s.state_slot], "prefill")[0].to(proj.dtype)
                ssm0 = cache.read(layer, "ssm", [s.state_slot], "prefill")[0].to(ssm_dtype)
            else:
                conv0 = proj.new_zeros(shapes["conv"])
                ssm0 = torch.zeros(shapes["ssm"], dtype=ssm_dtype, device=x.device)
            captured = ctx.capture is not None
            if captured:
                ctx.rows = [s]
                self._probe_states("in", conv0[None], ssm0[None])
            y[s.start:s.end], conv, ssm = self.prefill(proj[s.start:s.end], conv0, ssm0)
            if captured:
                self._probe_states("out", conv[None], ssm[None])
                ctx.rows = None
            cache.write(layer, "conv", [s.state_slot], conv, "prefill")
            cache.write(layer, "ssm", [s.state_slot], ssm, "prefill")
        decodes = ctx.decodes
        if decodes:
            for s in decodes:
                if s.num_tokens != 1:
                    raise ValueError(f"decode of request {s.request_id} has {s.num_tokens} tokens (must be 1)")
            slots = [s.state_slot for s in decodes]
            idx = torch.tensor([s.start for s in decodes], dtype=torch.long, device=x.device)
            conv0 = cache.read(layer, "conv", slots, "decode").to(proj.dtype)
            ssm0 = cache.read(layer, "ssm", slots, "decode").to(ssm_dtype)
            captured = ctx.capture is not None
            if captured:
                ctx.rows = decodes
                self._probe_states("in", conv0, ssm0)
            y[idx], conv, ssm = self.decode(proj[idx], conv0, ssm0)
            if captured:
                self._probe_states("out", conv, ssm)
                ctx.rows = None
            cache.write(layer, "conv", slots, conv, "decode")
            cache.write(layer, "ssm", slots, ssm, "decode")
        return self.out_proj(y)

    def _probe_states(self, when: str, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        probe(self, f"conv_state_{when}", conv)
        probe(self, f"state_{when}", ssm)

    def conv_prefill(self, xc: torch.Tensor, conv0: torch.Tensor):
        """Causal depthwise conv of one request's chunk xc [L, C] continuing from conv0 [C, K-1]:
        (activated output [L, C], new conv state [C, K-1])."""
        full = torch.cat([conv0, xc.t()], dim=1)
        # padding=1, then dropping the two edge columns: the output rows stay non-contiguous, so the
        # activation runs row by row as it does on HF's sliced conv output (vectorised and scalar
        # silu round differently; this keeps a one-step prefill bit-identical to HF)
        out = F.conv1d(full[None], self.conv1d.weight, self.conv1d.bias, padding=1, groups=full.shape[0])
        act = self.act(out[0, :, 1:-1]).t()
        probe(self, "conv", act)
        return act, full[:, full.shape[1] - (self.d_conv - 1):]

    def conv_step(self, xc: torch.Tensor, conv0: torch.Tensor):
        """One token per request: xc [B, C], conv0 [B, C, K-1]."""
        full = torch.cat([conv0, xc[:, :, None]], dim=-1)
        out = (full * self.conv1d.weight[:, 0][None]).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias
        act = self.act(out)
        probe(self, "conv", act)
        return act, full[:, :, 1:]
