"""The rows a reference batch scores and their statistics, packed in one float32 block per batch.

Contract:
- `batch_inputs(batch, asked, device, pin)`: a batch of items (each with `prompt_token_ids` and
  `output_token_ids`: `lpf.pipeline.reference.ScoreItem`) as (ids [B, width], the flat index in
  [B * width] of each scored row, its target token), on `device`. Rows: every item's output positions
  first, in batch order, then the prompt positions 1..P-1 of the `asked` (row, item) pairs.
- `row_stats(logits, targets, k, work, fused)`: one chunk of rows' statistics as a float32 block
  [n, 3 + 2 * max(k, 1) + 1]: the target's logprob, the entropy, the target's rank (1 = argmax), the top
  max(k, 1) logprobs, their ids, and the log-sum-exp of the raw logits (logit = logprob + it: what a
  penalty acting on raw logits, `lpf.analysis.penalties`, is fitted against). It overwrites `logits`.
  Token ids and ranks are < 2^24, so they travel exact as float32 (the rescorer refuses larger vocabularies).
- `rows_table(block, topk, request_ids, positions)`: those rows as a `schema.REFERENCE` table;
  `seeded_table(reference, draws)`: a replay's draws beside them as a `schema.SEEDED` table.
One block per batch means one device-to-host copy per batch, the only synchronisation the rescorer makes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import torch

from lpf.core.torch_utils import logprob_rows
from lpf.run import schema


def list_column(matrix: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """An [N, k] matrix as an Arrow list column (k may be 0)."""
    n, k = matrix.shape
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * k)
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.ravel(), type=value_type))


def batch_inputs(
    batch: Sequence, asked: Sequence[tuple[int, object]], device: torch.device, pin: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, width], flat index of each scored row in [B * width], its target token), sent up
    from one host buffer (pinned when `pin`: a GPU) in one copy: every output row first, then the prompt
    rows of the `asked` items (row q predicts prompt token q + 1). Right padding: causal attention
    and the causal scan never let later (pad) positions touch earlier ones, so no mask is needed."""
    lengths = [len(it.prompt_token_ids) + len(it.output_token_ids) for it in batch]
    width, n = max(lengths), len(batch)
    n_rows = sum(len(it.output_token_ids) for it in batch) + sum(len(it.prompt_token_ids) - 1 for _, it in asked)
    host = torch.zeros(n * width + 2 * n_rows, dtype=torch.long, pin_memory=pin)
    buf = host.numpy()
    at = n * width
    for row, it in enumerate(batch):
        p, o = len(it.prompt_token_ids), len(it.output_token_ids)
        buf[row * width : row * width + p] = it.prompt_token_ids
        buf[row * width + p : row * width + p + o] = it.output_token_ids
        buf[at : at + o] = np.arange(row * width + p - 1, row * width + p - 1 + o)
        buf[at + n_rows : at + n_rows + o] = it.output_token_ids
        at += o
    for row, it in asked:
        p = len(it.prompt_token_ids)
        buf[at : at + p - 1] = np.arange(row * width, row * width + p - 1)
        buf[at + n_rows : at + n_rows + p - 1] = it.prompt_token_ids[1:]
        at += p - 1
    dev = host.to(device, non_blocking=pin)
    return dev[: n * width].view(n, width), dev[n * width : n * width + n_rows], dev[n * width + n_rows :]


def row_stats(logits: torch.Tensor, targets: torch.Tensor, k: int, work: torch.Tensor, fused: bool) -> torch.Tensor:
    """The float32 block of one chunk of rows (module docstring); `logits` [n, V] is overwritten."""
    z_token = logits.gather(1, targets[:, None])  # before logprob_rows overwrites the logits: the lse from it
    chosen, top_ids, top_lp, rank, entropy = logprob_rows(logits, targets, k, work, overwrite=True, fused=fused)
    return torch.cat(
        [
            chosen[:, None],
            entropy[:, None],
            rank[:, None].float(),
            top_lp,
            top_ids.float(),
            z_token.float() - chosen[:, None],
        ],
        dim=1,
    )


def rows_table(res: np.ndarray, topk: int, request_ids: list[str], positions: list[np.ndarray]) -> pa.Table:
    """Reference rows from the packed float32 block: request i has len(positions[i]) consecutive
    rows at those positions."""
    kk = max(topk, 1)
    top_lp, top_ids = res[:, 3 : 3 + kk], res[:, 3 + kk : 3 + 2 * kk].astype(np.int32)
    return pa.table(
        {
            "request_id": pa.array(np.repeat(request_ids, [len(p) for p in positions])),
            "position": pa.array(np.concatenate(positions).astype(np.int32)),
            "ref_logprob": pa.array(res[:, 0].astype(np.float64)),
            "ref_rank": pa.array(res[:, 2].astype(np.int32)),
            "ref_entropy": pa.array(res[:, 1]),
            "ref_top1_id": pa.array(top_ids[:, 0]),
            "ref_top1_logprob": pa.array(top_lp[:, 0].astype(np.float64)),
            "ref_topk_ids": list_column(np.ascontiguousarray(top_ids[:, :topk]), pa.int32()),
            "ref_topk_logprobs": list_column(np.ascontiguousarray(top_lp[:, :topk]), pa.float32()),
            "ref_logsumexp": pa.array(res[:, 3 + 2 * kk]),
        },
        schema=schema.REFERENCE,
    )


def seeded_table(reference: pa.Table, draws: list[dict]) -> pa.Table:
    """A seeded replay's draws (`lpf.pipeline.replay.Replay.draw`, one dict per chunk, in row order)
    beside the reference rows they were drawn for."""
    d = {key: np.concatenate([x[key] for x in draws]) for key in draws[0]}
    return pa.table(
        {
            "request_id": reference.column("request_id"),
            "position": reference.column("position"),
            "seeded_token": pa.array(d["token"]),
            "seeded_margin": pa.array(d["margin"]),
            "seeded_runner_up": pa.array(d["runner_up"]),
        },
        schema=schema.SEEDED,
    )
