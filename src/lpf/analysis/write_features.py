"""Per-request features from the trace's write log (`schema.WRITE_LOG`: `stray_writes`).

Contract: `write_features(requests, trace) -> list[Feature]`, aligned to `requests` sorted by `seq`
like `features.request_features`; empty when the trace has no `stray_writes` column or it is all null
(an engine that keeps no write log). Pure. Each entry of a row's `stray_writes` is one write of that
row's request, at that step, into memory it does not hold alone: a state write outside its own slot
(`memory` "state") or a K/V write into a block another request holds too ("kv"), with the slot or block
hit, the range, and the request holding it then (`owner`, null for a free slot).
  state_overwritten    another request's stray state write landed in the slot it held (a victim of a
                       cross-request write); `writer` names the first such writer per request
  kv_overwritten       another request wrote K/V into a KV block it held (a block handed to two live
                       requests); `writer` as above
  state_write_strayed  its own state write landed outside its slot (its slot kept a state it never
                       wrote: what it reads back later is not its own)
Each feature is left out when it holds for no request (a write log with no K/V entries says nothing
about K/V).
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
    hit = {"state": np.zeros(n, dtype=bool), "kv": np.zeros(n, dtype=bool)}
    writer = {"state": np.full(n, None, dtype=object), "kv": np.full(n, None, dtype=object)}
    # only rows that wrote something: the rest of the trace is never turned into Python objects
    rows = trace.filter(pc.fill_null(pc.greater(pc.list_value_length(col), 0), False)).sort_by("step")
    for rid, entries in zip(rows.column("request_id").to_pylist(), rows.column("stray_writes").to_pylist()):
        for e in entries:
            memory = "kv" if e.get("memory") == "kv" else "state"
            if memory == "state" and rid in index:
                strayed[index[rid]] = True
            owner = e["owner"]
            if owner is None or owner == rid or owner not in index:
                continue
            i = index[owner]
            if not hit[memory][i]:  # rows in step order: the first writer
                hit[memory][i], writer[memory][i] = True, rid
    feats = [
        Feature(
            "state_overwritten",
            "bool",
            hit["state"],
            "had their state overwritten by another request's write (the trace's write log)",
            writer=writer["state"],
        ),
        Feature(
            "kv_overwritten",
            "bool",
            hit["kv"],
            "had K/V in a block they held overwritten by another request holding it too (the trace's write log)",
            writer=writer["kv"],
        ),
        Feature(
            "state_write_strayed",
            "bool",
            strayed,
            "wrote their state outside their own slot (the trace's write log), so their slot never held it",
        ),
    ]
    return [f for f in feats if f.values.any()]
