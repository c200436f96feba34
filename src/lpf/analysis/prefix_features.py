"""Per-request features of the prefix cache, from the trace's prefix-cache columns (`schema.PREFIX_TRACE`).

Contract: `prefix_features(requests, trace, engine_info) -> list[Feature]`, aligned to `requests`
sorted by `seq` like `features.request_features`; empty when the trace has no prefix-cache columns or
they are all null (old runs, engines without a cache). Pure. A request's *resume rows* are its rows
with `prefix_cache_hit_tokens > 0` (the first step after a hit), which carry the provenance of the
state it restored: the Mamba block read (`resume_block`), the last write into it (`resume_writer`,
`resume_write_step`, `resume_covers_tokens`) and who published the hash it matched
(`resume_publisher`, `resume_publish_step`); an `aborted` row is a step cancelled while in flight.

Each mechanism feature holds for a request whose resume row shows it, *or that resumed from a state a
request holding it wrote* (resume_writer, followed to a fixed point): a state computed on a wrong
state is wrong too, and the trace says who computed it. Listed most specific first:
  resumed_wrong_block            read another Mamba block than the one the hit ends in (hit // mamba
                                 block size - 1; needs the engine's mamba_block_size)
  resumed_from_aborted_publisher the hash it matched was published by a request whose step was
                                 cancelled in flight at the publishing step: published before written
  resumed_in_publishing_step     it resumed in the very step another request published the hash it matched
                                 (vLLM publishes at schedule time, before that step's forward writes the
                                 state): it read the block before its state existed
  short_resumed_chunk            its resume step was a prefill chunk shorter than the conv state
                                 (< conv width - 1 tokens; needs the engine's conv_width)
  resumed_truncated_state        the state covers fewer tokens than the hit, written by its publisher
  resumed_overshot_state         the state covers more tokens than the hit, written by its publisher (a
                                 checkpoint saved past its boundary: speculative decoding's verify pass)
  resumed_overwritten_state      the last write into it came after its publication, by another request
  resumed_unwritten_state        never written, or last written before the step that published it
  prefix_cache_hit               part of its prompt came from the prefix cache
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.feature import Feature
from lpf.analysis.verdicts import by_arrival

COLUMNS = (
    "prefix_cache_hit_tokens",
    "resume_block",
    "resume_writer",
    "resume_write_step",
    "resume_covers_tokens",
    "resume_publisher",
    "resume_publish_step",
)


def has_prefix_columns(trace: pa.Table | None) -> bool:
    return (
        trace is not None
        and "prefix_cache_hit_tokens" in trace.column_names
        and trace.column("prefix_cache_hit_tokens").null_count < trace.num_rows
    )


def cache_info(engine_info: dict | None) -> dict:
    """The engine's prefix-cache facts the features use: mamba_block_size, conv_width (when known)."""
    info = engine_info or {}
    cache = info.get("cache") or {}
    pc_ = cache.get("prefix_cache") or {}
    return {"mamba_block_size": pc_.get("mamba_block_size"), "conv_width": cache.get("conv_width")}


