"""Reading a run's parts for the report.

`scan(paths, columns, wanted, keep=None)` reads some columns of every part in one multi-file scan
(several times faster than part by part on runs of thousands of parts), keeping only the rows of the
`keep` request ids when given (memory bounded by the sample, not the run), and notes which part files
hold any of a few `wanted` request ids; `rows_of(files, columns, ids)` then reads those requests' full rows
from those files alone. So the drill-down's cost follows the handful of parts that hold the worst
requests, not the size of the run.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds


def scan(
    paths: list[Path], columns: list[str], wanted: pa.Array, keep: pa.Array | None = None
) -> tuple[pa.Table | None, list[str]]:
    """(the columns that exist, as one table; the files holding a wanted id). (None, []) for no parts."""
    if not paths:
        return None, []
    dset = ds.dataset([str(p) for p in paths], format="parquet")
    cols = [c for c in columns if c in dset.schema.names]
    if "request_id" not in dset.schema.names:
        return dset.to_table(columns=cols), []
    extra = [] if "request_id" in cols else ["request_id"]
    batches, files = [], set()
    for tagged in dset.scanner(columns=cols + extra).scan_batches():
        rb = tagged.record_batch
        if len(wanted) and rb.num_rows and pc.any(pc.is_in(rb.column("request_id"), value_set=wanted)).as_py():
            files.add(tagged.fragment.path)
        if keep is not None:
            rb = rb.filter(pc.is_in(rb.column("request_id"), value_set=keep))
        batches.append(rb.select(cols) if extra else rb)
    schema = pa.schema([dset.schema.field(c) for c in cols])
    return pa.Table.from_batches(batches, schema=schema), sorted(files)


def rows_of(files: list[str], columns: list[str], ids: list[str]) -> pa.Table | None:
    """Every row of the given requests found in `files` (None when there are none)."""
    if not files or not ids:
        return None
    dset = ds.dataset(files, format="parquet")
    cols = [c for c in columns if c in dset.schema.names]
    return dset.to_table(columns=cols, filter=ds.field("request_id").isin(ids))
