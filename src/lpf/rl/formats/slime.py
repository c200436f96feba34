"""slime: the debug dumps of `--dump-details DIR` (`rollout_data/{rollout_id}.pt`, `train_data/{rollout_id}.pt`).

Follows slime/observability/train_data_utils.py (`save_debug_train_data`, `_build_dump_payload`) and
slime/observability/rollout_data_utils.py (`save_debug_rollout_data`), THUDM/slime @ 624b824a. The
train dump is a torch.save of {"format_version": 2, "rollout_id", "rank", "samples", "dp_shards",
"raw_reward"}: one dict per training sample, sorted by `rollout_position` (the sample's index in the
rollout dump), with data_parallel_rank, sample_index (Sample.index), tokens (prompt + response, long),
response_lengths, total_lengths, loss_masks (int, response part), rollout_log_probs (the engine's,
float32), log_probs (the actor's recomputation, float32; captured from the training forward when
not recomputed), rollout_ids (the averaging unit of slime's per-rollout mean) and the rest of the
rollout data. The rollout dump is {"rollout_id", "samples": [Sample.to_dict()]}: the engine side
only; it adds group_index (the GRPO prompt) and status to the train samples it lines up with.
Rollout ids count from 0 (`--start-rollout-id`); the step is the rollout id.

The train dump's `dp_shards` layout (per data-parallel rank: `partition`, the rollout positions of its
local samples, and `micro_batch_indices`, the local samples of each micro-batch) gives each sample
its micro_batch and micro_batch_size (the batch shape `lpf rl explain` tests).
Files are read with `torch.load(path, weights_only=True)` only: no pickled code ever runs; a file
that needs more is refused with a message saying so. Responses are named `sample_I` (Sample.index),
or `position_P` when the index is unset. A sample whose loss_masks are all 0 (slime's remove_sample)
is skipped, not bad.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from lpf.core.errors import LpfError
from lpf.rl.dump import RawRow
from lpf.rl.formats.common import BadRow, Skipped

NAME = "slime"
REQUIRED = ("tokens", "response_lengths", "loss_masks", "rollout_log_probs", "log_probs")
LAYOUT = "slime --dump-details .pt"
KINDS = ("torch",)
DETECT = None  # its files are torch files: their kind tells it
NO_FILES = "no torch files here (slime's --dump-details writes rollout_data/{id}.pt and train_data/{id}.pt)"
NOT_ITS_KIND = (
    "not a torch file, and slime's --dump-details writes torch .pt files (rollout_data/{id}.pt, train_data/{id}.pt)"
)
_KEEP = ("sample_index", "rollout_position", "data_parallel_rank", "truncated")


def load(path: Path) -> dict:
    import pickle

    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        why = f"it needs {m.group(1)}" if m else re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()[0][:160]
        raise LpfError(
            f"{path}: torch.load(weights_only=True) refuses it ({why}); lpf never runs pickled code: "
            f"save the dump with tensors, numbers, strings, lists and dicts only"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise LpfError(f"{path}: not a readable torch file, perhaps cut off ({why})") from None
    return payload


def is_dump(payload) -> bool:
    return isinstance(payload, dict) and isinstance(payload.get("samples"), list)


def role(payload: dict) -> str:
    """'train' (slime's train dump), 'rollout' (the engine-side dump) or '' (neither)."""
    first = next((s for s in payload["samples"] if isinstance(s, dict)), {})
    if "response_lengths" in first or "log_probs" in first or "format_version" in payload:
        return "train"
    if "response_length" in first or "status" in first:
        return "rollout"
    return ""


def matches(keys: set[str]) -> bool:
    """Whether a train sample's fields are slime's (its files are told by their kind; this names a near miss)."""
    return set(REQUIRED) <= keys


def missing(keys: set[str]) -> list[str]:
    return [k for k in REQUIRED if k not in keys]


def _list(v) -> list:
    return v.tolist() if hasattr(v, "tolist") else list(v)


def _scalar(v):
    v = v.item() if hasattr(v, "item") and getattr(v, "ndim", 0) == 0 else v
    return v if isinstance(v, (bool, int, float, str)) or v is None else None


def convert(s: dict, rollout_id, joined: dict | None) -> dict:
    if not isinstance(s, dict):
        raise BadRow("a sample that is not a dict")
    for k in ("tokens", "response_lengths", "loss_masks", "rollout_log_probs"):
        if s.get(k) is None:
            raise BadRow(f"missing {k}")
    if s.get("log_probs") is None:
        raise BadRow("missing log_probs (the actor's recomputation: slime dumps it with --dump-details)")
    tokens, n = _list(s["tokens"]), _scalar(s["response_lengths"])
    if not isinstance(n, int) or not 0 < n <= len(tokens):
        raise BadRow(f"response_lengths {n!r} does not fit {len(tokens)} tokens")
    mask = _list(s["loss_masks"])
    if len(mask) == n and not any(mask):
        raise Skipped("loss_masks all 0: slime removed this sample from training")
    index, position = _scalar(s.get("sample_index")), _scalar(s.get("rollout_position"))
    rid = f"sample_{index}" if index is not None else f"position_{position}"
    out = {
        "step": _scalar(rollout_id),
        "request_id": rid,
        "prompt_token_ids": tokens[: len(tokens) - n],
        "response_token_ids": tokens[len(tokens) - n :],
        "rollout_logprobs": _list(s["rollout_log_probs"]),
        "trainer_logprobs": _list(s["log_probs"]),
        "loss_mask": mask,
        "group": _scalar(s.get("rollout_ids")) if s.get("rollout_ids") is not None else None,
    }
    out.update({k: _scalar(s[k]) for k in _KEEP if k in s and _scalar(s[k]) is not None})
    if joined is not None:
        if joined.get("group_index") is not None:
            out["prompt_id"] = str(joined["group_index"])
        if isinstance(joined.get("status"), str):
            out["status"] = joined["status"]
    return out


def raw_rows(files: list[Path], label, ignored: list[Path]) -> Iterator[RawRow]:
    """Every train sample of the train dumps among `files`, joined to its rollout-dump sample when
    one lines up (same rollout id, same tokens at its rollout_position). A torch file that is no
    slime dump (a checkpoint beside the dumps) goes to `ignored`; given alone, it is an error."""
    train, rollout = [], {}
    for f in files:
        payload = load(f)
        if not is_dump(payload):
            if len(files) == 1:
                raise LpfError(f"{f}: a torch file, but not a slime debug dump (expected a dict with a samples list)")
            ignored.append(f)
            continue
        r = role(payload)
        if r == "train":
            train.append((f, payload))
        elif r == "rollout":
            rollout.setdefault(payload.get("rollout_id"), []).append(payload)
        else:
            ignored.append(f)
    if not train:
        raise LpfError(
            "slime rollout_data dumps hold the engine side only (rollout_log_probs); the trainer's "
            "log_probs are in train_data/{rollout_id}.pt, which --dump-details (or --save-debug-train-data) "
            "writes: point lpf at the dump directory or at train_data/"
        )
    for f, payload in train:
        rid = payload.get("rollout_id")
        layout = micro_batches(payload)
        for i, s in enumerate(payload["samples"], 1):
            loc = {**label(f), "row": i}
            try:
                rec = convert(s, rid, _join(s, rollout.get(rid, [])))
                rec.update(layout.get(rec.get("rollout_position"), {}))
                yield RawRow(loc, record=rec)
            except BadRow as e:
                yield RawRow(loc, problem=str(e))
            except Skipped as e:
                yield RawRow(loc, skipped=str(e))


def micro_batches(payload: dict) -> dict:
    """{rollout_position: {"micro_batch", "micro_batch_size"}} from the dump's dp_shards layout
    (micro-batches numbered across ranks in file order); {} when the layout is missing or malformed."""
    out, n = {}, 0
    for shard in payload.get("dp_shards") or []:
        if not isinstance(shard, dict):
            return {}
        part, mbs = shard.get("partition"), shard.get("micro_batch_indices")
        if not isinstance(part, list) or not isinstance(mbs, list):
            continue
        for mb in mbs:
            if not isinstance(mb, list):
                return {}
            for local in mb:
                if isinstance(local, int) and 0 <= local < len(part):
                    out[_scalar(part[local])] = {"micro_batch": n, "micro_batch_size": len(mb)}
            n += 1
    return out


def _join(s, candidates: list[dict]) -> dict | None:
    if not isinstance(s, dict):
        return None
    pos = _scalar(s.get("rollout_position"))
    if not isinstance(pos, int):
        return None
    tokens = _list(s["tokens"]) if s.get("tokens") is not None else None
    for payload in candidates:  # eval_{id}.pt shares the rollout id: the tokens tell them apart
        samples = payload["samples"]
        if (
            0 <= pos < len(samples)
            and isinstance(samples[pos], dict)
            and _list(samples[pos].get("tokens") or []) == tokens
        ):
            return samples[pos]
    return None
