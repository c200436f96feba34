"""The reference's batch plan: which sequences are scored together, shared by every rescore executor.

Contract: `plan_batches(lengths, request_ids, token_budget)` returns the items' indices sorted by
(length, request id) and cut into batches where batch size * longest length <= token_budget (padding
counted; a longer item goes alone) and the padding is at most `PAD_SLACK` of the batch's real tokens.
Pure (no torch, no I/O): the local `Rescorer.batches` and the Ray executor's driver
(`lpf.pipeline.rescore_ray.plan`) pack with this one rule, so both score the same batches.
"""

from __future__ import annotations

from typing import Sequence

PAD_SLACK = 0.10


def plan_batches(lengths: Sequence[int], request_ids: Sequence[str], token_budget: int) -> list[list[int]]:
    """Indices of the items, sorted by (length, request id) and cut into batches where
    batch size * longest length <= token_budget (padding counted; a longer item goes alone) and the
    padding is at most PAD_SLACK of the batch's real tokens (the forward pass is paid per padded
    token; the head gathers rows across a batch, so small batches cost it nothing)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], request_ids[i]))
    out, cur, real = [], [], 0
    for i in order:
        padded = (len(cur) + 1) * lengths[i]
        if cur and (padded > token_budget or padded > (1 + PAD_SLACK) * (real + lengths[i])):
            out.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += lengths[i]
    if cur:
        out.append(cur)
    return out
