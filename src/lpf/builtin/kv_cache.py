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
    its rounding) so prefill and decode paths store alike."""

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
    ):
        import torch

        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks * block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype or torch.float32, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype or torch.float32, device=device) for _ in range(num_layers)]
        self.rounding = rounding
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

    def store(self, layer: int, rows, k, v) -> None:
        """K/V [n, n_kv, hd] into physical rows `rows` (a long tensor on the cache's device)."""
        if self.rounding is not None:
            k, v = self.rounding(k), self.rounding(v)
        self.k[layer][rows] = k.to(self.k[layer].dtype)
        self.v[layer][rows] = v.to(self.v[layer].dtype)

    def rows(self, block_table: list[int], start: int, end: int):
        """Physical row of every position in [start, end)."""
        torch = self._torch
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, layer: int, block_table: list[int], start: int, k, v) -> None:
        """Store K/V [n, n_kv, hd] for positions start .. start + n - 1."""
        self.store(layer, self.rows(block_table, start, start + k.shape[0]).to(self.k[layer].device), k, v)

    def read(self, layer: int, block_table: list[int], length: int):
        """K, V for positions 0 .. length - 1: [length, n_kv, hd] each."""
        rows = self.rows(block_table, 0, length).to(self.k[layer].device)
        return self.k[layer][rows], self.v[layer][rows]
