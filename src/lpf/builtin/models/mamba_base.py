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
Prefill/extend requests run first, then the decode batch, as vLLM orders them: a prefill's
(possibly misplaced) final-state write is visible to a decode of the same step. Prefill/extend chunks
read and write as if run one at a time in batch order: they run as one padded batch (`prefill_batch`,
vLLM's varlen kernel; all reads, then the writes in batch order) only when that is the same thing, i.e.
no chunk reads a slot an earlier one writes, no prefill offset wraps and no chunk saves checkpoints
or redirects its conv write; otherwise one at a time (`_chunk`).
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
are probed, one row per request, with `ctx.rows` naming the request (the piece of its chunk, the
chunks run together, or the decode batch) while it runs; nothing else changes.

The conv state is the last `d_conv - 1` conv inputs (the front zero-filled when fewer tokens came).
Subclasses implement `prefill(proj [L, P], conv0, ssm0) -> (y [L, d_inner], conv, ssm)` and
`decode(proj [B, P], conv [B, ...], ssm [B, ...]) -> (y, conv, ssm)`, where `proj` is the in_proj
output of the tokens concerned, and `prefill_batch(proj [T, P], lay: Varlen, conv0 [B, ...], ssm0
[B, ...]) -> (y [T, d_inner], conv [B, ...], ssm [B, ...])`, several chunks' rows packed back to back,
computed as one padded batch; the base applies `out_proj` to the whole packed batch. Under the
padding-updates-state drill (`ForwardContext.unmasked_padding`) a mixer with a gated decay runs its
padding through the state update in `prefill_batch` as tokens of a zero projection: their conv
outputs (`conv_padded`) and gates (a zero projection's) decay and write the state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from lpf.builtin.forward_context import get_forward_context, probe
from lpf.builtin.models.layers import wide


@dataclass(frozen=True)
class Varlen:
    """Where a step's prefill/extend chunks sit: `rows` [T] their rows of the packed batch, in batch
    order; `lens` their lengths; `longest`; and each packed row's index in a right-padded layout,
    request-major (`by_request`: i * longest + t) and time-major (`by_time`: t * n + i)."""

    rows: torch.Tensor
    lens: list[int]
    lens_t: torch.Tensor
    longest: int
    by_request: torch.Tensor
    by_time: torch.Tensor

    def padded(self, t: torch.Tensor, fill: float = 0.0, time_major: bool = False) -> torch.Tensor:
        """Packed rows t [T, ...] right-padded with `fill`: [n, longest, ...] ([longest, n, ...] time-major)."""
        n = len(self.lens)
        index = self.by_time if time_major else self.by_request
        out = t.new_full((n * self.longest, *t.shape[1:]), fill).index_copy_(0, index, t)
        return out.view(*((self.longest, n) if time_major else (n, self.longest)), *t.shape[1:])

    def packed(self, t: torch.Tensor, time_major: bool = False) -> torch.Tensor:
        """The rows of a padded t [n, longest, ...] ([longest, n, ...] time-major) that hold tokens: [T, ...]."""
        return t.reshape(-1, *t.shape[2:]).index_select(0, self.by_time if time_major else self.by_request)


def _varlen(ctx, chunks, device) -> Varlen:
    """The step's `Varlen` (built by the first Mamba layer, reused by the others)."""
    if "mamba_varlen" not in ctx.memo:
        lens = [s.num_tokens for s in chunks]
        n, longest = len(lens), max(lens)
        rows = torch.cat([torch.arange(s.start, s.end) for s in chunks])
        req = torch.cat([torch.full((k,), i) for i, k in enumerate(lens)])
        t = torch.cat([torch.arange(k) for k in lens])
        ctx.memo["mamba_varlen"] = Varlen(
            rows.to(device),
            lens,
            torch.tensor(lens, device=device),
            longest,
            (req * longest + t).to(device),
            (t * n + req).to(device),
        )
    return ctx.memo["mamba_varlen"]


def _together(ctx, cache, chunks) -> bool:
    """Whether the step's prefill/extend chunks may run as one batch with the same result as one at a
    time: no checkpoints or redirected conv writes (prefix caching's pieces), no prefill offset that
    wraps (a wrapped write lands in another slot's bytes), and no chunk that reads its slot after an
    earlier chunk of the step wrote it. (A capture changes nothing here: `lpf locate`'s replay must
    compute what the run computed, so it takes the same path.)"""
    written = set()
    for s in chunks:
        if s.checkpoints or s.conv_write_slot is not None or cache.wraps(s.state_slot):
            return False
        if (s.reads_initial_state or s.conv_reads_slot) and s.initial_slot is None and s.state_slot in written:
            return False
        written.add(s.state_slot)
    return True


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
        chunks = ctx.chunks
        for s in ctx.non_decodes:
            if s.phase not in ("prefill", "extend", "verify"):
                raise ValueError(f"unknown phase {s.phase!r} for request {s.request_id}")
        if len(chunks) > 1 and _together(ctx, cache, chunks):
            self._prefill_together(ctx, cache, layer, chunks, proj, y, foreign, shapes, ssm_dtype)
            chunks = []
        for s in chunks:
            conv0, ssm0 = self._initial_state(cache, layer, s, foreign, proj.dtype, ssm_dtype, shapes)
            if ctx.capture is not None:
                ctx.rows = [s]
                self._probe_states("in", conv0[None], ssm0[None])
            y[s.start : s.end] = self._chunk(cache, layer, s, proj[s.start : s.end], conv0, ssm0)
            ctx.rows = None
        if ctx.verifies:
            self._verify(ctx, cache, layer, ctx.verifies, proj, y, ssm_dtype)
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

    def _verify(self, ctx, cache, layer: int, verifies, proj, y, ssm_dtype) -> None:
        """The verify path (speculative decoding, as vLLM runs it for Mamba): each request's 1 + K tokens
        stepped one position at a time by the decode kernel from the state in `state_slot` (exact
        offsets; from zeros for a row whose `has_initial_state` is False), every position's conv and SSM
        state kept as a snapshot (`ctx.memo["spec_states"]`, layer -> (request ids, conv [T, B, ...], ssm
        [T, B, ...]): position t of row b; past a row's own length its last state) and the last position's
        state written back; the runner rolls the slot back to the snapshot of the last accepted position."""
        slots = [s.state_slot for s in verifies]
        conv = cache.read(layer, "conv", slots, "decode").to(proj.dtype)
        ssm = cache.read(layer, "ssm", slots, "decode").to(ssm_dtype)
        zero = [i for i, s in enumerate(verifies) if s.has_initial_state is False]
        if zero:  # the spec-verify-zero-state drill: those rows replay from a zero-filled buffer
            conv, ssm = conv.clone(), ssm.clone()
            conv[zero], ssm[zero] = 0, 0
        convs, ssms = [], []
        for t in range(max(s.num_tokens for s in verifies)):
            live = [i for i, s in enumerate(verifies) if s.num_tokens > t]
            rows = torch.tensor([verifies[i].start + t for i in live], dtype=torch.long, device=proj.device)
            if len(live) == len(verifies):
                y[rows], conv, ssm = self.decode(proj[rows], conv, ssm)
            else:
                li = torch.tensor(live, dtype=torch.long, device=proj.device)
                y[rows], c, h = self.decode(proj[rows], conv[li], ssm[li])
                conv, ssm = conv.index_copy(0, li, c), ssm.index_copy(0, li, h)
            convs.append(conv)
            ssms.append(ssm)
        ctx.memo.setdefault("spec_states", {})[layer] = (
            [s.request_id for s in verifies],
            torch.stack(convs),
            torch.stack(ssms),
        )
        if len(set(slots)) == len(slots):
            index = cache.slot_index(slots)
            cache.write(layer, "conv", slots, conv, "decode", index)
            cache.write(layer, "ssm", slots, ssm, "decode", index)
            return
        for i, slot in enumerate(slots):  # in batch order: a slot two rows share keeps the later one's
            cache.write(layer, "conv", [slot], conv[i : i + 1], "decode")
            cache.write(layer, "ssm", [slot], ssm[i : i + 1], "decode")

    def _initial_state(self, cache, layer: int, s, foreign: dict, dtype, ssm_dtype, shapes: dict):
        """(conv0, ssm0) a prefill/extend chunk starts from: a foreign state, its slot's, or zeros."""
        if s.request_id in foreign:
            return foreign[s.request_id]
        if s.reads_initial_state:
            conv0 = cache.read(layer, "conv", [s.state_slot], "prefill")[0].to(dtype)
            ssm0 = cache.read(layer, "ssm", [s.state_slot], "prefill")[0].to(ssm_dtype)
            if s.state_transposed:  # the chunk-state-transposed drill: the memory read in the other layout
                ssm0 = ssm0.transpose(-1, -2).reshape(ssm0.shape)
            return conv0, ssm0
        conv0 = (
            cache.read(layer, "conv", [s.state_slot], "prefill")[0].to(dtype)
            if s.conv_reads_slot
            else torch.zeros(shapes["conv"], dtype=dtype, device=cache.buffer.device)
        )
        return conv0, torch.zeros(shapes["ssm"], dtype=ssm_dtype, device=cache.buffer.device)

    def _prefill_together(self, ctx, cache, layer: int, chunks, proj, y, foreign, shapes, ssm_dtype) -> None:
        """Every prefill/extend chunk of the step in one `prefill_batch` (`_together` said it is the
        same as one at a time): all initial states read, then the final states written in batch order."""
        lay = _varlen(ctx, chunks, proj.device)
        if ctx.unmasked_padding:  # the padding-updates-state drill's ground truth (the runner records it)
            ctx.memo["padded_chunks"] = [s.request_id for s in chunks if s.num_tokens < lay.longest]
        starts = [self._initial_state(cache, layer, s, foreign, proj.dtype, ssm_dtype, shapes) for s in chunks]
        conv0 = torch.stack([c for c, _ in starts])
        ssm0 = torch.stack([h for _, h in starts])
        captured = ctx.capture is not None
        if captured:  # probes of the whole batch: rows run over the chunks' tokens (states: one per chunk)
            ctx.rows = list(chunks)
            self._probe_states("in", conv0, ssm0)
        out, conv, ssm = self.prefill_batch(proj.index_select(0, lay.rows), lay, conv0, ssm0)
        if captured:
            self._probe_states("out", conv, ssm)
            ctx.rows = None
        y.index_copy_(0, lay.rows, out)
        slots = [s.state_slot for s in chunks]
        if len(set(slots)) == len(slots):  # one write each; a slot written twice keeps the later chunk's
            index = cache.slot_index(slots)
            cache.write(layer, "conv", slots, conv, "prefill", index)
            cache.write(layer, "ssm", slots, ssm, "prefill", index)
            return
        for i, slot in enumerate(slots):
            cache.write(layer, "conv", [slot], conv[i : i + 1], "prefill")
            cache.write(layer, "ssm", [slot], ssm[i : i + 1], "prefill")

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

    def conv_prefill_batch(self, xc: torch.Tensor, lay: Varlen, conv0: torch.Tensor):
        """`conv_prefill` of several chunks at once: xc [T, C] (packed), conv0 [B, C, K-1] ->
        (activated output [T, C], new conv states [B, C, K-1]). Right-padded to the longest chunk: a
        causal conv's outputs never read past their own input, so the padding touches no kept output."""
        n, width, k1 = len(lay.lens), xc.shape[1], self.d_conv - 1
        full = torch.cat([conv0, lay.padded(xc).transpose(1, 2)], dim=2)
        out = F.conv1d(full, self.conv1d.weight, self.conv1d.bias, padding=1, groups=width)
        act = self.act(out[:, :, 1:-1])  # sliced, as conv_prefill (and HF) activate it
        packed = lay.packed(act.transpose(1, 2))
        probe(self, "conv", packed)
        # each chunk's last K-1 inputs: columns len .. len + K-2 of its row of `full`
        tail = (lay.lens_t[:, None] + torch.arange(k1, device=xc.device)[None])[:, None, :]
        return packed, full.gather(2, tail.expand(n, width, k1))

    def conv_padded(self, xc: torch.Tensor, lay: Varlen, conv0: torch.Tensor) -> torch.Tensor:
        """`conv_prefill_batch`'s activated output at every position of the right-padded layout, the
        padding's included (its first d_conv - 1 positions still see the chunk's last inputs): [n, longest,
        C]. Only the padding-updates-state drill reads the padding's rows."""
        full = torch.cat([conv0, lay.padded(xc).transpose(1, 2)], dim=2)
        out = F.conv1d(full, self.conv1d.weight, self.conv1d.bias, padding=1, groups=xc.shape[1])
        return self.act(out[:, :, 1:-1]).transpose(1, 2)

    def conv_step(self, xc: torch.Tensor, conv0: torch.Tensor):
        """One token per request: xc [B, C], conv0 [B, C, K-1]."""
        full = torch.cat([conv0, xc[:, :, None]], dim=-1)
        out = (full * self.conv1d.weight[:, 0][None]).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias
        act = self.act(out)
        probe(self, "conv", act)
        return act, full[:, :, 1:]
