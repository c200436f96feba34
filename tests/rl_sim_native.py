"""A simulated RL dump (lpf's layout, from `lpf rl simulate`) rewritten the way prime-rl, NeMo-RL and
slime write their own dumps, so `lpf rl explain` can be checked on the native readers.

The layouts follow the same writer code as `rl_fixtures.py` (cited there; snapshots in docs/rl.md):
prime-rl token_exports/step_<step>/rank_0.jsonl with its micro-batch coordinates (micro_step = the
trainer's micro-batch, micro_sequence_idx = the sample's place in it) and the float32 loss columns
the exporter computes; NeMo-RL train_data_step<step>.jsonl (batch dimension 1, right padding, a 0
prepended to prev_logprobs, no micro-batch record: NeMo-RL's logger has none); slime
--dump-details train_data/<step>.pt with its dp_shards layout (partition + micro_batch_indices).
Values go through float32 as the frameworks hold them. `native_id(fmt, row, index)` is the name each
framework's reader gives a response. Shares no code with `lpf.rl`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

FORMATS = ("prime-rl", "nemo-rl", "slime")
PROMPT_LOGPROB = -1.0  # the trainer's logprob of prompt tokens: the dumps carry one, nothing reads it


def _f32(a) -> list:
    return [v if math.isfinite(v) else None for v in np.asarray(a, dtype=np.float32).tolist()]


def by_step(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(r["step"], []).append(r)
    return out


def native_id(fmt: str, row: dict, index: int) -> str:
    """`index`: the row's position within its step (the order the writers below keep)."""
    if fmt == "prime-rl":
        return f"rank_0/seq_{index}"
    if fmt == "nemo-rl":
        return f"idx_{index}"
    return f"sample_{row['step'] * 1000 + index}"


def write(fmt: str, rows: list[dict], root: Path, vocab: int) -> Path:
    return {"prime-rl": _prime_rl, "nemo-rl": _nemo_rl, "slime": _slime}[fmt](rows, root, vocab)


def _prime_rl(rows, root: Path, vocab: int) -> Path:
    out = root / "token_exports"
    for step, resps in by_step(rows).items():
        lines = []
        within: dict[int, int] = {}
        for i, r in enumerate(resps):
            p, o = r["prompt_token_ids"], r["response_token_ids"]
            n = len(p) + len(o)
            inf = np.array([0.0] * len(p) + list(r["rollout_logprobs"]), dtype=np.float32)
            tr = np.array([PROMPT_LOGPROB] * len(p) + list(r["trainer_logprobs"]), dtype=np.float32)
            tr[0] = np.float32(math.log(1.0 / vocab))
            lr = tr - inf
            mb = r["micro_batch"]
            k = within.get(mb, 0)
            within[mb] = k + 1
            lines.append(
                {
                    "schema_version": 1,
                    "step": step,
                    "rank": 0,
                    "micro_step": mb,
                    "micro_sequence_idx": k,
                    "export_sequence_idx": i,
                    "env_name": "oracle",
                    "token_ids": list(p) + list(o),
                    "position_ids": list(range(n)),
                    "loss_mask": [False] * len(p) + [True] * len(o),
                    "advantages": [0.0] * n,
                    "inference_logprobs": _f32(inf),
                    "trainer_logprobs": _f32(tr),
                    "entropy": _f32(np.full(n, 1.0)),
                    "mismatch_kl": _f32(np.exp(lr) - lr - np.float32(1.0)),
                    "log_importance_ratio": _f32(lr),
                    "importance_ratio": _f32(np.exp(lr)),
                    "prob_delta": _f32(np.exp(tr) - np.exp(inf)),
                    "is_masked": [False] * n,
                    "is_masked_high": [False] * n,
                    "is_masked_low": [False] * n,
                    "rl_weights": [None] * n,
                    "ce_weights": [None] * n,
                    "ref_kl_weights": [None] * n,
                }
            )
        d = out / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "rank_0.jsonl").write_text(
            "".join(json.dumps(x, separators=(",", ":"), allow_nan=False) + "\n" for x in lines)
        )
        (d / "STABLE").touch()
    return out


def _nemo_rl(rows, root: Path, vocab: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for step, resps in by_step(rows).items():
        width = max(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in resps)
        recs = []
        for i, r in enumerate(resps):
            p, o = r["prompt_token_ids"], r["response_token_ids"]
            n, pad = len(p) + len(o), width - len(p) - len(o)
            gen = [0.0] * len(p) + list(r["rollout_logprobs"]) + [0.0] * pad
            prev = [0.0] + [PROMPT_LOGPROB] * (len(p) - 1) + list(r["trainer_logprobs"]) + [-5.0] * pad
            recs.append(
                {
                    "content": [["<prompt>", "<response>"]],
                    "rewards": [0.0],
                    "input_lengths": [n],
                    "token_ids": [list(p) + list(o) + [0] * pad],
                    "token_loss_mask": [[0] * len(p) + [1] * len(o) + [0] * pad],
                    "sample_loss_mask": [1],
                    "advantages": [[0.0] * width],
                    "generation_logprobs": [_f32(gen)],
                    "prev_logprobs": [_f32(prev)],
                    "idx": i,
                }
            )
        (root / f"train_data_step{step}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    return root


def _slime(rows, root: Path, vocab: int) -> Path:
    import torch

    d = root / "train_data"
    d.mkdir(parents=True, exist_ok=True)
    for step, resps in by_step(rows).items():
        samples, mbs = [], {}
        for i, r in enumerate(resps):
            p, o = r["prompt_token_ids"], r["response_token_ids"]
            samples.append(
                {
                    "data_parallel_rank": 0,
                    "sample_index": step * 1000 + i,
                    "rollout_position": i,
                    "tokens": torch.tensor(list(p) + list(o), dtype=torch.long),
                    "response_lengths": len(o),
                    "total_lengths": len(p) + len(o),
                    "rewards": 0.0,
                    "truncated": 0,
                    "rollout_ids": i,
                    "loss_masks": torch.ones(len(o), dtype=torch.int),
                    "rollout_mask_sums": torch.tensor(float(len(o))),
                    "rollout_log_probs": torch.tensor(r["rollout_logprobs"], dtype=torch.float32),
                    "log_probs": torch.tensor(r["trainer_logprobs"], dtype=torch.float32),
                }
            )
            mbs.setdefault(r["micro_batch"], []).append(i)
        layout = [
            {
                "rank": 0,
                "data_parallel_rank": 0,
                "sample_indices": [s["sample_index"] for s in samples],
                "partition": list(range(len(samples))),
                "micro_batch_indices": [mbs[k] for k in sorted(mbs)],
                "num_microbatches": [len(mbs)],
                "global_batch_sizes": [len(samples)],
            }
        ]
        torch.save(
            {
                "format_version": 2,
                "rollout_id": step,
                "rank": 0,
                "samples": samples,
                "dp_shards": layout,
                "raw_reward": [0.0] * len(samples),
            },
            d / f"{step}.pt",
        )
    return root
