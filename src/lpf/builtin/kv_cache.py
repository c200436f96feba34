"""Paged KV cache for attention layers: a block allocator (pure Python) and the block tensors.

A request's block table lists the physical blocks holding its tokens in order; token at position p
lives in block `table[p // block_size]`, row `p % block_size`. Attention writes a step's K/V before it
reads, so a stale block never leaks into a request (unlike Mamba state, which is read first).
"""

from __future__ import annotations

from collections import deque
from math import prod


class BlockAllocator:
    """Free-queue allocator of KV block ids. Never imports torch (the scheduler uses it)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("need at least one KV block")
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        # freed in reverse so a request's tail blocks are reused last (they are likeliest to be re-needed)
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCache:
    """K and V for every attention layer: [num_blocks * block_size, n_kv_heads, head_dim] each.
    `layer` is the attention layer's ordinal (0 for the first attention layer). Every write goes
    through `store`, which applies `rounding` (None: stored as computed; the kv-quant drill passes
    its rounding) so prefill and decode paths store alike.

    A quantized cache (`quant`, a `kv_quant.KVQuant`: the engine's kv_cache_dtype fp8_e4m3 / fp8_e5m2)
    keeps codes in the float8 type and a float32 scale per (row, head, group) beside them (`ks`, `vs`;
    1.0 where nothing was written: the scale buffer's default); `store` quantizes, every read
    (`read`, `decode_kv`) dequantizes. The drills that get a quantized cache wrong reach it through two
    hooks, both None on an honest engine: `read_fault(seqs, positions, decode)` -> {"unscaled": mask,
    "requantized": mask} (per read row [n, width]: read with the default scale 1.0 / the codes quantized
    a second time) and `decode_scale` (a factor a decode's written scales are multiplied by)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype=None,
        device="cpu",
        rounding=None,
        quant=None,
    ):
        import torch

        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks * block_size, n_kv_heads, head_dim)
        self.quant = quant
        self.dtype = dtype or torch.float32  # what a read hands attention
        store = quant.code_dtype if quant is not None else self.dtype
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.ks = self.vs = None
        if quant is not None:
            sshape = (shape[0], n_kv_heads, quant.n_groups)
            self.ks = [torch.ones(sshape, dtype=torch.float32, device=device) for _ in range(num_layers)]
            self.vs = [torch.ones(sshape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.rounding = rounding
        self.read_fault = None
        self.decode_scale = None
        self._torch = torch
        self._scratch: dict = {}

    def scratch(self, i: int, shape: tuple[int, ...], like):
        """Work buffer `i` of `shape` (like `like`'s dtype and device), its storage kept across steps and
        layers and grown by half again when too small: never copied on growth (resize_ would copy the
        stale contents) and never a fresh multi-MB allocation per step (page faults)."""
        # keyed by inference mode too: an inference tensor cannot be written outside inference_mode
        key = (i, like.dtype, like.device, self._torch.is_inference_mode_enabled())
        numel = prod(shape)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = like.new_empty(max(numel, 0 if buf is None else buf.numel() * 3 // 2))
            self._scratch[key] = buf
        return buf[:numel].view(shape)

    def store(self, layer: int, rows, k, v, decode: bool = False) -> None:
        """K/V [n, n_kv, hd] into physical rows `rows` (a long tensor on the cache's device); `decode`: written
        by a decode step (the `decode_scale` hook's)."""
        if self.rounding is not None:
            k, v = self.rounding(k), self.rounding(v)
        if self.quant is None:
            self.k[layer][rows] = k.to(self.k[layer].dtype)
            self.v[layer][rows] = v.to(self.v[layer].dtype)
            return
        for x, kind, codes, scales in ((k, "k", self.k, self.ks), (v, "v", self.v, self.vs)):
            sc = self.quant.scales_for(x, kind, layer)
            codes[layer][rows] = self.quant.quantize(x, sc)
            if decode and self.decode_scale is not None:
                sc = sc * self.decode_scale
            scales[layer][rows] = sc

    def rows(self, block_table: list[int], start: int, end: int):
        """Physical row of every position in [start, end)."""
        torch = self._torch
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, layer: int, block_table: list[int], start: int, k, v) -> None:
        """Store K/V [n, n_kv, hd] for positions start .. start + n - 1."""
        self.store(layer, self.rows(block_table, start, start + k.shape[0]).to(self.k[layer].device), k, v)

    def read(self, layer: int, block_table: list[int], length: int, seq=None):
        """K, V for positions 0 .. length - 1: [length, n_kv, hd] each (`seq`: the request reading them, for
        the read hook)."""
        rows = self.rows(block_table, 0, length).to(self.k[layer].device)
        if self.quant is None:
            return self.k[layer][rows], self.v[layer][rows]
        pos = self._torch.arange(length, device=rows.device)[None, :]
        masks = self.read_fault([seq], pos, False) if self.read_fault is not None and seq is not None else None
        return tuple(
            self._dequantize(c[layer][rows][None], s[layer][rows][None], masks)[0]
            for c, s in ((self.k, self.ks), (self.v, self.vs))
        )

    def decode_kv(self, layer: int, tables, n: int, n_blocks: int, seqs=None):
        """K, V of whole blocks `tables` (n * n_blocks block ids, flattened) as [n, n_blocks * block_size,
        n_kv, hd] each: one gather for a group of decodes (`seqs`, the requests reading them, for the read
        hook). Whole blocks via index_select (same bytes as a row gather, ~10x faster than advanced
        indexing) into buffers kept across steps and layers: a fresh multi-MB tensor per step costs page
        faults."""
        torch, bs = self._torch, self.block_size
        width = n_blocks * bs
        out = []
        for j, c, s in ((0, self.k, self.ks), (1, self.v, self.vs)):
            c = c[layer]
            codes = torch.index_select(
                c.view(-1, bs, *c.shape[1:]), 0, tables, out=self.scratch(j, (n * n_blocks, bs, *c.shape[1:]), c)
            ).view(n, width, *c.shape[1:])
            if self.quant is None:
                out.append(codes)
                continue
            s = s[layer]
            scales = torch.index_select(s.view(-1, bs, *s.shape[1:]), 0, tables).view(n, width, *s.shape[1:])
            pos = torch.arange(width, device=codes.device)[None, :].expand(n, width)
            masks = self.read_fault(seqs, pos, True) if self.read_fault is not None and seqs is not None else None
            out.append(self._dequantize(codes, scales, masks))
        return out[0], out[1]

    def _dequantize(self, codes, scales, masks):
        """codes [n, width, heads, hd], scales [n, width, heads, groups] -> float32, the read hook's masks
        ([n, width]) applied: `requantized` rows' codes quantized again with their own scale (the scale
        applied twice), `unscaled` rows read with 1.0."""
        torch = self._torch
        if masks:
            twice = masks.get("requantized")
            if twice is not None and bool(twice.any()):
                n, w, h, hd = codes.shape
                again = self.quant.quantize(codes.float().reshape(n * w, h, hd), scales.reshape(n * w, h, -1))
                codes = torch.where(twice[..., None, None], again.view(n, w, h, hd).float(), codes.float())
            lost = masks.get("unscaled")
            if lost is not None and bool(lost.any()):
                scales = torch.where(lost[..., None, None], torch.ones_like(scales), scales)
        return self.quant.dequantize(codes, scales)
