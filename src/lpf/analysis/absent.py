"""Tokens the engine returned without a logprob, judged from the token alone.

Why: llama-server sends no probabilities for a token that ends inside a UTF-8 character
(tools/server/server-context.cpp, `process_token`), so an honest run writing non-ASCII text through a
byte-level tokenizer has a few tokens with no logprob (null in `tokens.engine_logprob`) among many
with one. Such a token is no logprob error: nothing was computed wrong, nothing was reported. It is
judged as the tokens-only path (`lpf.analysis.tokens_only`) judges every token: a greedy token that is
not the reference's argmax past the tie margin is a flip, and its lie strength is what the reference
alone shows. A NaN logprob *value* is another thing (an engine that computed NaN) and stays an engine
error, never clean: the two are told apart by the Arrow column's validity, never by the float (numpy
turns a null into NaN).

Contract (pure: Arrow columns and numpy arrays in, numpy arrays out):
- `mask(col) -> bool array | None`: which rows of an engine_logprob column (Arrow, or numpy rows of
  one: `rows`) are null; None when none is (callers then skip every step below).
- `margin(ref, top1_logprob, token, top1_id)`: how much the reference prefers its argmax to the
  token (0 where the token is its argmax).
- `judge(ref, top1_logprob, token, top1_id, greedy, th, temperature) -> (margin, flip, strength)`:
  the tokens-only rule per token. Greedy: a flip where the margin passes the tie margin, strength the
  margin over gibberish_log_ratio clipped to 1, and 1 where the token is also improbable to the
  reference. Sampled (no seeded replay): no flip; strength 1 where the reference finds the token
  improbable while it was confident of its own top-1, at temperature <= 1 only.
- `stand_in(eng, ref, margin, no_lp)`: the engine logprob the per-request rule reads for such a
  token where it needs one (whether both sides are settled; a lone overwhelming lie): ref + margin,
  as the tokens-only path sets it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lpf.analysis.thresholds import Thresholds


def mask(col, rows=None) -> np.ndarray | None:
    if col is None or col.null_count == 0:
        return None
    if isinstance(col, pa.ChunkedArray):
        out = np.concatenate([c.is_null().to_numpy(zero_copy_only=False) for c in col.chunks]) if col.chunks else None
    else:
        out = col.is_null().to_numpy(zero_copy_only=False)
    if out is None:
        return None
    if rows is not None:
        out = out[rows]
    return out if out.any() else None


def margin(ref: np.ndarray, top1_logprob: np.ndarray, token: np.ndarray, top1_id: np.ndarray) -> np.ndarray:
    return np.where(token != top1_id, np.maximum(top1_logprob - ref, 0.0), 0.0)


def judge(ref, top1_logprob, token, top1_id, greedy, th: Thresholds, temperature=0.0):
    gap = margin(ref, top1_logprob, token, top1_id)
    # the reference's own argmax (within the tie margin) is never a lie, however flat its distribution
    chosen_elsewhere = gap > th.tie_margin
    improbable = (ref <= th.improbable_logprob) & chosen_elsewhere
    if np.ndim(greedy):  # each row's own (`request_sampling`): the two rules below, row by row
        g = np.asarray(greedy, dtype=bool)
        flip = chosen_elsewhere & g
        by_greedy = np.where(chosen_elsewhere, np.clip(gap / th.gibberish_log_ratio, 0.0, 1.0), 0.0)
        by_greedy[improbable] = 1.0
        confident = top1_logprob >= th.confident_logprob
        with np.errstate(invalid="ignore"):  # an unknown temperature (NaN) is not <= 1: no lie from a draw
            sampled = np.where(improbable & confident & (np.asarray(temperature) <= 1.0), 1.0, 0.0)
        return gap, flip, np.where(g, by_greedy, sampled)
    if greedy:
        flip = chosen_elsewhere
        strength = np.where(chosen_elsewhere, np.clip(gap / th.gibberish_log_ratio, 0.0, 1.0), 0.0)
        strength[improbable] = 1.0
    else:
        flip = np.zeros(len(ref), dtype=bool)
        confident = top1_logprob >= th.confident_logprob
        strength = np.where(improbable & confident & (temperature <= 1.0), 1.0, 0.0)
    return gap, flip, strength


def stand_in(eng: np.ndarray, ref: np.ndarray, gap: np.ndarray, no_lp: np.ndarray) -> np.ndarray:
    return np.where(no_lp, ref + gap, eng)
