"""The prefix cache's columns of one trace row (`lpf.run.schema.TRACE`, all nullable).

Contract: `trace_columns(prefix_cache, scheduled, read) -> dict` for one scheduled request of a step,
taken after the runner ran and before the step is committed (so provenance is the state the request
read, not what its own step wrote). With prefix caching off every column is null (the engine has
no cache to report on, as in old runs and engines without the columns). With it on:
  prefix_cache_hit_tokens  tokens the cache supplied at this (re)admission, 0 on every other row
  resume_block             Mamba block index (in Mamba block units) whose entry the state was read from
  resume_writer / resume_write_step / resume_covers_tokens
                           the last write into the slot read: by whom, at which step, covering how many
                           tokens (null: never written since the pool started)
  resume_publisher / resume_publish_step
                           who published the checkpoint the hit matched, and when
  chunk_end_aligned        this step ends on a Mamba block boundary
  aborted                  false (the engine sets true on the row of a step cancelled while in flight)
"""

from __future__ import annotations

EMPTY = {
    "prefix_cache_hit_tokens": None,
    "resume_block": None,
    "resume_writer": None,
    "resume_write_step": None,
    "resume_covers_tokens": None,
    "resume_publisher": None,
    "resume_publish_step": None,
    "chunk_end_aligned": None,
    "aborted": None,
}


def trace_columns(px, s, read: tuple[int, int | None] | None) -> dict:
    if px is None:
        return dict(EMPTY)
    end = s.num_computed_tokens + s.num_scheduled_tokens
    row = dict(EMPTY, prefix_cache_hit_tokens=s.resume_tokens, chunk_end_aligned=end % px.mbs == 0, aborted=False)
    if s.resume_tokens and read is not None:
        index, slot = read
        w = px.provenance(slot)
        ck = px.checkpoint(dict(s.state_table).get(s.resume_tokens // px.mbs - 1))
        row.update(resume_block=index)
        if w is not None:
            row.update(resume_writer=w.request_id, resume_write_step=w.step, resume_covers_tokens=w.covers)
        if ck is not None:
            row.update(resume_publisher=ck.publisher, resume_publish_step=ck.publish_step)
    return row
