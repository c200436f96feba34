"""NeMo-RL: the per-step training data GRPO writes, `train_data_step{N}.jsonl`.

Follows nemo_rl/algorithms/grpo.py (the "Logging" block of `grpo_train`) and nemo_rl/utils/logger.py
(`Logger.log_batched_dict_as_jsonl`), NVIDIA-NeMo/RL @ 7ea279ab: one file per step named
`train_data_step{total_steps + 1}.jsonl` (steps count from 1; the step is in the file name only),
one line per sample, every value sliced with its batch dimension of 1 (`token_ids` [[...]],
`input_lengths` [n], ...) plus `idx`, the sample's index in the step. Keys: content, rewards,
input_lengths, token_ids (prompt + response, right-padded to the batch's width), token_loss_mask,
sample_loss_mask, advantages, generation_logprobs (the rollout engine's, 0 outside generated tokens)
and prev_logprobs (the policy's recomputation, entry i the logprob of token i, 0 prepended).

Scored tokens are NeMo-RL's own metric mask (nemo_rl/algorithms/loss/loss_functions.py
`ClippedPGLossFn.__call__`): token_loss_mask[1:] x sample_loss_mask, within input_lengths. The
response starts at the first masked token (the context before it is the prompt), named `idx_I`. A
sample with sample_loss_mask 0 is left out by NeMo-RL itself (skipped, not bad). prev_logprobs that
are all 0 mean NeMo-RL skipped the trainer's recomputation (`force_on_policy_ratio`): refused.
"""

from __future__ import annotations

import numpy as np

from lpf.core.errors import LpfError
from lpf.rl.formats.common import BadRow, Ctx, Skipped, step_from_name, unbatch

NAME = "nemo-rl"
REQUIRED = ("token_ids", "token_loss_mask", "generation_logprobs", "prev_logprobs", "input_lengths")
LAYOUT = "NeMo-RL train_data_step{N}.jsonl"
KINDS = ("parquet", "jsonl")
DETECT = 20
_SIGNATURE = {"token_loss_mask", "generation_logprobs", "prev_logprobs"}


def matches(keys: set[str]) -> bool:
    return set(REQUIRED) <= keys or len(_SIGNATURE & keys) >= 2


def missing(keys: set[str]) -> list[str]:
    return [k for k in REQUIRED if k not in keys]


def convert(rec: dict, ctx: Ctx) -> list[dict]:
    ids, tmask = unbatch(rec, "token_ids"), unbatch(rec, "token_loss_mask")
    gen, prev, n = unbatch(rec, "generation_logprobs"), unbatch(rec, "prev_logprobs"), unbatch(rec, "input_lengths")
    if not all(isinstance(v, list) for v in (ids, tmask, gen, prev)):
        raise BadRow("token_ids / token_loss_mask / generation_logprobs / prev_logprobs must be lists of lists")
    width = {len(ids), len(tmask), len(gen), len(prev)}
    if len(width) != 1:
        raise BadRow(
            f"length mismatch: token_ids {len(ids)}, token_loss_mask {len(tmask)}, "
            f"generation_logprobs {len(gen)}, prev_logprobs {len(prev)}"
        )
    if not isinstance(n, int) or not 0 < n <= len(ids):
        raise BadRow(f"input_lengths {n!r} does not fit the padded width {len(ids)}")
    sample_mask = unbatch(rec, "sample_loss_mask") if "sample_loss_mask" in rec else 1
    if not sample_mask:
        raise Skipped("sample_loss_mask 0: NeMo-RL leaves this sample out of its loss and metrics")
    step = step_from_name(ctx.file)
    if step is None:
        raise BadRow("no step: NeMo-RL writes it only in the file name (train_data_step{N}.jsonl)")
    mask = [0] + [1 if m else 0 for m in tmask[1:n]]  # the loss reads [:, 1:]: position 0 never counts
    on = [i for i, m in enumerate(mask) if m]
    if not on:
        raise BadRow("no token_loss_mask token within input_lengths")
    first = on[0]
    idx = rec.get("idx", ctx.row - 1)
    out = {
        "step": step,
        "request_id": f"idx_{idx}",
        "idx": idx,
        "prompt_token_ids": ids[:first],
        "response_token_ids": ids[first:n],
        "rollout_logprobs": gen[first:n],
        "trainer_logprobs": prev[first:n],
        "loss_mask": mask[first:n],
    }
    return [out]


def after(dump) -> None:
    if dump.tok_trainer.size and not np.any(dump.tok_trainer):
        raise LpfError(
            f"{dump.source}: prev_logprobs are all 0: NeMo-RL skipped the trainer's recomputation "
            f"(loss_fn.force_on_policy_ratio=True), so there is no trainer side to compare"
        )
