"""prime-rl: the trainer's per-token exports (`trainer.enable_token_export = true`).

Follows src/prime_rl/trainer/rl/token_export.py (`TokenExporter`, PrimeIntellect-ai/prime-rl
@ 559b4477): `<output_dir>/token_exports/step_<step>/rank_<rank>.jsonl`, one JSON line per packed
sequence of a micro batch (prompt + completion of one training sample, trailing padding trimmed, rows
without a loss-mask token not written), keys schema_version, step, rank, micro_step,
micro_sequence_idx, export_sequence_idx (the line's index in its file), env_name and aligned
per-token lists token_ids, position_ids, loss_mask, advantages, inference_logprobs,
trainer_logprobs (shifted right in train.py, so entry i is the logprob of token_ids[i]), entropy,
mismatch_kl, log_importance_ratio, importance_ratio, prob_delta, is_masked*, rl_weights /
ce_weights / ref_kl_weights (all null: the default weights). Non-finite floats are written as null.
Steps count from 1 (src/prime_rl/trainer/ckpt.py `Progress.step`).

One response per loss-masked span (a multi-turn sample has one span per model turn: each was one
engine request), named `rank_R/seq_S` (+ `/span_K` when the sample has several), with step, rank and
the micro-batch coordinates kept as metadata. Scored tokens are prime-rl's own mismatch mask
(src/prime_rl/trainer/rl/train.py): the loss mask, narrowed to rl / ref_kl members when weight
streams are present (ce-only tokens have no sampling logprob). The export's own mismatch_kl column
is checked against its logprobs: a row whose columns disagree is a bad row, not evidence.
"""

from __future__ import annotations

import numpy as np

from lpf.rl.formats.common import BadRow, Ctx, Skipped, spans, step_from_name

NAME = "prime-rl"
REQUIRED = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")
LAYOUT = "prime-rl token exports"
KINDS = ("parquet", "jsonl")
DETECT = 10
_SIGNATURE = {"inference_logprobs", "trainer_logprobs", "export_sequence_idx"}
_META = ("rank", "micro_step", "micro_sequence_idx", "export_sequence_idx", "env_name", "schema_version")
_LISTS = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")


def matches(keys: set[str]) -> bool:
    return set(REQUIRED) <= keys or len(_SIGNATURE & keys) >= 2


def missing(keys: set[str]) -> list[str]:
    return [k for k in REQUIRED if k not in keys]


def _weights(rec: dict, key: str, n: int) -> np.ndarray | None:
    w = rec.get(key)
    if w is None or all(v is None for v in w):
        return None
    if len(w) != n:
        raise BadRow(f"{key} has {len(w)} entries for {n} tokens")
    return np.asarray([0.0 if v is None else v for v in w], dtype=np.float64)


def sampled_mask(rec: dict, loss: np.ndarray) -> np.ndarray:
    rl, ref_kl = _weights(rec, "rl_weights", loss.size), _weights(rec, "ref_kl_weights", loss.size)
    if rl is None and ref_kl is None:
        return loss
    sampled = (rl != 0) if rl is not None else loss.copy()
    if ref_kl is not None:
        sampled |= ref_kl != 0
    return loss & sampled


def convert(rec: dict, ctx: Ctx) -> list[dict]:
    for k in _LISTS:
        if not isinstance(rec.get(k), list):
            raise BadRow(f"missing {k}" if rec.get(k) is None else f"{k} must be a list")
    ids = rec["token_ids"]
    lens = {k: len(rec[k]) for k in _LISTS}
    if len(set(lens.values())) != 1:
        raise BadRow("length mismatch: " + ", ".join(f"{k} {v}" for k, v in lens.items()))
    loss = np.asarray([bool(m) for m in rec["loss_mask"]], dtype=bool)
    scored = sampled_mask(rec, loss)
    _check_mismatch_kl(rec, scored)
    step = rec.get("step", step_from_name(ctx.file))
    rank = rec.get("rank")
    seq = rec.get("export_sequence_idx", ctx.row - 1)
    base = {k: rec[k] for k in _META if k in rec and not isinstance(rec[k], (list, dict))}
    runs = spans(loss.tolist())
    if runs and not scored.any():
        raise Skipped(
            "no sampled token: a ce-only sample (frozen-model tokens, no sampling logprobs), which "
            "prime-rl's mismatch metrics leave out too"
        )
    out = []
    for k, (s, e) in enumerate(runs):
        if not scored[s:e].any():
            continue  # a ce-only turn: nothing sampled to compare
        rid = f"rank_{rank}/seq_{seq}" + (f"/span_{k}" if len(runs) > 1 else "")
        out.append(
            {
                **base,
                "step": step,
                "request_id": rid,
                "prompt_token_ids": ids[:s],
                "response_token_ids": ids[s:e],
                "rollout_logprobs": rec["inference_logprobs"][s:e],
                "trainer_logprobs": rec["trainer_logprobs"][s:e],
                "loss_mask": scored[s:e].astype(int).tolist(),
                "group": f"{rank}/{seq}",
                **({"span": k} if len(runs) > 1 else {}),
            }
        )
    if not out:
        raise BadRow("no loss-masked token (prime-rl does not export such rows)")
    return out


def _check_mismatch_kl(rec: dict, scored: np.ndarray) -> None:
    mkl = rec.get("mismatch_kl")
    if not isinstance(mkl, list) or len(mkl) != scored.size:
        return
    have = np.array([v is not None for v in mkl]) & scored
    if not have.any():
        return
    idx = np.flatnonzero(have)
    try:
        r = np.asarray([rec["inference_logprobs"][i] for i in idx], dtype=np.float32)
        t = np.asarray([rec["trainer_logprobs"][i] for i in idx], dtype=np.float32)
    except (TypeError, ValueError):
        return  # null logprobs: the record check names them
    lr = t - r
    ours = np.exp(lr) - lr - np.float32(1)
    theirs = np.asarray([mkl[i] for i in idx], dtype=np.float64)
    off = np.abs(ours - theirs) > 1e-5 + 1e-3 * np.abs(theirs)
    if off.any():
        i = int(idx[np.argmax(off)])
        raise BadRow(
            f"mismatch_kl[{i}] = {mkl[i]:.6g} but inference/trainer logprobs there give "
            f"{float(ours[np.argmax(off)]):.6g}: the export's columns disagree"
        )
