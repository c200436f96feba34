"""Prefix-cache provenance from vLLM 0.32's own cache manager and runner: lpf's PREFIX trace columns.

Two halves, because vLLM's scheduler and its runner live in different processes (the CPU build's
multiprocessing executor):
- Scheduler side (`note_published`, called from the patched `MambaManager.cache_blocks`, and
  `attach`, from the patched `Scheduler.schedule`): every Mamba state block whose hash
  `cache_blocks` put into the prefix cache, as (block id, request, tokens the hash names), carried to
  the runner on the step's `SchedulerOutput` (`lpf_published`; vLLM pickles it to the workers, an
  extra attribute included). vLLM publishes at schedule time, for the tokens the step *will* compute.
- Runner side (`ProvenanceLog`, fed by `StepReader` once per step): the publications, stamped with the
  runner's step index; every state write (a Mamba row writes its final state into its state slot,
  `state_indices_tensor_*`, covering num_computed + num_scheduled tokens); and the source column
  `preprocess_mamba` really copied a resumed request's state from (`note_copy`, from the patched
  `collect_mamba_copy_meta`: vLLM's own index, not one recomputed here).
Per row it fills (meanings as lpf's `schema.PREFIX_TRACE`): prefix_cache_hit_tokens at (re)admission;
on that first step resume_block (the Mamba block column the state was copied from, in Mamba block
units), resume_writer / resume_write_step / resume_covers_tokens (the last write into that physical
block before this step's forward), resume_publisher / resume_publish_step (who published the hash of
the block the hit matched, block hit // mamba_block_size - 1); chunk_end_aligned (the step ends on a
Mamba block boundary); aborted (False: a step vLLM scheduled always runs; an abort between steps
leaves no row). Lookups read the log as it was before this step's writes: the copy runs first.
"""

from __future__ import annotations

_published: list[tuple[int, str, int]] = []  # scheduler process: since the last schedule() returned


def note_published(block_id: int, request_id: str, tokens: int) -> None:
    _published.append((int(block_id), str(request_id), int(tokens)))


def attach(scheduler_output) -> None:
    """Hand the publications made since the last step to this step's output (and so to the runner)."""
    global _published
    scheduler_output.lpf_published, _published = _published, []


class ProvenanceLog:
    def __init__(self, mamba_block_size: int):
        self.mbs = mamba_block_size
        self.writes: dict[int, tuple[str, int, int]] = {}  # block id -> (request, step, tokens covered)
        self.published: dict[int, tuple[str, int, int]] = {}  # block id -> (request, step, tokens)
        self.copies: dict[str, tuple[int, int]] = {}  # this step: request -> (src column, dst column)

    def note_copy(self, request_id: str, src: int, dst: int) -> None:
        self.copies.setdefault(request_id, (int(src), int(dst)))

    def columns(self, step: int, so, req_ids, computed, sched, slots, block_ids, hits) -> dict[str, list]:
        """The PREFIX columns for this step's rows (in `req_ids` order), then the log moves on.
        `block_ids[i]`: row i's block table in the first Mamba group; `slots[i]`: its state slot."""
        for block, rid, tokens in getattr(so, "lpf_published", None) or ():
            self.published[block] = (rid, step, tokens)
        cols = {
            name: []
            for name in (
                "prefix_cache_hit_tokens",
                "resume_block",
                "resume_writer",
                "resume_write_step",
                "resume_covers_tokens",
                "resume_publisher",
                "resume_publish_step",
                "chunk_end_aligned",
                "aborted",
            )
        }
        for i, rid in enumerate(req_ids):
            hit = hits.get(rid, 0)
            block = writer = publisher = None
            if hit > 0:
                table = block_ids[i] or []
                block = self.copies.get(rid, ((hit - 1) // self.mbs, None))[0]
                read = table[block] if 0 <= block < len(table) else None
                writer = self.writes.get(read) if read else None  # block id 0 is vLLM's null block
                matched = hit // self.mbs - 1
                publisher = self.published.get(table[matched]) if 0 <= matched < len(table) else None
            cols["prefix_cache_hit_tokens"].append(hit)
            cols["resume_block"].append(block)
            cols["resume_writer"].append(writer[0] if writer else None)
            cols["resume_write_step"].append(writer[1] if writer else None)
            cols["resume_covers_tokens"].append(writer[2] if writer else None)
            cols["resume_publisher"].append(publisher[0] if publisher else None)
            cols["resume_publish_step"].append(publisher[1] if publisher else None)
            cols["chunk_end_aligned"].append((computed[i] + sched[i]) % self.mbs == 0)
            cols["aborted"].append(False)
        for i, rid in enumerate(req_ids):
            if slots[i] is not None:
                self.writes[int(slots[i])] = (rid, step, computed[i] + sched[i])
        self.copies = {}
        return cols

    def source_of(self, block_id: int):
        """The last write into a physical block: (request, step, tokens), or None."""
        return self.writes.get(block_id)
