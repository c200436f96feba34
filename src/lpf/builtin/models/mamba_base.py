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
- Prefix caching (`SeqMeta.initial_slot`, `checkpoints`, `conv_write_slot`): a request resuming
  from a checkpoint reads its initial state from the checkpoint's slot (vLLM's initial_state_idx)
  and writes its final state to its own slot; every such foreign state is read before the layer
  writes anything, as one batched kernel would. A checkpoint `(position, slot)` saves the state
  after `position` tokens to `slot`: at the chunk's end, or (all mode) inside it, where the chunk
  is scanned in pieces split at those positions. `conv_write_slot` redirects the chunk's final
  conv state (own slot and chunk-end checkpoint); a resumed decode reads zero state when its
  `has_initial_state` is False (the null block). `conv_reads_slot`: a prefill's initial conv
  state is its slot's content (no has_initial_state for the conv), its SSM state zero.

Under a capture (`lpf locate`, `forward_context.probe`) the state each request starts a step from
(`state_in`, `conv_state_in`: what it read, or the zeros of a prefill) and the state it ends the
step with, or each piece of a chunk split at checkpoints ends with (`state_out`, `conv_state_out`),
are probed, one row per request, with `ctx.rows` naming the request (the piece of its chunk, or the
decode batch) while it runs; nothing else changes.

The conv state is the last `d_conv - 1` conv inputs (the front zero-filled when fewer tokens came).
Subclasses implement `prefill(proj [L, P], conv0, ssm0) -> (y [L, d_inner], conv, ssm)` and
`decode(proj [B, P], conv [B, ...], ssm [B, ...]) -> (y, conv, ssm)`, where `proj` is the in_proj
output of the tokens concerned; the base applies `out_proj` to the whole packed batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from lpf.builtin.forward_context import get_forward_context, probe
from lpf.builtin.models.layers import wide