def prefix_features(requests: pa.Table, trace: pa.Table | None, engine_info: dict | None = None) -> list[Feature]:
    if not has_prefix_columns(trace):
        return []
    req = by_arrival(requests)
    ids = req.column("request_id").to_pylist()
    index = {rid: i for i, rid in enumerate(ids)}
    rows = trace.filter(pc.invert(trace.column("preempted").fill_null(False)))
    have = set(rows.column_names)
    cols = {
        c: rows.column(c).to_pylist() if c in have else [None] * rows.num_rows
        for c in (*COLUMNS, "request_id", "step", "phase", "num_scheduled_tokens", "aborted")
    }
    aborted = {(r, s) for r, s, a in zip(cols["request_id"], cols["step"], cols["aborted"]) if a}
    info = cache_info(engine_info)
    mbs, width = info["mamba_block_size"], info["conv_width"]
    n = len(ids)
    hit = np.zeros(n, dtype=bool)
    base = {
        name: np.zeros(n, dtype=bool)
        for name in ("wrong", "aborted", "same_step", "short", "truncated", "overshot", "over", "unwritten")
    }
    writers: list[tuple[int, str]] = []  # (request row, the request whose write it resumed from)
    for k in range(rows.num_rows):
        i = index.get(cols["request_id"][k])
        h = cols["prefix_cache_hit_tokens"][k] or 0
        if i is None or h <= 0:
            continue
        hit[i] = True
        writer, wstep, covers = cols["resume_writer"][k], cols["resume_write_step"][k], cols["resume_covers_tokens"][k]
        publisher, pstep, block = cols["resume_publisher"][k], cols["resume_publish_step"][k], cols["resume_block"][k]
        if writer is not None:
            writers.append((i, writer))
        if mbs and block is not None and block != h // mbs - 1:
            base["wrong"][i] = True
        if publisher is not None and (publisher, pstep) in aborted:
            base["aborted"][i] = True
        if publisher is not None and publisher != cols["request_id"][k] and pstep == cols["step"][k]:
            base["same_step"][i] = True
        if width and cols["phase"][k] != "decode" and (cols["num_scheduled_tokens"][k] or 0) < width - 1:
            base["short"][i] = True
        if writer is not None and writer == publisher and covers is not None and covers < h:
            base["truncated"][i] = True
        # (the right block: a wrong block's state covers other tokens for another reason, resumed_wrong_block)
        if writer is not None and writer == publisher and covers is not None and covers > h and not base["wrong"][i]:
            base["overshot"][i] = True
        if writer is not None and publisher is not None and writer != publisher and (wstep or 0) > (pstep or 0):
            base["over"][i] = True
        if writer is None or (pstep is not None and wstep is not None and wstep < pstep):
            base["unwritten"][i] = True
    state = {name: _descended(v, writers, ids) for name, v in base.items()}
    feats = []
    if mbs:
        feats.append(
            Feature(
                "resumed_wrong_block",
                "bool",
                state["wrong"],
                f"restored their state from another Mamba block than the one their prefix-cache hit "
                f"ends in (a resume index in other units than the {mbs}-token Mamba block), or from "
                f"a state computed on one",
            )
        )
    feats.append(
        Feature(
            "resumed_from_aborted_publisher",
            "bool",
            state["aborted"],
            "resumed from a state published by a request that was aborted before the chunk writing "
            "it ran (or from a state computed on one)",
        )
    )
    feats.append(
        Feature(
            "resumed_in_publishing_step",
            "bool",
            state["same_step"],
            "resumed in the step another request published the hash they matched, before that step's "
            "forward wrote the state (a hash published before its state was written), or from a state "
            "computed on one",
        )
    )
    if width:
        feats.append(
            Feature(
                "short_resumed_chunk",
                "bool",
                state["short"],
                f"resumed with a prefill chunk shorter than the conv state (< {width - 1} tokens), or "
                f"from a state such a request wrote (its conv state went into the shared prefix block)",
            )
        )
    feats += [
        Feature(
            "resumed_truncated_state",
            "bool",
            state["truncated"],
            "resumed from a state covering fewer tokens than their prefix-cache hit (a state from mid-block "
            "hashed as the block's end), or from a state computed on one",
        ),
        Feature(
            "resumed_overshot_state",
            "bool",
            state["overshot"],
            "resumed from a state covering more tokens than their prefix-cache hit (saved past the boundary its "
            "hash names: a verify step's rejected drafts), or from a state computed on one",
        ),
        Feature(
            "resumed_overwritten_state",
            "bool",
            state["over"],
            "resumed from a shared state another request wrote into after it was published",
        ),
        Feature(
            "resumed_unwritten_state",
            "bool",
            state["unwritten"],
            "resumed from a state not written by the step that published it (written earlier, or never: a block "
            "cached before its state was complete), or from a state computed on one",
        ),
        Feature("prefix_cache_hit", "bool", hit, "had part of their prompt from the prefix cache"),
    ]
    return [f for f in feats if f.name == "prefix_cache_hit" or f.values.any()]


def _descended(base: np.ndarray, writers: list[tuple[int, str]], ids: list[str]) -> np.ndarray:
    """`base`, plus every request that resumed from a state written by a request already in it."""
    out = base.copy()
    marked = {ids[i] for i in np.flatnonzero(out)}
    changed = True
    while changed:
        changed = False
        for i, writer in writers:
            if not out[i] and writer in marked and writer != ids[i]:
                out[i] = True
                marked.add(ids[i])
                changed = True
    return out
