"""The in-memory RL dump every reader produces, and the one validation every response goes through.

Readers (`lpf.rl.formats`) turn what a framework wrote into `RawRow`s, each carrying one response in
the lpf record form:

  step                 int        training step, in the framework's own numbering (required)
  request_id           str        unique within a step, named the framework's way (or prompt_id + rollout)
  response_token_ids   list<int>  the sampled response tokens (required)
  rollout_logprobs     list<float> logprob of each token under the inference engine (required)
  trainer_logprobs     list<float> logprob of the same token under the trainer's forward (required)
  loss_mask            list<int>  optional, 1 = position counts (multi-turn dumps mask tool output)
  prompt_token_ids     list<int>  optional: the context before the response (what `lpf rl rescore` needs)
  group                any        optional: responses averaged as one unit by slime's per-sample mean
                                  (slime's rollout id); default: each response is its own unit
  trainer_logprobs_lag{K} list<float> optional (K = 1..8): the trainer's logprob of the same tokens
                                  with the weights of K steps before (what `lpf.rl.causes` tests stale
                                  weights with; the reference at those checkpoints serves as well)
  any other scalar (int, float, bool, str) is kept as metadata for hypotheses.

`build_dump(source, fmt, rows, strict)` validates them into a `Dump`. A row whose record is unusable
(length mismatch between tokens and logprobs, NaN/inf or positive logprobs, no step, no scored token,
a duplicate id, unreadable input) is listed in `Dump.bad_rows` as {"row", "reason"} (+ "file" when
the dump has several files) and skipped, or raises `LpfError` naming the row when `strict`. A row the
framework itself leaves out of training (NeMo-RL's sample_loss_mask 0, slime's removed samples) is
listed in `Dump.skipped_rows` and never an error. No usable row at all is an `LpfError`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import pyarrow as pa

from lpf.core.errors import LpfError

_LOGPROB_SLACK = 1e-4  # a logprob may round a hair above 0; anything more is not a logprob
# record keys that are data or bookkeeping, never hypothesis metadata
RESERVED = {
    "step",
    "request_id",
    "response_token_ids",
    "rollout_logprobs",
    "trainer_logprobs",
    "loss_mask",
    "prompt_token_ids",
    "group",
    "uid",
}
LAG_KEY = re.compile(r"^trainer_logprobs_lag([1-8])$")


@dataclass
class RawRow:
    """One response as a reader saw it: `loc` says where ({"row"} + "file"), then either a record,
    a `problem` (a bad row) or `skipped` (the framework's own exclusion)."""

    loc: dict
    record: dict | None = None
    problem: str | None = None
    skipped: str | None = None


@dataclass
class Dump:
    """Validated responses. `responses` has one row per usable response: row, step, request_id,
    n_tokens, n_scored and metadata columns; `sequences` (same rows) holds prompt_token_ids (null when
    the dump has none) and response_token_ids; `tok_*` arrays are flat over scored tokens in response
    order (`tok_resp` indexes `responses`, `tok_pos` is the position in the response); `resp_group`
    numbers the averaging units of slime's per-sample mean; `tok_trainer_lag[K]` holds the trainer's
    logprobs at the weights of K steps before when the dump carries them (NaN where a row had none).
    `tok_reference` (and `tok_sensitivity`, `tok_log_kept`, `tok_top_cum`, the lagged `tok_reference_lag[K]` /
    `tok_log_kept_lag[K]`) are filled by `lpf.rl.reference_scores.attach` when a third opinion exists."""

    source: str
    fmt: str
    responses: pa.Table
    sequences: pa.Table
    tok_resp: np.ndarray
    tok_pos: np.ndarray
    tok_rollout: np.ndarray
    tok_trainer: np.ndarray
    resp_group: np.ndarray
    bad_rows: list[dict] = field(default_factory=list)
    skipped_rows: list[dict] = field(default_factory=list)
    ignored_files: list[str] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    tok_reference: np.ndarray | None = None
    reference: dict | None = None
    tok_trainer_lag: dict = field(default_factory=dict)
    tok_sensitivity: np.ndarray | None = None
    tok_log_kept: np.ndarray | None = None
    tok_top_cum: np.ndarray | None = None  # [tokens, TOP_CUM] the reference's cumulative top probabilities
    tok_kept_grid: tuple | None = None  # (top-p values, [tokens, len] log kept mass at each)
    tok_reference_lag: dict = field(default_factory=dict)
    tok_log_kept_lag: dict = field(default_factory=dict)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_list(v) -> bool:
    return isinstance(v, (list, tuple, np.ndarray))


def check(rec: dict) -> tuple[dict | None, str | None]:
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
        if not _is_list(v):
            return None, f"{name} must be a list"
    if not all(_is_int(t) and t >= 0 for t in ids):
        return None, "response_token_ids must be non-negative integers"
    if not len(ids) == len(rlp) == len(tlp):
        return None, (
            f"length mismatch: {len(ids)} response tokens, {len(rlp)} rollout logprobs, {len(tlp)} trainer logprobs"
        )
    mask = rec.get("loss_mask")
    if mask is not None and not _is_list(mask):
        return None, "loss_mask must be a list"
    if mask is not None and len(mask) != len(ids):
        return None, f"length mismatch: {len(ids)} response tokens, loss_mask of {len(mask)}"
    prompt = rec.get("prompt_token_ids")
    if prompt is not None and not (_is_list(prompt) and all(_is_int(t) and t >= 0 for t in prompt)):
        return None, "prompt_token_ids must be a list of non-negative integers"
    keep = np.ones(len(ids), dtype=bool) if mask is None else np.asarray([bool(m) for m in mask], dtype=bool)
    try:
        # None (how some writers store NaN/inf in JSON) only matters where the position is scored
        r = np.asarray([np.nan if v is None else v for v in rlp], dtype=np.float64)
        t = np.asarray([np.nan if v is None else v for v in tlp], dtype=np.float64)
    except (TypeError, ValueError):
        return None, "logprobs must be numbers"
    for name, a in (("rollout_logprobs", r), ("trainer_logprobs", t)):
        bad = np.flatnonzero(keep & ~np.isfinite(a))
        if bad.size:
            return None, f"{name}[{bad[0]}] is {a[bad[0]]} (NaN/inf, or null in JSON)"
        bad = np.flatnonzero(keep & (a > _LOGPROB_SLACK))
        if bad.size:
            return None, f"{name}[{bad[0]}] = {a[bad[0]]:.4g} is positive: not a logprob"
    if not keep.any():
        return None, "no scored tokens (empty response or loss_mask all 0)"
    lags = {}
    for key, v in rec.items():
        m = LAG_KEY.match(key)
        if m is None or v is None:
            continue
        if not _is_list(v) or len(v) != len(ids):
            return None, f"{key} must be a list of {len(ids)} logprobs"
        try:
            a = np.asarray([np.nan if x is None else x for x in v], dtype=np.float64)
        except (TypeError, ValueError):
            return None, f"{key}: logprobs must be numbers"
        bad = np.flatnonzero(keep & ((a > _LOGPROB_SLACK) | np.isinf(a)))
        if bad.size:
            return None, f"{key}[{bad[0]}] = {a[bad[0]]:.4g} is not a logprob"
        lags[int(m.group(1))] = a
    rid = rec.get("request_id")
    if rid is None:
        if rec.get("prompt_id") is None or rec.get("rollout") is None:
            return None, "needs request_id, or prompt_id and rollout"
        rid = f"{rec['prompt_id']}-r{rec['rollout']}"
    pos = np.flatnonzero(keep)
    return {
        "step": int(step),
        "request_id": str(rid),
        "positions": pos,
        "rollout": r[pos],
        "trainer": t[pos],
        "n_tokens": len(ids),
        "ids": [int(x) for x in ids],
        "lags": {k: a[pos] for k, a in lags.items()},
        "prompt": None if prompt is None else [int(x) for x in prompt],
    }, None


def build_dump(
    source: str,
    fmt: str,
    rows: Iterable[RawRow],
    strict: bool = False,
    metadata: dict | None = None,
    ignored_files: list[str] | None = None,
) -> Dump:
    bad, skipped, good, seen = [], [], [], set()

    def where(loc: dict) -> str:
        return (f"{loc['file']}: " if "file" in loc else "") + f"row {loc['row']}"

    for raw in rows:
        if raw.skipped is not None:
            skipped.append({**raw.loc, "reason": raw.skipped})
            continue
        clean, why = (None, raw.problem) if raw.record is None else check(raw.record)
        if clean is not None:
            key = (clean["step"], clean["request_id"])
            if key in seen:
                clean, why = None, f"duplicate request_id {clean['request_id']!r} in step {clean['step']}"
            seen.add(key)
        if clean is None:
            if strict:
                raise LpfError(f"{source}: {where(raw.loc)}: {why}")
            bad.append({**raw.loc, "reason": why})
            continue
        rec = raw.record
        clean["row"] = raw.loc["row"]
        clean["group"] = rec.get("group")
        clean["meta"] = {k: v for k, v in rec.items() if k not in RESERVED and not LAG_KEY.match(k) and _scalar(v)}
        good.append(clean)
    if not good:
        first = f"; first: {where(bad[0])}: {bad[0]['reason']}" if bad else ""
        extra = f", {len(skipped)} left out by the framework" if skipped else ""
        raise LpfError(f"{source}: no usable rows ({len(bad)} bad{extra}{first})")
    meta_cols: dict[str, None] = {}
    for g in good:
        meta_cols.update(dict.fromkeys(g["meta"]))
    cols = {
        "row": [g["row"] for g in good],
        "step": [g["step"] for g in good],
        "request_id": [g["request_id"] for g in good],
        "n_tokens": [g["n_tokens"] for g in good],
        "n_scored": [len(g["positions"]) for g in good],
    }
    for k in meta_cols:
        cols[k] = [g["meta"].get(k) for g in good]
    responses = pa.table({k: _column(v) for k, v in cols.items()})
    sequences = pa.table(
        {
            "prompt_token_ids": pa.array([g["prompt"] for g in good], pa.list_(pa.int64())),
            "response_token_ids": pa.array([g["ids"] for g in good], pa.list_(pa.int64())),
        }
    )
    lens = np.array([len(g["positions"]) for g in good])
    return Dump(
        source=source,
        fmt=fmt,
        responses=responses,
        sequences=sequences,
        tok_resp=np.repeat(np.arange(len(good)), lens),
        tok_pos=np.concatenate([g["positions"] for g in good]).astype(np.int64),
        tok_rollout=np.concatenate([g["rollout"] for g in good]),
        tok_trainer=np.concatenate([g["trainer"] for g in good]),
        resp_group=_groups(good),
        bad_rows=bad,
        skipped_rows=skipped,
        ignored_files=list(ignored_files or []),
        metadata=metadata or {},
        tok_trainer_lag=_lags(good),
    )


def _lags(good: list[dict]) -> dict[int, np.ndarray]:
    """{K: the trainer's lag-K logprobs over all scored tokens, NaN for rows without them}."""
    ks = sorted({k for g in good for k in g["lags"]})
    return {k: np.concatenate([g["lags"].get(k, np.full(len(g["positions"]), np.nan)) for g in good]) for k in ks}


def _groups(good: list[dict]) -> np.ndarray:
    """Averaging units: responses that share (step, group) are one unit; no group = its own unit."""
    codes, out = {}, np.empty(len(good), dtype=np.int64)
    for i, g in enumerate(good):
        key = (g["step"], "g", str(g["group"])) if g["group"] is not None else (g["step"], "r", i)
        out[i] = codes.setdefault(key, len(codes))
    return out


def _scalar(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, np.integer, np.floating))


def _column(values: list) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types across rows: keep them as text
        return pa.array([None if v is None else str(v) for v in values])