def _decode_index(ctx, cache, device):
    """(the decodes' slots, their rows in the packed batch, the slots as an index tensor): the same
    for every Mamba layer of the step, built by the first."""
    if "mamba_decode_index" not in ctx.memo:
        slots = [s.state_slot for s in ctx.decodes]
        rows = torch.tensor([s.start for s in ctx.decodes], dtype=torch.long, device=device)
        ctx.memo["mamba_decode_index"] = (slots, rows, cache.slot_index(slots))
    return ctx.memo["mamba_decode_index"]


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
        foreign = self._read_foreign(ctx, cache, layer, proj.dtype, ssm_dtype)
        for s in ctx.non_decodes:
            if s.phase not in ("prefill", "extend"):
                raise ValueError(f"unknown phase {s.phase!r} for request {s.request_id}")
            if s.request_id in foreign:
                conv0, ssm0 = foreign[s.request_id]
            elif s.reads_initial_state:
                conv0 = cache.read(layer, "conv", [s.state_slot], "prefill")[0].to(proj.dtype)
                ssm0 = cache.read(layer, "ssm", [s.state_slot], "prefill")[0].to(ssm_dtype)
            else:
                conv0 = (
                    cache.read(layer, "conv", [s.state_slot], "prefill")[0].to(proj.dtype)
                    if s.conv_reads_slot
                    else proj.new_zeros(shapes["conv"])
                )
                ssm0 = torch.zeros(shapes["ssm"], dtype=ssm_dtype, device=x.device)
            if ctx.capture is not None:
                ctx.rows = [s]
                self._probe_states("in", conv0[None], ssm0[None])
            y[s.start : s.end] = self._chunk(cache, layer, s, proj[s.start : s.end], conv0, ssm0)
            ctx.rows = None
        decodes = ctx.decodes
        if decodes:
            for s in decodes:
                if s.num_tokens != 1:
                    raise ValueError(f"decode of request {s.request_id} has {s.num_tokens} tokens (must be 1)")
            slots, idx, slot_idx = _decode_index(ctx, cache, x.device)
            conv0 = cache.read(layer, "conv", slots, "decode", slot_idx).to(proj.dtype)
            ssm0 = cache.read(layer, "ssm", slots, "decode", slot_idx).to(ssm_dtype)
            for i, s in enumerate(decodes):
                if s.request_id in foreign:
                    conv0[i], ssm0[i] = foreign[s.request_id]
            captured = ctx.capture is not None
            if captured:
                ctx.rows = decodes
                self._probe_states("in", conv0, ssm0)
            y[idx], conv, ssm = self.decode(proj[idx], conv0, ssm0)
            if captured:
                self._probe_states("out", conv, ssm)
                ctx.rows = None
            cache.write(layer, "conv", slots, conv, "decode", slot_idx)
            cache.write(layer, "ssm", slots, ssm, "decode", slot_idx)
            for i, s in enumerate(decodes):
                for _, slot in s.checkpoints:  # a decode saves only at its end (one token)
                    cache.write(layer, "conv", [slot], conv[i : i + 1], "decode")
                    cache.write(layer, "ssm", [slot], ssm[i : i + 1], "decode")
        return self.out_proj(y)

    def _probe_states(self, when: str, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        probe(self, f"conv_state_{when}", conv)
        probe(self, f"state_{when}", ssm)

    def _read_foreign(self, ctx, cache, layer: int, dtype, ssm_dtype) -> dict:
        """{request id: (conv0, ssm0)} of every request resuming from another slot this step (zeros for
        a resume from the null block), all read before this layer writes anything."""
        out = {}
        for s in ctx.seqs:
            if s.initial_slot is not None and s.reads_initial_state:
                out[s.request_id] = (
                    cache.read(layer, "conv", [s.initial_slot], "prefill")[0].to(dtype),
                    cache.read(layer, "ssm", [s.initial_slot], "prefill")[0].to(ssm_dtype),
                )
            elif s.phase == "decode" and s.has_initial_state is False:
                shapes = dict(self.state_spec())
                out[s.request_id] = (
                    torch.zeros(shapes["conv"], dtype=dtype, device=cache.buffer.device),
                    torch.zeros(shapes["ssm"], dtype=ssm_dtype, device=cache.buffer.device),
                )
        return out

    def _chunk(self, cache, layer: int, s, proj: torch.Tensor, conv, ssm) -> torch.Tensor:
        """One prefill/extend chunk: scanned in pieces split at its inner checkpoints (each saved as it
        is reached), its final state written to its own slot (the conv to `conv_write_slot` when set)
        and to a checkpoint at its end."""
        end = s.num_computed + s.num_tokens
        cuts = [p - s.num_computed for p, _ in s.checkpoints if p < end]
        ys, at = [], 0
        for cut, (_, slot) in zip(cuts, [c for c in s.checkpoints if c[0] < end]):
            self._piece(s, at, cut - at)
            piece, conv, ssm = self.prefill(proj[at:cut], conv, ssm)
            self._piece_done(conv, ssm)
            ys.append(piece)
            cache.write(layer, "conv", [slot], conv, "prefill")
            cache.write(layer, "ssm", [slot], ssm, "prefill")
            at = cut
        self._piece(s, at, proj.shape[0] - at)
        piece, conv, ssm = self.prefill(proj[at:], conv, ssm)
        self._piece_done(conv, ssm)
        ys.append(piece)
        at_end = [slot for p, slot in s.checkpoints if p == end]
        conv_to = [s.conv_write_slot] if s.conv_write_slot is not None else [s.state_slot, *at_end]
        cache.write(layer, "conv", conv_to, conv.expand(len(conv_to), *conv.shape), "prefill")
        cache.write(layer, "ssm", [s.state_slot, *at_end], ssm.expand(1 + len(at_end), *ssm.shape), "prefill")
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    def _piece(self, s, at: int, n: int) -> None:
        """Under a capture: the piece of `s`'s chunk scanned next (positions num_computed + at ..)."""
        ctx = get_forward_context()
        if ctx.capture is not None:
            ctx.rows = [replace(s, start=s.start + at, num_computed=s.num_computed + at, num_tokens=n)]

    def _piece_done(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        if get_forward_context().capture is not None:
            self._probe_states("out", conv[None], ssm[None])

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
        return act, full[:, full.shape[1] - (self.d_conv - 1) :]

    def conv_step(self, xc: torch.Tensor, conv0: torch.Tensor):
        """One token per request: xc [B, C], conv0 [B, C, K-1]."""
        full = torch.cat([conv0, xc[:, :, None]], dim=-1)
        out = (full * self.conv1d.weight[:, 0][None]).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias
        act = self.act(out)
        probe(self, "conv", act)
        return act, full[:, :, 1:]
