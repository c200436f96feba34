"""The two per-token judgements beyond a run's flat thresholds, as one analysis step.

- `self_contradiction`: an answer that reports a token twice with two numbers (or an impossible top-k),
  evidence whatever the floor;
- `sure_tokens`: a token the reference is sure of moved further than the expected floor's logit error can move
  it (only with an expected floor: without one there is no logit error to scale).
Both judge rows one by one, so the step runs in one piece (in memory) or chunk by chunk (streamed) with the
same result: `scan` a piece of whole or partial requests, `merge` pieces, `apply` once to the summary.

Contract (pure):
  `scan(tokens, request_ids, positions, engine_logprob, ref_logprob, expected, divergent_abs_diff) -> Found`:
      `tokens` the engine's token rows of the piece (for the top-k checks), the other arrays the piece's scored
      rows (joined with the reference). Both checks read a slice of SLICE rows at a time (d = engine - reference
      logprob of a slice, never of the whole run).
  `Found.merge(other) -> Found`; `apply(summary, found) -> (summary, blocks)`: the requests raised to at
      least `divergent` at their first such position (columns `self_contradiction`, `sure_token`, added
      only when some request has one, so runs without any keep their summary), and findings.json's blocks
      (`self_contradiction`, `sure_tokens`; absent when nothing was found).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from lpf.analysis import self_contradiction as sc
from lpf.analysis import sure_tokens as st
from lpf.analysis.raising import merge_first

SLICE = 1 << 16  # rows: a slice's columns and masks stay in the core's cache (1 << 20: twice the time)


@dataclass
class Found:
    contradictions: dict = field(default_factory=dict)
    sure: dict = field(default_factory=dict)
    tokens_checked: int = 0

    def merge(self, other: "Found") -> "Found":
        return Found(
            merge_first(self.contradictions, other.contradictions),
            merge_first(self.sure, other.sure),
            self.tokens_checked + other.tokens_checked,
        )


def scan(
    tokens: pa.Table | None,
    request_ids,
    positions: np.ndarray,
    engine_logprob: np.ndarray,
    ref_logprob: np.ndarray,
    expected: dict | None,
    divergent_abs_diff: float,
) -> Found:
    found = Found()
    if tokens is not None:  # a slice at a time: the flattened top-k lists and the row masks stay cache-sized
        for lo in range(0, tokens.num_rows, SLICE):
            found.contradictions = merge_first(found.contradictions, sc.contradictions(tokens.slice(lo, SLICE)))
    if not expected or not ((expected.get("token") or {}).get("q99")):
        return found
    for lo in range(0, len(positions), SLICE):
        hi = lo + SLICE
        with np.errstate(invalid="ignore"):
            d = np.subtract(engine_logprob[lo:hi], ref_logprob[lo:hi])
        ids_at = request_ids.slice(lo, SLICE) if hasattr(request_ids, "slice") else request_ids[lo:hi]
        part = st.first_departures(ids_at, positions[lo:hi], d, ref_logprob[lo:hi], expected, divergent_abs_diff)
        found.sure = merge_first(found.sure, part)
    found.tokens_checked = int(len(positions))
    return found


def apply(summary: pa.Table, found: Found) -> tuple[pa.Table, dict]:
    blocks = {}
    if found.contradictions:
        summary = sc.raise_contradictions(summary, found.contradictions)
        blocks["self_contradiction"] = sc.block(found.contradictions, summary.num_rows)
    if found.sure:
        summary = st.raise_sure(summary, found.sure)
        blocks["sure_tokens"] = {"requests": len(found.sure), "tokens_checked": found.tokens_checked, "rule": st.RULE}
    return summary, blocks
