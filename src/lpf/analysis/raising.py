"""Raising requests to `divergent` on evidence a step found at a position.

Contract (pure): `raise_divergent(summary, found, column) -> summary`: every request of `found`
(request_id -> (position, why)) at least `divergent` (a worse verdict stays), its `first_divergence` moved to
`position` when earlier (or set when it had none), and a string column `column` holding `why` (null for the
others). The steps that judge a request by evidence beyond its per-token thresholds (an answer that
contradicts itself, a sure token moved too far, a speculative decision against the odds) all raise this way.
"""

from __future__ import annotations

import pyarrow as pa


def raise_divergent(summary: pa.Table, found: dict, column: str) -> pa.Table:
    ids = summary.column("request_id").to_pylist()
    verdict = summary.column("verdict").to_pylist()
    first = summary.column("first_divergence").to_pylist()
    why: list[str | None] = [None] * len(ids)
    for i, rid in enumerate(ids):
        hit = found.get(rid)
        if hit is None:
            continue
        pos, why[i] = hit[0], hit[-1]
        if verdict[i] in ("clean", "noise"):
            verdict[i] = "divergent"
        if first[i] is None or pos < first[i]:
            first[i] = pos
    out = summary.set_column(
        summary.column_names.index("verdict"), "verdict", pa.array(verdict, summary.schema.field("verdict").type)
    )
    out = out.set_column(
        out.column_names.index("first_divergence"),
        "first_divergence",
        pa.array(first, summary.schema.field("first_divergence").type),
    )
    return out.append_column(column, pa.array(why, pa.string()))


def merge_first(a: dict, b: dict) -> dict:
    """Two chunks' findings (request_id -> (position, ...)): the earlier position per request."""
    out = dict(a)
    for rid, hit in b.items():
        if rid not in out or hit[0] < out[rid][0]:
            out[rid] = hit
    return out
