"""The runner's hooks for the drills of prefix caching of Mamba state (the 2026 bug class).

Each drill puts back one public bug's mechanism in the built-in engine's prefix cache (see
`prefix_cache` for the honest engine); none touches an output. Where each one lives:

  conv-into-shared-block   vllm#56196. The runner: a resumed prefill chunk shorter than the conv
                           state (< conv width - 1 tokens) stores its new conv state through the
                           pointer it read its initial state from (the shared checkpoint slot)
                           instead of its own slot: its own conv state is never written and every
                           later request resuming from that checkpoint reads this request's conv state.
  unaligned-chunk-hashed   vllm#45477 / #51113 (align mode). The scheduler: the pre-fix chunk rule
                           (`chunk_align.pre_fix_chunk`, aligned only below last_cache_position as
                           EAGLE backs it off), so a chunk ending mid-block leaves state@e in that
                           block's checkpoint and the block is hashed as the state at its end.
  publish-before-write     vllm#56525. The scheduler: checkpoint (and KV block) hashes are published
                           when the chunk that writes them is scheduled; a request aborted before
                           that chunk runs (a client's cancel landing while the step is in flight)
                           leaves a hash naming a state never written; the retry resumes from it.
  incomplete-block-cached  vllm#34587 (all mode, chunked prefill). The Mamba layers save the state
                           only at a chunk's end (the kernel before #34798's chunk alignment), while
                           every full block a chunk crossed is hashed: a block holds the state of an
                           earlier chunk end (or a previous occupant's), published as complete.
  resume-wrong-units       vllm#55601 (issue #55600). The runner: the resume index is computed in the
                           attention block size, (hit - 1) // block_size, instead of the Mamba block
                           size: short hits read another entry of the Mamba block table (an
                           unwritten block, or the null block) and silently restore the wrong state.
  prefix-cache-inert       vllm#48401 (also #51250, #54504). The scheduler: the block size prefix
                           caching hashes and checkpoints at is raised to the hybrid page-aligned
                           size, past the model's context: no request ever fills a block, nothing
                           hits. Outputs are right; the run's prefix-cache finding says it is inert.
  snapshot-never-written   sglang#31474 (KDA). The runner: the Mamba layers save no checkpoint at all
                           (the snapshot write the layer never made), while the scheduler hashes and
                           publishes every boundary as usual: a hit restores whatever the checkpoint
                           slot held (nothing, or an earlier occupant's state).
  stale-conv-on-reuse      sglang#24717 (LFM2). The runner: a prefill passes no has_initial_state to
                           the conv, which takes whatever the slot holds as its prior conv state,
                           and reused slots are not zeroed: a fresh request on a slot freed by an
                           earlier one starts from that request's last conv state (no prefix caching).

Ground truth: the prefix cache records (scheduler side, `prefix_cache`) every request that resumed
from, or computed on, a state the drill made wrong (role `corrupted`), with the checkpoint's story
in `detail`; stale-conv-on-reuse is recorded by `faults.Drills` like stale-state.
"""

from __future__ import annotations

from lpf.builtin.drill_catalog import by_family
from lpf.builtin.sched_output import StateWrite

# For scoring drills (tests, benchmarks; analysis never reads these), from `drill_catalog`: the engine knobs
# each drill's bug ran under (beside --enable-prefix-caching, which all but stale-conv-on-reuse need), and
# the hypothesis features (`lpf.analysis.prefix_features`, `features`) whose first rank names its mechanism.
KNOBS = {d.name: dict(d.knobs) for d in by_family("prefix")}
NAMED_BY = {d.name: set(d.named_by) for d in by_family("prefix")}


class PrefixDrills:
    """Where a resuming request reads its state, where a chunk's conv state and checkpoints go, and
    what the runner wrote (for the prefix cache's provenance). Honest unless a drill is on."""

    def __init__(self, faults, block_size: int, mamba_block_size: int, conv_width: int):
        self.faults = faults
        self.block_size = block_size
        self.mamba_block_size = mamba_block_size
        self.conv_width = conv_width  # the model's Mamba conv kernel width (d_conv)

    def resume(self, s) -> tuple[int, int | None]:
        """(Mamba block index, slot or None = the null block) a resuming request reads its state from."""
        unit = self.block_size if self.faults.resume_wrong_units else self.mamba_block_size
        index = (s.resume_tokens - 1) // unit
        return index, dict(s.state_table).get(index)

    def conv_write_slot(self, s, phase: str, initial_slot: int | None) -> int | None:
        """Where a chunk's final conv state goes; None: its own slot (and its chunk-end checkpoint)."""
        short = s.num_scheduled_tokens < self.conv_width - 1
        if self.faults.conv_into_shared_block and initial_slot is not None and phase != "decode" and short:
            return initial_slot
        return None

    def checkpoints(self, s) -> tuple[tuple[int, int], ...]:
        """The (position, slot) saves the Mamba layers make this step: all the scheduler planned; under
        incomplete-block-cached only the one at the chunk's end; under snapshot-never-written none."""
        if self.faults.snapshot_never_written:
            return ()
        if self.faults.incomplete_block_cached:
            end = s.num_computed_tokens + s.num_scheduled_tokens
            return tuple(w for w in s.state_writes if w[0] == end)
        return s.state_writes

    @staticmethod
    def writes(s, checkpoints, conv_write_slot: int | None) -> list[StateWrite]:
        """What the layers wrote for `s`: its own slot, its checkpoints, a redirected conv state."""
        end = s.num_computed_tokens + s.num_scheduled_tokens
        moved = conv_write_slot is not None
        out = [StateWrite(s.state_slot, s.request_id, end, "ssm" if moved else "state")]
        out += [
            StateWrite(slot, s.request_id, pos, "ssm" if moved and pos == end else "state") for pos, slot in checkpoints
        ]
        if moved:
            out.append(StateWrite(conv_write_slot, s.request_id, end, "conv"))
        return out
