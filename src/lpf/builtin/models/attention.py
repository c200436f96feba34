"""Causal self-attention over the paged KV cache, for a packed batch of several requests.

Contract: `PagedAttention.forward(x [T, hidden], rope)` -> `[T, hidden]`, inside a forward context.
For every request of the step it computes q/k/v of its tokens, stores k/v at positions
`num_computed ..` of its block table FIRST, then reads back K/V of positions `0 .. num_computed +
num_tokens - 1` and attends causally (query at position p sees keys at positions <= p). Decodes
(one token each) are batched into one padded attention call, with every position of a speculative
verify as a query of its own (`ForwardContext.attention_decodes`: K/V of a group are stored before it
reads, and a position's earlier keys sort into the same or an earlier group); prefill/extend chunks run
one request at a time. `rope` is None (no positional embedding: Jamba, Granite with position_embedding_type None) or
`(cos, sin)` of shape [T, head_dim] for the packed batch, built once per step by `Rotary`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lpf.builtin.forward_context import get_forward_context, probe


class Rotary:
    """HF's default RoPE (`rotate_half` layout); other rope types supply inv_freq and attention scaling."""

    def __init__(self, head_dim: int, theta: float, inv_freq: torch.Tensor | None = None, scaling: float = 1.0):
        # explicit device: models are built under torch.device("meta"), and these are not parameters.
        # float32 exactly as HF computes it; float64 for float64 models (HF would round it to float32)
        def freqs(dtype):
            return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype, device="cpu") / head_dim))

        if inv_freq is None:
            self.inv_freq = {torch.float32: freqs(torch.float32), torch.float64: freqs(torch.float64)}
        else:
            self.inv_freq = {torch.float32: inv_freq.float(), torch.float64: inv_freq.double()}
        self.scaling = scaling

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        freqs = positions[:, None].to(wide) * self.inv_freq[wide].to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _length_groups(decodes: list, block_size: int, max_groups: int = 4) -> list[list]:
    """Decodes sorted by context length, cut where padding to the group's longest would waste more
    than the cost of one more attention call (at most `max_groups` groups)."""
    if not decodes:
        return []
    ordered = sorted(decodes, key=lambda s: s.num_computed)
    blocks = [s.num_computed // block_size + 1 for s in ordered]
    groups, start = [], 0
    for _ in range(1, max_groups):
        # split the remaining run at the point that halves its padded block count the most
        best, at = 0, None
        for i in range(start + 1, len(ordered)):
            saved = (i - start) * (blocks[-1] - blocks[i - 1])
            if saved > best:
                best, at = saved, i
        if at is None or best < 8 * len(ordered):
            break
        groups.append(ordered[start:at])
        start = at
    groups.append(ordered[start:])
    return groups


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


class PagedAttention(nn.Module):
    def __init__(
        self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, scale: float, bias: bool, attn_layer: int
    ):
        super().__init__()
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=bias)
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = scale
        self.attn_layer = attn_layer  # ordinal among attention layers: the KV cache's layer index

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(T, self.n_kv, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return self.o_proj(self.attend(q, k, v).view(T, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The step's attention of q [T, heads, head_dim] (k, v [T, kv_heads, head_dim], positional
        embedding applied) over the paged cache, k/v stored first: [T, heads, head_dim]."""
        ctx = get_forward_context()
        T = q.shape[0]
        probe(self, "q", q)
        probe(self, "k", k)
        probe(self, "v", v)
        out = q.new_zeros(T, self.n_heads, self.head_dim)
        for s in ctx.chunks:
            out[s.start : s.end] = self._attend_one(
                ctx.kv_cache, s, q[s.start : s.end], k[s.start : s.end], v[s.start : s.end]
            )
        # Decodes in a few groups of similar length: one padded batch for all would gather every
        # request's K/V up to the longest context, and that copy dominates a decode step.
        for g, plan in enumerate(_decode_plans(ctx, q.device)):
            idx = plan.idx
            out[idx] = self._attend_decodes(ctx.kv_cache, plan, q[idx], k[idx], v[idx], g)
        probe(self, "attn_out", out)
        return out

    def _attend_one(self, cache, s, q, k, v) -> torch.Tensor:
        cache.write(self.attn_layer, s.block_table, s.num_computed, k, v)
        K, V = cache.read(self.attn_layer, s.block_table, s.num_computed + s.num_tokens, seq=s)
        n, total = q.shape[0], K.shape[0]
        if s.num_computed == 0:
            mask, causal = None, True
        else:
            key_pos = torch.arange(total, device=q.device)
            mask = key_pos[None, :] <= (s.num_computed + torch.arange(n, device=q.device))[:, None]
            causal = False
        # batch dim of 1: the same kernel as HF's sdpa path, so a one-step prefill rounds like HF
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            K.transpose(0, 1).to(q.dtype)[None],
            V.transpose(0, 1).to(q.dtype)[None],
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=self.n_heads != self.n_kv,
        )
        return o[0].transpose(0, 1)

    def _attend_decodes(self, cache, plan: "DecodePlan", q, k, v, group: int = 0) -> torch.Tensor:
        """One padded attention call for a group of single-token requests. Rows follow KVCache's layout
        (position p of a request lives at row block_table[p // block_size] * block_size + p % block_size),
        gathered for all requests at once instead of one `read` each (`KVCache.decode_kv`)."""
        cache.store(self.attn_layer, plan.new_rows, k, v, decode=True)
        K, V = (
            x.to(q.dtype).transpose(1, 2)
            for x in cache.decode_kv(self.attn_layer, plan.tables, plan.n, plan.n_blocks, plan.seqs)
        )
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], K, V, attn_mask=plan.mask, scale=self.scale, enable_gqa=self.n_heads != self.n_kv
        )
        return o[:, :, 0, :]


class DecodePlan:
    """One group of decodes, as every attention layer of the step indexes it: the requests' rows in the
    packed batch, the cache row each new K/V goes to, the block tables (padded to the group's longest,
    flattened) and the mask of real positions. The same for every layer: built once per step."""

    def __init__(self, group: list, block_size: int, device):
        bs = block_size
        self.seqs = group
        self.n = len(group)
        self.idx = torch.tensor([s.start for s in group], dtype=torch.long, device=device)
        self.new_rows = torch.tensor(
            [s.block_table[s.num_computed // bs] * bs + s.num_computed % bs for s in group],
            dtype=torch.long,
            device=device,
        )
        lengths = [s.num_computed + 1 for s in group]
        nb = -(-max(lengths) // bs)
        self.n_blocks = nb
        self.tables = torch.tensor(
            [(s.block_table[:nb] + [0] * nb)[:nb] for s in group], dtype=torch.long, device=device
        ).flatten()
        pos = torch.arange(nb * bs, device=device)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        self.mask = (pos[None, :] < lengths_t[:, None])[:, None, None, :]


def _decode_plans(ctx, device) -> list[DecodePlan]:
    if "attn_decode_plans" not in ctx.memo:
        bs = ctx.kv_cache.block_size
        groups = _length_groups(ctx.attention_decodes, bs)
        ctx.memo["attn_decode_plans"] = [DecodePlan(g, bs, device) for g in groups]
    return ctx.memo["attn_decode_plans"]
