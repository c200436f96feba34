"""The trainer's side of one simulated RL step, and the ground truth of the mismatch causes.

`score_step(trainer, policy, step, version, finished)` scores the step's responses the way the
trainer does (weights of `step`, its micro-batches, the micro-batch drill when on) and, for the
ground truth only, the same tokens exactly (batch-invariant head) with the trainer's weights and
with the weights that generated them (`version`, older under stale-policy).

`truth_rows(step, finished, trained, drills)` splits each token's d = trainer - rollout logprob
into the contributions that add up to it exactly, with r the reported rollout logprob, r_raw the
engine's raw one, t the trainer's reported, t_x the exact trainer at the step's weights and t_v at
the generating weights:
  processed_logprobs = r_raw - r         (0 unless the engine reports processed logprobs)
  stale_weights      = t_x - t_v         (0 unless the rollout weights are older)
  batch_shape        = t - t_x           (0 unless the trainer's head follows the micro-batch)
  position_growth    = t_v - r_raw       under state-dtype (the engine's state path), else
  floor              = t_v - r_raw       (the engine against an exact float32 trainer: rounding)
One row per response (step, request_id, drills, one list<float64> per cause), written to
`<stem>.causes.parquet`, which analysis never reads: tests score the explainer against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from lpf.pipeline.reference import ScoreItem

TRUTH_CAUSES = ("processed_logprobs", "batch_shape", "position_growth", "stale_weights", "floor")
TRUTH_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("request_id", pa.string()),
        ("drills", pa.list_(pa.string())),
        *[(c, pa.list_(pa.float64())) for c in TRUTH_CAUSES],
    ]
)


@dataclass
class Trained:
    reported: dict  # request id -> the trainer's logprobs, as the dump carries them
    layout: dict  # request id -> (micro_batch, size, padded tokens)
    exact: dict = field(default_factory=dict)  # batch-invariant, the step's weights
    exact_rollout_weights: dict = field(default_factory=dict)  # batch-invariant, the generating weights


def score_step(trainer, policy, step: int, version: int, finished) -> Trained:
    items = [
        ScoreItem(req.request_id, list(prompt.prompt_token_ids), req.output_token_ids) for req, prompt, _ in finished
    ]
    if policy is not None:
        trainer.set_weights(policy.weights(step))
    reported, layout = trainer.score_step(items)
    exact = trainer.score_step(items, exact=True)[0] if trainer.batch_variant else reported
    at_version = exact
    if policy is not None and version != step:
        trainer.set_weights(policy.weights(version))
        at_version = trainer.score_step(items, exact=True)[0]
        trainer.set_weights(policy.weights(step))
    return Trained(reported, layout, exact, at_version)


def truth_rows(step: int, finished, trained: Trained, drills) -> pa.Table:
    names = drills.names()
    rows = []
    for req, _, _ in finished:
        rid = req.request_id
        r = np.asarray(req.logprobs, dtype=np.float64)
        r_raw = np.asarray(req.raw_logprobs, dtype=np.float64) if req.raw_logprobs else r
        t = np.asarray(trained.reported[rid], dtype=np.float64)
        t_x = np.asarray(trained.exact[rid], dtype=np.float64)
        t_v = np.asarray(trained.exact_rollout_weights[rid], dtype=np.float64)
        engine = t_v - r_raw
        zero = np.zeros_like(r)
        row = {
            "step": step,
            "request_id": rid,
            "drills": names,
            "processed_logprobs": r_raw - r,
            "stale_weights": t_x - t_v,
            "batch_shape": t - t_x,
            "position_growth": engine if drills.state_dtype is not None else zero,
            "floor": zero if drills.state_dtype is not None else engine,
        }
        rows.append({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()})
    return pa.Table.from_pylist(rows, schema=TRUTH_SCHEMA)
