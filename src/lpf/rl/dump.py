"""RL rollout dumps: read, convert and validate them into one clean `Dump`.

A dump is Parquet or JSONL (or a directory of them, read in name order), ONE ROW PER RESPONSE.
The `lpf` layout (what `lpf rl simulate` writes):

  step                 int        training step the response was rolled out for (required)
  request_id           str        unique within a step; or give prompt_id + rollout instead
  prompt_id, rollout   str, int   the prompt (GRPO group) and the rollout index within it
  response_token_ids   list<int>  the sampled response tokens (required)
  rollout_logprobs     list<float> logprob of each token under the inference engine (required)
  trainer_logprobs     list<float> logprob of the same token under the trainer's forward (required)
  loss_mask            list<int>  optional, 1 = position counts (multi-turn dumps mask tool output)
  state_slot_min/_max  int        optional engine metadata: the state slots the request ran in
  state_slot_stride    int        optional: elements per state slot (names offset overflows)
  any other scalar column (int, float, bool, str) is kept as metadata for hypotheses.

The verl layout is converted: verl's `rollout_data_dir` JSONL (`<step>.jsonl`, keys input / output /
score / step + any per-sample extra) carrying the DataProto fields `responses` (right-padded ids),
`response_mask` (or the response part of `attention_mask`), `rollout_log_probs` (rollout worker
with `calculate_log_probs=True`) and `old_log_probs` (the actor's recomputation), with `uid` (the
GRPO prompt group) as prompt id and the step from `step` / `global_steps` / the file name. verl's
stock dump has text only (no logprobs): that is refused with a message saying what to add.

Contract: `read_dump(path, fmt, strict)` returns a `Dump`; a missing required column, an unreadable
file or a dump with no usable row raises `LpfError`. A bad row (length mismatch between tokens and
logprobs, NaN/inf or positive logprobs, no step, no scored token, a duplicate id, malformed JSON) is
listed in `Dump.bad_rows` as {"row": 1-based row (JSONL: line), "reason"} and skipped, or raises
`LpfError` naming the row when `strict`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lpf.errors import LpfError

LPF_REQUIRED = ("step", "response_token_ids", "rollout_logprobs", "trainer_logprobs")
VERL_REQUIRED = ("responses", "rollout_log_probs", "old_log_probs")
LIST_COLUMNS = ("response_token_ids", "rollout_logprobs", "trainer_logprobs", "loss_mask", "prompt_token_ids")
_LOGPROB_SLACK = 1e-4  # a logprob may round a hair above 0; anything more is not a logprob


@dataclass
class Dump:
    """Validated responses. `responses` has one row per usable response: row, step, request_id,
    prompt_id, rollout, n_tokens and metadata columns; `tok_*` arrays are flat over scored tokens in
    response order (`tok_resp` indexes `responses`, `tok_pos` is the position in the response)."""

    source: str
    fmt: str
    responses: pa.Table
    tok_resp: np.ndarray
    tok_pos: np.ndarray
    tok_rollout: np.ndarray
    tok_trainer: np.ndarray
    bad_rows: list[dict] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)


# -- reading raw rows ------------------------------------------------------------------------------
def _files(path: Path) -> list[Path]:
    if path.is_dir():
        # `lpf rl simulate` ground truth (<stem>.faults.parquet) is never analysis input
        files = sorted((p for p in path.iterdir() if p.suffix in (".jsonl", ".parquet")
                        and not p.name.endswith(".faults.parquet")), key=_natural)
        if not files:
            raise LpfError(f"{path}: no .jsonl or .parquet files in this directory")
        return files
    if not path.is_file():
        raise LpfError(f"dump {str(path)!r} does not exist")
    return [path]


def _natural(p: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _read_rows(files: list[Path]) -> tuple[list[tuple[int, dict | None, str | None, Path]], dict]:
    """(row number, record or None, why it is unreadable, file) for every row; Parquet key metadata."""
    rows, meta, n = [], {}, 0
    for f in files:
        if f.suffix == ".parquet":
            try:
                table = pq.read_table(f)
            except Exception as e:  # pyarrow raises many types for a damaged file
                raise LpfError(f"{f}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
            if table.schema.metadata and b"lpf" in table.schema.metadata:
                meta = json.loads(table.schema.metadata[b"lpf"])
            for rec in table.to_pylist():
                n += 1
                rows.append((n, rec, None, f))
            continue
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                n += 1
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    rows.append((n, None, f"not valid JSON ({e.msg})", f))
                    continue
                if not isinstance(rec, dict):
                    rows.append((n, None, f"not a JSON object ({type(rec).__name__})", f))
                    continue
                rows.append((n, rec, None, f))
    return rows, meta


def detect_format(keys: set[str]) -> str:
    if set(LPF_REQUIRED) <= keys or {"response_token_ids", "rollout_logprobs"} <= keys:
        return "lpf"
    if set(VERL_REQUIRED) & keys:
        return "verl"
    if {"input", "output"} <= keys:
        raise LpfError("this looks like verl's text-only rollout_data_dir dump (input/output/score/step): it has "
                       "no logprobs; add the per-sample DataProto fields responses, response_mask, "
                       "rollout_log_probs (rollout.calculate_log_probs=True) and old_log_probs to the dumped "
                       "extra infos (see README, RL dumps)")
    missing = [c for c in LPF_REQUIRED if c not in keys]
    raise LpfError(f"dump is missing required column(s) {', '.join(missing)} (lpf layout: step, request_id or "
                   f"prompt_id + rollout, response_token_ids, rollout_logprobs, trainer_logprobs; or verl's "
                   f"responses, response_mask, rollout_log_probs, old_log_probs)")


# -- verl -> lpf --------------------------------------------------------------------------------------
def convert_verl(rec: dict, file: Path) -> dict:
    """One verl sample -> one lpf record (unpadded, masked). Raises ValueError on a bad sample."""
    for k in VERL_REQUIRED:
        if rec.get(k) is None:
            raise ValueError(f"missing {k}")
    ids, rlp, olp = rec["responses"], rec["rollout_log_probs"], rec["old_log_probs"]
    if not all(isinstance(v, list) for v in (ids, rlp, olp)):
        raise ValueError("responses / rollout_log_probs / old_log_probs must be lists")
    width = len(ids)
    if "response_mask" in rec and rec["response_mask"] is not None:
        mask = rec["response_mask"]
    elif "attention_mask" in rec and rec["attention_mask"] is not None:
        mask = rec["attention_mask"][-width:] if width else []  # verl: prompt part first, response part last
    else:
        raise ValueError("missing response_mask (or attention_mask)")
    if not isinstance(mask, list):
        raise ValueError("response_mask must be a list")
    if not len(mask) == len(rlp) == len(olp) == width:
        raise ValueError(f"length mismatch: responses {width}, response_mask {len(mask)}, "
                         f"rollout_log_probs {len(rlp)}, old_log_probs {len(olp)}")
    on = [i for i, m in enumerate(mask) if m]
    end = on[-1] + 1 if on else 0  # strip right padding; inner zeros (tool output) stay masked
    step = rec.get("step", rec.get("global_steps"))
    if step is None and file.stem.isdigit():  # rollout_data_dir names its files <global_steps>.jsonl
        step = int(file.stem)
    out = {k: v for k, v in rec.items() if k not in ("responses", "response_mask", "attention_mask",
                                                     "rollout_log_probs", "old_log_probs", "input", "output",
                                                     "prompts", "input_ids", "position_ids", "global_steps")}
    out.update(step=step, response_token_ids=ids[:end], rollout_logprobs=rlp[:end], trainer_logprobs=olp[:end],
               loss_mask=[1 if m else 0 for m in mask[:end]])
    if "uid" in rec and "prompt_id" not in rec:
        out["prompt_id"] = str(rec["uid"])
    return out


# -- validation ---------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check(rec: dict) -> tuple[dict | None, str | None]:
    """(clean record, None) or (None, reason)."""
    step = rec.get("step")
    if step is None or (isinstance(step, float) and (not math.isfinite(step) or step != int(step))):
        return None, "missing or invalid step"
    if isinstance(step, float):
        step = int(step)
    if not _is_int(step):
        return None, f"step must be an integer, got {step!r}"
    ids, rlp, tlp = rec.get("response_token_ids"), rec.get("rollout_logprobs"), rec.get("trainer_logprobs")
    for name, v in (("response_token_ids", ids), ("rollout_logprobs", rlp), ("trainer_logprobs", tlp)):
        if v is None:
            return None, f"missing {name}"
        if not isinstance(v, (list, tuple, np.ndarray)):
            return None, f"{name} must be a list"
    if not all(_is_int(t) and t >= 0 for t in ids):
        return None, "response_token_ids must be non-negative integers"
    if not len(ids) == len(rlp) == len(tlp):
        return None, (f"length mismatch: {len(ids)} response tokens, {len(rlp)} rollout logprobs, "
                      f"{len(tlp)} trainer logprobs")
    mask = rec.get("loss_mask")
    if mask is not None and not isinstance(mask, (list, tuple, np.ndarray)):
        return None, "loss_mask must be a list"
    if mask is not None and len(mask) != len(ids):
        return None, f"length mismatch: {len(ids)} response tokens, loss_mask of {len(mask)}"
    try:
        r = np.asarray(rlp, dtype=np.float64)
        t = np.asarray(tlp, dtype=np.float64)
    except (TypeError, ValueError):
        return None, "logprobs must be numbers"
    keep = np.ones(len(ids), dtype=bool) if mask is None else np.asarray([bool(m) for m in mask])
    for name, a in (("rollout_logprobs", r), ("trainer_logprobs", t)):
        bad = np.flatnonzero(keep & ~np.isfinite(a))
        if bad.size:
            return None, f"{name}[{bad[0]}] is {a[bad[0]]} (NaN/inf)"
        bad = np.flatnonzero(keep & (a > _LOGPROB_SLACK))
        if bad.size:
            return None, f"{name}[{bad[0]}] = {a[bad[0]]:.4g} is positive: not a logprob"
    if not keep.any():
        return None, "no scored tokens (empty response or loss_mask all 0)"
    rid = rec.get("request_id")
    if rid is None:
        if rec.get("prompt_id") is None or rec.get("rollout") is None:
            return None, "needs request_id, or prompt_id and rollout"
        rid = f"{rec['prompt_id']}-r{rec['rollout']}"
    pos = np.flatnonzero(keep)
    return {"step": int(step), "request_id": str(rid), "positions": pos, "rollout": r[pos], "trainer": t[pos],
            "n_tokens": len(ids)}, None


_RESERVED = set(LIST_COLUMNS) | {"step", "request_id", "uid"}


def read_dump(path: str | Path, fmt: str = "auto", strict: bool = False) -> Dump:
    path = Path(path)
    files = _files(path)
    raw, meta = _read_rows(files)
    keys = set().union(*(r.keys() for _, r, _, _ in raw if r is not None)) if raw else set()
    if not keys:
        raise LpfError(f"{path}: the dump has no rows")
    fmt = detect_format(keys) if fmt == "auto" else fmt
    if fmt == "lpf":
        missing = [c for c in LPF_REQUIRED if c not in keys]
        if missing:
            raise LpfError(f"{path}: missing required column(s) {', '.join(missing)}")
    elif fmt == "verl":
        missing = [c for c in VERL_REQUIRED if c not in keys]
        if missing:
            raise LpfError(f"{path}: verl dump is missing {', '.join(missing)}")
    else:
        raise LpfError(f"unknown dump format {fmt!r} (auto, lpf, verl)")

    bad, good, seen = [], [], set()
    scalar_cols: dict[str, list] = {}

    def reject(row: int, reason: str) -> None:
        if strict:
            raise LpfError(f"{path}: row {row}: {reason}")
        bad.append({"row": row, "reason": reason})

    for row, rec, why, f in raw:
        if rec is None:
            reject(row, why)
            continue
        if fmt == "verl":
            try:
                rec = convert_verl(rec, f)
            except ValueError as e:
                reject(row, str(e))
                continue
        clean, why = _check(rec)
        if clean is None:
            reject(row, why)
            continue
        key = (clean["step"], clean["request_id"])
        if key in seen:
            reject(row, f"duplicate request_id {clean['request_id']!r} in step {clean['step']}")
            continue
        seen.add(key)
        clean["row"] = row
        clean["meta"] = {k: v for k, v in rec.items() if k not in _RESERVED and _scalar(v)}
        good.append(clean)
    if not good:
        raise LpfError(f"{path}: no usable rows ({len(bad)} bad; first: row {bad[0]['row']}: {bad[0]['reason']})"
                       if bad else f"{path}: no usable rows")
    for g in good:
        for k in g["meta"]:
            scalar_cols.setdefault(k, [])
    cols = {"row": [g["row"] for g in good], "step": [g["step"] for g in good],
            "request_id": [g["request_id"] for g in good], "n_tokens": [g["n_tokens"] for g in good],
            "n_scored": [len(g["positions"]) for g in good]}
    for k in scalar_cols:
        cols[k] = [g["meta"].get(k) for g in good]
    responses = pa.table({k: _column(v) for k, v in cols.items()})
    lens = np.array([len(g["positions"]) for g in good])
    return Dump(source=str(path), fmt=fmt, responses=responses,
                tok_resp=np.repeat(np.arange(len(good)), lens),
                tok_pos=np.concatenate([g["positions"] for g in good]).astype(np.int64),
                tok_rollout=np.concatenate([g["rollout"] for g in good]),
                tok_trainer=np.concatenate([g["trainer"] for g in good]),
                bad_rows=bad, metadata=meta)


def _scalar(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, np.integer, np.floating))


def _column(values: list) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types across rows: keep them as text
        return pa.array([None if v is None else str(v) for v in values])
