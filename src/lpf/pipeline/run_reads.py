"""What the analyze stage reads from a run besides its scoring pass: counts from the parts' footers, the
requests as the analysis reads them, the kept requests' token ids, and per-request reference sums.

Contract (each over a `RunDir`, read part by part, never the whole run at once unless said):
- `scored_token_count(run, table)`: rows of a table's parts, from their footers (routes a run to the
  streamed path); `footer_counts(run)`: `returned.counts`' rows and missing logprobs, from the footers;
  `lse_complete(run)`: whether every reference row has a log-sum-exp, from the footers;
- `light_requests(run)`: the requests with token-id lists reduced to their lengths and no output text;
  `token_ids(run, keep, lists)`: the requests' id lists, kept only for the rows at `keep`;
- `prompt_tables(run)`: a reader of the prompt positions' tables, or None; `chunk_budget(manifest)`:
  the step's token budget where prompts could be split;
- `reference_sums(run, ids)` / `own_sums(reference, ids)`: {request id: sum of its ref_logprob}.
`lpf.pipeline.analyze_stream` (the streamed analysis) and `lpf.pipeline.analyze` (the stage) use them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.columns import one_array
from lpf.pipeline import stream_memory, stream_parts
from lpf.pipeline.stream_parts import ordered_map
from lpf.run import schema
from lpf.run.store import RunDir


def scored_token_count(run: RunDir, table: str = "tokens") -> int:
    """Rows of the tokens parts (or another table's), from their footers (what chooses the streamed
    path); a part whose footer does not read is read (a damaged one says so there, in one line)."""
    import pyarrow.parquet as pq

    try:
        return sum(pq.ParquetFile(p).metadata.num_rows for p in run.parts(table))
    except (pa.ArrowException, OSError, ValueError):
        return sum(t.num_rows for t in run.iter_parts(table, ["request_id"]))


def footer_counts(run: RunDir) -> dict:
    """`returned.counts`' rows and rows without an engine logprob of the tokens parts, from their
    footers (each column chunk's null count; a part whose footer lacks one is read), without the
    top-k width (0): what routing a run needs before any part is read."""
    import pyarrow.parquet as pq

    from lpf.analysis.returned import counts
    from lpf.run.store import read_part

    out = {"rows": 0, "no_logprob": 0, "top_k": 0}
    for p in run.parts("tokens"):
        nulls = None
        try:
            meta = pq.ParquetFile(p).metadata
            at = meta.schema.names.index("engine_logprob")
            stats = [meta.row_group(i).column(at).statistics for i in range(meta.num_row_groups)]
            if all(st is not None and st.has_null_count for st in stats):
                rows, nulls = meta.num_rows, sum(st.null_count for st in stats)
        except (pa.ArrowException, OSError, ValueError):
            pass  # read below: a damaged part says so there, in one line
        if nulls is None:
            c = counts([read_part(p, "tokens", ["engine_logprob"])])
            rows, nulls = c["rows"], c["no_logprob"]
        out["rows"] += rows
        out["no_logprob"] += nulls
    return out


def lse_complete(run: RunDir) -> bool:
    """Whether every reference row has a log-sum-exp, from the parts' footers (a part whose footer
    lacks the column or its null count: not known, False): the penalty fit's sample is then known
    before the pass (`lpf.analysis.stream_gather`)."""
    import pyarrow.parquet as pq

    try:
        for p in run.parts("reference"):
            meta = pq.ParquetFile(p).metadata
            if "ref_logsumexp" not in meta.schema.names:
                return False
            at = meta.schema.names.index("ref_logsumexp")
            for i in range(meta.num_row_groups):
                st = meta.row_group(i).column(at).statistics
                if st is None or not st.has_null_count or st.null_count:
                    return False
    except (pa.ArrowException, OSError, ValueError):
        return False
    return True


def token_ids(run: RunDir, keep: np.ndarray, lists=("prompt_token_ids", "output_token_ids")) -> pa.Table:
    """The requests table's request_id, prompt_token_ids and output_token_ids, part by part, with the
    token-id lists of the rows at `keep` (a mask over its rows) and empty lists elsewhere: the same
    rows in the same order, holding only the kept requests' tokens (the penalty fit's context).
    `lists`: which of the two (the prefix cache's block reads the prompts')."""
    columns = ["request_id", *lists]
    parts, at = [], 0
    for part in run.iter_parts("requests", columns):
        mask = pa.array(keep[at : at + part.num_rows])
        at += part.num_rows
        for name in columns[1:]:
            lists = one_array(part.column(name))
            lengths = pc.if_else(mask, pc.list_value_length(lists).fill_null(0), 0).cast(pa.int32())
            offsets = pa.array(np.r_[0, np.cumsum(lengths.to_numpy(zero_copy_only=False))].astype(np.int32))
            kept = pa.ListArray.from_arrays(offsets, pc.list_flatten(lists.filter(mask)), type=lists.type)
            part = part.set_column(part.schema.get_field_index(name), name, kept)
        parts.append(part)
    return pa.concat_tables(parts) if parts else schema.REQUESTS.empty_table().select(columns)


def prompt_tables(run: RunDir):
    """A reader of the prompt positions' tables (read whole: `steps.STEPS`' prompt step), or None."""
    if not run.has("prompt_reference"):
        return None
    return lambda: (run.read("prompt_tokens"), run.read("prompt_reference"))


def chunk_budget(manifest: dict) -> int | None:
    """The step's token budget when prompts could be split (chunked prefill not switched off), for
    placing chunk boundaries when there is no trace."""
    engine = manifest.get("engine") or {}
    opts = {
        **(engine.get("engine_args") or {}),
        **{k: v for k, v in (engine.get("options") or {}).items() if v is not None},
    }
    budget = opts.get("max_num_batched_tokens")
    if opts.get("enable_chunked_prefill") is False or not isinstance(budget, int) or isinstance(budget, bool):
        return None
    return budget


def light_requests(run: RunDir) -> pa.Table:
    """The requests table, part by part, as the analysis reads it: each prompt's and output's token
    ids reduced to their count (a list of nulls, no values) and the output text dropped (null)."""
    with stream_memory.heap():
        return _light_requests(run)


def _light_requests(run: RunDir) -> pa.Table:
    from lpf.run.store import read_part

    columns = [n for n in schema.REQUESTS.names if n != "output_text"]
    text_at = schema.REQUESTS.names.index("output_text")

    def light(path):
        part = read_part(path, "requests", columns, use_threads=False)
        for name in ("prompt_token_ids", "output_token_ids"):
            lists = one_array(part.column(name))
            offsets = lists.offsets
            lengths = pa.ListArray.from_arrays(
                pc.subtract(offsets, offsets[0]), pa.nulls(len(lists.values)), mask=lists.is_null()
            )
            part = part.set_column(part.schema.get_field_index(name), pa.field(name, lengths.type), lengths)
        return part.add_column(text_at, "output_text", pa.nulls(part.num_rows, pa.string()))  # never read: the text

    # the parts decoded on both cores (each on its own thread; Arrow's pool may have one), in order
    out = list(ordered_map(light, ((p,) for p in run.parts("requests")), stream_parts.WORKERS))
    return pa.concat_tables(out) if out else schema.REQUESTS.empty_table()


def reference_sums(run: RunDir, ids: set[str]) -> dict[str, float]:
    """{request id: sum of its ref_logprob} for `ids`, part by part (the attribution's own scores)."""
    parts = [_of(p, ids) for p in run.iter_parts("reference", ["request_id", "ref_logprob"])]
    return _sums(
        pa.concat_tables(parts) if parts else schema.REFERENCE.empty_table().select(["request_id", "ref_logprob"])
    )


def own_sums(reference: pa.Table, ids: set[str]) -> dict[str, float]:
    """`reference_sums` from an in-memory reference table (the same filter, then the same sums)."""
    return _sums(_of(reference, ids))


def _of(table: pa.Table, ids: set[str]) -> pa.Table:
    return table.filter(pc.is_in(table.column("request_id"), value_set=pa.array(sorted(ids), pa.string())))


def _sums(reference: pa.Table) -> dict[str, float]:
    sums = reference.group_by("request_id").aggregate([("ref_logprob", "sum")]).to_pydict()
    return dict(zip(sums["request_id"], sums["ref_logprob_sum"]))
