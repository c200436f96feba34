"""Per-request features from the trace's write log (`schema.WRITE_LOG`: `stray_writes`).

Contract: `write_features(requests, trace) -> list[Feature]`, aligned to `requests` sorted by `seq`
like `features.request_features`; empty when the trace has no `stray_writes` column or it is all null
(an engine that keeps no write log). Pure. Each entry of a row's `stray_writes` is one state write of
that row's request, at that step, that landed outside its own slot: the slot hit, the element range,
and the request holding that slot then (`owner`, null for a free slot).
  state_overwritten    another request's stray write landed in the slot it held (a victim of a
                       cross-request write); `writer` names the first such writer per request
  state_write_strayed  its own state write landed outside its slot (its slot kept a state it never
                       wrote: what it reads back later is not its own)
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.feature import Feature
from lpf.analysis.verdicts import by_arrival


def write_features(requests: pa.Table, trace: pa.Table | None) -> list[Feature]:
    if trace is None or "stray_writes" not in trace.column_names:
        return []
    col = trace.column("stray_writes")
    if col.null_count == len(col):
        return []
    req = by_arrival(requests)
    ids = req.column("request_id").to_pylist()
    index = {rid: i for i, rid in enumerate(ids)}
    n = len(ids)
    strayed = np.zeros(n, dtype=bool)
    overwritten = np.zeros(n, dtype=bool)
    writer = np.full(n, None, dtype=object)
    # only rows that wrote something: the rest of the trace is never turned into Python objects
    rows = trace.filter(pc.fill_null(pc.greater(pc.list_value_length(col), 0), False)).sort_by("step")
    for rid, entries in zip(rows.column("request_id").to_pylist(), rows.column("stray_writes").to_pylist()):
        if rid in index:
            strayed[index[rid]] = True
        for e in entries:
            owner = e["owner"]
            if owner is None or owner == rid or owner not in index:
                continue
            i = index[owner]
            if not overwritten[i]:  # rows in step order: the first writer
                overwritten[i], writer[i] = True, rid
    return [
        Feature(
            "state_overwritten",
            "bool",
            overwritten,
            "had their state overwritten by another request's write (the trace's write log)",
            writer=writer,
        ),
        Feature(
            "state_write_strayed",
            "bool",
            strayed,
            "wrote their state outside their own slot (the trace's write log), so their slot never held it",
        ),
    ]
