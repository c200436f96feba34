"""Prefix caching for hybrids, as vLLM does it: KV blocks shared by hash, Mamba state checkpointed at
block boundaries. Never imports torch (the scheduler owns it; the runner only reads its decisions).

The honest engine:
- **Hashes.** Full KV blocks (`block_size` tokens) get chained content hashes (each covers every token
  before its end). A Mamba block is `mamba_block_size` tokens (a multiple of block_size); the state
  checkpoint at boundary b is published under the hash of the KV block ending at b.
- **Lookup** (a request admitted with nothing computed): the longest run of cached KV blocks, capped
  at num_tokens - 1 (one token is always computed, for its logits), then the deepest Mamba boundary
  inside it with a published checkpoint: a hit resumes from the deepest boundary every layer group
  hits. The request takes references on the hit's blocks and checkpoint slot; its first step reads
  its initial state from that slot (vLLM's initial_state_idx) and writes its own.
- **Writes.** As vLLM's align mode: at the end of every prefill chunk the state is saved into the
  checkpoint entry of the chunk's last token's Mamba block (its "block table" entry), and a decode
  that ends on a boundary saves there too; in all mode the Mamba layers also save at every boundary a
  chunk crosses. In align mode the scheduler keeps chunk ends on boundaries (`chunk_align`).
- **Publication**, after the step ran (`commit`): every full KV block and every checkpoint entry whose
  block is full (the block's end is computed) is published, then the writer drops its reference (the
  slot stays cached until evicted for another allocation). A hash is published only once its state
  is written; a request aborted mid-prefill publishes nothing more (`release`).
- **Provenance.** Every slot remembers its last write (request, step, tokens it covers); every published
  checkpoint its publisher and step. `provenance(slot)` and `checkpoint(slot)` feed the trace.

The drills (`prefix_drills` says which PR each re-creates) switch one rule each: the pre-fix chunk
rule (unaligned-chunk-hashed), publication at schedule time (publish-before-write), the checkpoint
block size past the context (prefix-cache-inert); the runner-side ones only change what gets
written where. Ground truth: a state made wrong (a checkpoint whose content is not what its hash
claims, a request computing on such a state) carries a taint; every request that resumes from a
tainted checkpoint or KV block, or is tainted directly, is recorded `corrupted` (with the story in
`detail`); taints spread to what tainted requests publish. The honest engine raises if it would
publish a checkpoint whose state does not cover exactly its boundary (an engine bug, not a drill).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Callable

from lpf.builtin import chunk_align
from lpf.builtin.cache_pools import CachingBlockPool, CachingSlotPool


def block_hash(parent: int, tokens) -> int:
    """Chained content hash of one block (64 bits): the parent's hash and this block's token ids."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class Write:
    """The last state written into a slot: by whom, at which step, covering how many tokens."""

    request_id: str
    step: int
    covers: int
    part: str = "state"


@dataclass
class Checkpoint:
    """A published Mamba state: the boundary its hash names, who published it and when, and (drills)
    why its content is not what the hash claims."""

    boundary: int
    publisher: str
    publish_step: int
    taint: tuple[str, str] | None = None
    tainted_at: int = -1  # the step its content went wrong: a request resuming in that step read it before


@dataclass(frozen=True)
class Hit:
    tokens: int = 0
    blocks: tuple[int, ...] = ()
    slot: int | None = None  # the checkpoint's slot (None: no Mamba layers, or no hit)


class PrefixCache:
    def __init__(
        self,
        config,
        num_slots: int,
        num_blocks: int,
        faults,
        record: Callable[..., None],
        has_mamba: bool = True,
        max_context: int | None = None,
    ):
        self.bs = config.block_size
        mbs = config.checkpoint_block_size
        if faults.prefix_cache_inert:  # vLLM #48401: the hybrid page alignment raised the block past the context
            context = max_context or 1 << 20
            mbs = max(mbs, -(-(context + 1) // self.bs) * self.bs)
        self.mbs = mbs
        self.per = mbs // self.bs  # KV blocks per Mamba block
        self.mode = config.mamba_cache_mode
        self.max_chunk = config.max_num_batched_tokens
        self.faults = faults
        self.record = record
        self.has_mamba = has_mamba
        self.blocks = CachingBlockPool(num_blocks)
        self.slots = CachingSlotPool(num_slots, on_evict=self._evicted)
        self.checkpoints: dict[int, Checkpoint] = {}  # published slot -> what it holds
        self.last_write: dict[int, Write] = {}
        self.block_taint: dict[int, tuple[str, str]] = {}
        self._pass: set[int] = set()  # hashes published by this schedule pass (not hit by it)
        self.stats = {
            "queries": 0,
            "hits": 0,
            "hit_tokens": 0,
            "query_tokens": 0,
            "published_blocks": 0,
            "published_checkpoints": 0,
            "checkpoints_skipped": 0,
        }

    # -- hashes ------------------------------------------------------------------------------------
    def hashes(self, req) -> list[int]:
        """The request's block hashes, extended to every full block of its known tokens."""
        hs, full = req.block_hashes, req.num_tokens // self.bs
        if len(hs) < full:
            tokens = req.token_ids(len(hs) * self.bs, full * self.bs)
            parent = hs[-1] if hs else 0
            for i in range(0, len(tokens), self.bs):
                parent = block_hash(parent, tokens[i : i + self.bs])
                hs.append(parent)
        return hs

    def boundary_hash(self, req, boundary: int) -> int | None:
        """Hash of the Mamba boundary at `boundary` tokens (None when those tokens are not known yet)."""
        hs = self.hashes(req)
        i = boundary // self.bs - 1
        return hs[i] if 0 <= i < len(hs) else None

    # -- admission ---------------------------------------------------------------------------------
    def lookup(self, req) -> Hit:
        hs = self.hashes(req)
        limit = (req.num_tokens - 1) // self.bs
        blocks = []
        for h in hs[:limit]:
            b = self.blocks.cached(h)
            if b is None or h in self._pass:
                break
            blocks.append(b)
        if not self.has_mamba:
            return Hit(len(blocks) * self.bs, tuple(blocks)) if blocks else Hit()
        for k in range(len(blocks) // self.per, 0, -1):
            h = hs[k * self.per - 1]
            slot = self.slots.cached(h)
            if slot is not None and h not in self._pass:
                return Hit(k * self.mbs, tuple(blocks[: k * self.per]), slot)
        return Hit()

    def acquire(self, req, hit: Hit) -> None:
        """Take the hit: references on its blocks and checkpoint, the request resumes after it."""
        for b in hit.blocks:
            self.blocks.touch(b)
        if hit.slot is not None:
            self.slots.touch(hit.slot)
            req.state_entries = {hit.tokens // self.mbs - 1: hit.slot}
            req.resume_slot = hit.slot
        req.block_table = list(hit.blocks)
        req.num_computed_tokens = hit.tokens
        req.published_blocks = len(hit.blocks)
        req.prefix_hit_tokens = hit.tokens
        req.resume_pending = hit.tokens > 0
        self.stats["queries"] += 1
        self.stats["query_tokens"] += req.num_tokens
        if hit.tokens:
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += hit.tokens

    def undo(self, req, hit: Hit) -> None:
        """Admission fell through after `acquire`: give the hit back."""
        self.blocks.free(list(hit.blocks))
        if hit.slot is not None:
            self.slots.release(hit.slot)
        self.stats["queries"] -= 1
        self.stats["query_tokens"] -= req.num_tokens
        if hit.tokens:
            self.stats["hits"] -= 1
            self.stats["hit_tokens"] -= hit.tokens
        req.block_table, req.state_entries, req.resume_slot = [], {}, None
        req.num_computed_tokens = req.published_blocks = req.prefix_hit_tokens = 0
        req.resume_pending = False

    # -- one step ----------------------------------------------------------------------------------
    def new_pass(self) -> None:
        self._pass = set()

    def align(self, req, n: int) -> int:
        """Tokens to schedule for a chunk starting at num_computed_tokens (align mode keeps chunk ends
        where a checkpoint is due; the unaligned-chunk-hashed drill uses the pre-fix rule)."""
        if self.mode != "align" or not self.has_mamba:
            return n
        start, prompt = req.num_computed_tokens, len(req.prompt_token_ids)
        if self.faults.unaligned_chunk_hashed:
            return chunk_align.pre_fix_chunk(start, n, prompt, req.num_tokens, self.mbs, self.max_chunk)
        return chunk_align.aligned_chunk(start, n, prompt, req.num_tokens, self.mbs, self.max_chunk)

    def plan(
        self, req, n: int, step: int, verify: bool = False
    ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """(state writes (position, slot), Mamba block table) of the request's step of n tokens: the
        checkpoint entries this step saves into (allocated now), and the table the runner resumes from.
        A verify step (speculative decoding) plans every boundary its tokens cross: the runner saves
        only those within what the step accepts (from the verify pass's per-position states), and an
        entry left unwritten stays the request's, planned again by a later step."""
        req.in_flight = {"step": step, "slots": [], "blocks": []}
        if not self.has_mamba:
            if self.faults.publish_before_write:
                self._publish(req, req.num_computed_tokens + n, step, at_schedule=True)
            return (), ()
        start = req.num_computed_tokens
        end = start + n
        chunk = start < chunk_align.prefill_end(len(req.prompt_token_ids), req.num_tokens) or n > 1
        due = list(range((start // self.mbs + 1) * self.mbs, end, self.mbs)) if self.mode == "all" else []
        if verify:
            due = list(range((start // self.mbs + 1) * self.mbs, end + 1, self.mbs))
        elif chunk or end % self.mbs == 0:
            due.append(end)
        writes = []
        for pos in due:
            entry = (pos - 1) // self.mbs
            h = self.boundary_hash(req, (entry + 1) * self.mbs)
            if h is not None and self.slots.cached(h) is not None:
                continue  # someone published this boundary already: nothing to save
            slot = req.state_entries.get(entry)  # (never the resume entry: positions lie past the hit)
            if slot is None:
                slot = self.slots.allocate()
                if slot is None:
                    self.stats["checkpoints_skipped"] += 1
                    continue
                self.checkpoints.pop(slot, None)
                req.state_entries[entry] = slot
            writes.append((pos, slot))
        table = tuple(sorted(req.state_entries.items()))
        if self.faults.publish_before_write:
            self._publish(req, end, step, at_schedule=True)
        return tuple(writes), table

    def commit(self, req, step: int, n: int, writes, read: tuple[int, int | None] | None, continues: bool) -> None:
        """After the runner ran the request's step of n tokens (num_computed_tokens already advanced):
        its writes' provenance, its resume checked against what it should have read (ground truth),
        then what is now written and full gets published and the writer lets go of it."""
        if read is not None:  # first: what the slot held when it was read, before this step's writes
            self._resumed(req, step, read)
        for w in writes:
            self._wrote(req, step, n, w)
        if req.resume_slot is not None:
            entry = req.prefix_hit_tokens // self.mbs - 1
            if req.state_entries.get(entry) == req.resume_slot:
                del req.state_entries[entry]
            self.slots.release(req.resume_slot)
            req.resume_slot = None
        req.resume_pending = False
        if req.pending_taint is not None and continues:
            self._taint(req, step, *req.pending_taint)
        req.pending_taint = None
        if not self.faults.publish_before_write:
            self._publish(req, req.num_computed_tokens, step, at_schedule=False)
        for slot in req.held_published:
            self.slots.free(slot)
        req.held_published = []
        req.in_flight = None

    def release(self, req, step: int, in_flight: bool = False) -> None:
        """The request leaves (finished, preempted, aborted): its blocks go back to the pool (the
        caller frees them), its unpublished entries are freed; `in_flight`: it was aborted after its
        step was scheduled, before it ran."""
        if in_flight and req.in_flight is not None:
            self._never_written(req)
        if req.resume_slot is not None and req.resume_slot not in req.state_entries.values():
            self.slots.release(req.resume_slot)
        for slot in [*req.state_entries.values(), *req.held_published]:
            self.slots.free(slot)
        req.state_entries, req.held_published, req.resume_slot, req.resume_pending = {}, [], None, False
        req.published_blocks, req.in_flight = 0, None
        req.state_taint = req.pending_taint = None

    # -- provenance (for the trace) --------------------------------------------------------------
    def provenance(self, slot: int | None) -> Write | None:
        return None if slot is None else self.last_write.get(slot)

    def checkpoint(self, slot: int | None) -> Checkpoint | None:
        return None if slot is None else self.checkpoints.get(slot)

    def describe(self) -> dict:
        return {
            "block_size": self.bs,
            "mamba_block_size": self.mbs,
            "mamba_cache_mode": self.mode,
            **self.stats,
            "evicted_checkpoints": self.slots.evicted,
            "evicted_blocks": self.blocks.evicted,
        }

    # -- internals ---------------------------------------------------------------------------------
    def _evicted(self, slot: int, h: int) -> None:
        self.checkpoints.pop(slot, None)

    def _publish(self, req, upto: int, step: int, at_schedule: bool) -> None:
        """Publish the request's full KV blocks and full checkpoint entries below `upto` tokens; the
        request keeps its reference on a published entry until its step is committed."""
        hs = self.hashes(req)
        full = min(upto // self.bs, len(hs), len(req.block_table))
        for i in range(req.published_blocks, full):
            b = req.block_table[i]
            if self.blocks.publish(b, hs[i]):
                self.stats["published_blocks"] += 1
                if req.state_taint is not None:
                    self.block_taint[b] = req.state_taint
                else:
                    self.block_taint.pop(b, None)
                if at_schedule:
                    self._pass.add(hs[i])
                    req.in_flight["blocks"].append(b)
        req.published_blocks = max(req.published_blocks, full)
        for entry in sorted(req.state_entries):
            boundary = (entry + 1) * self.mbs
            slot = req.state_entries[entry]
            if boundary > upto or slot == req.resume_slot:
                continue
            del req.state_entries[entry]
            req.held_published.append(slot)
            h = hs[boundary // self.bs - 1]
            if not self.slots.publish(slot, h):  # another request published this boundary first
                continue
            taint = req.state_taint if at_schedule else req.state_taint or self._mismatch(slot, req, boundary)
            self.checkpoints[slot] = Checkpoint(boundary, req.request_id, step, taint)
            self.stats["published_checkpoints"] += 1
            if at_schedule:
                self._pass.add(h)
                req.in_flight["slots"].append(slot)

    def _mismatch(self, slot: int, req, boundary: int) -> tuple[str, str] | None:
        """Why a checkpoint about to be published does not hold the state at its boundary, or None."""
        w = self.last_write.get(slot)
        if w is not None and w.request_id == req.request_id and w.covers == boundary and w.part == "state":
            return None
        got = "never written" if w is None else f"{w.request_id}'s state@{w.covers} ({w.part}, step {w.step})"
        fault = (
            "conv-into-shared-block"
            if self.faults.conv_into_shared_block and w is not None and w.part != "state"
            else next(
                (
                    d
                    for d in (
                        "unaligned-chunk-hashed",
                        "incomplete-block-cached",
                        "spec-checkpoint-rejected",
                        "snapshot-never-written",
                    )
                    if getattr(self.faults, d.replace("-", "_"))
                ),
                None,
            )
        )
        if fault is None:
            raise RuntimeError(
                f"prefix cache: {req.request_id} would publish slot {slot} as the state at {boundary} "
                f"tokens, but it holds {got}"
            )
        return fault, f"checkpoint of {req.request_id} published as the state at {boundary} tokens holds {got}"

    def _wrote(self, req, step: int, n: int, w) -> None:
        ck = self.checkpoints.get(w.slot)
        if ck is not None and w.slot not in req.held_published:  # a published checkpoint written again
            if not self.faults.conv_into_shared_block:
                raise RuntimeError(f"prefix cache: {req.request_id} wrote into published checkpoint slot {w.slot}")
            if ck.taint is None:
                ck.taint = (
                    "conv-into-shared-block",
                    f"{req.request_id}'s conv state after {w.covers} tokens was "
                    f"written at step {step} into this shared checkpoint of {ck.publisher} (the state at "
                    f"{ck.boundary} tokens)",
                )
                ck.tainted_at = step
            req.pending_taint = (
                "conv-into-shared-block",
                f"its {n}-token prefill chunk (shorter than the conv "
                f"state) stored its new conv state into the shared checkpoint slot {w.slot} it "
                f"resumed from at step {step}; its own slot's conv state was never written",
            )
        self.last_write[w.slot] = Write(w.request_id, step, w.covers, w.part)

    def _resumed(self, req, step: int, read: tuple[int, int | None]) -> None:
        index, slot = read
        want, expected = req.prefix_hit_tokens // self.mbs - 1, req.resume_slot
        if slot != expected:
            w = self.last_write.get(slot) if slot is not None else None
            got = (
                "the null block"
                if slot is None
                else (
                    f"slot {slot}, holding "
                    + (f"{w.request_id}'s state@{w.covers} (step {w.step})" if w else "nothing written")
                )
            )
            self._taint(
                req,
                step,
                "resume-wrong-units",
                f"resumed at {req.prefix_hit_tokens} tokens from Mamba block {index} ({got}) instead of block {want}",
            )
            return
        ck = self.checkpoints.get(slot)
        if ck is not None and ck.taint is not None and ck.tainted_at < step:  # same step: read before the write
            self._taint(
                req,
                step,
                ck.taint[0],
                f"resumed from the state at {ck.boundary} tokens published by "
                f"{ck.publisher} at step {ck.publish_step}: {ck.taint[1]}",
            )
            return
        bad = next(
            (self.block_taint[b] for b in req.block_table[: req.prefix_hit_tokens // self.bs] if b in self.block_taint),
            None,
        )
        if bad is not None:
            self._taint(req, step, bad[0], f"resumed over a cached KV block: {bad[1]}")

    def _taint(self, req, step: int, fault: str, detail: str) -> None:
        if req.state_taint is None:
            req.state_taint = (fault, detail)
            self.record(req.request_id, step, fault, detail, role="corrupted")

    def _never_written(self, req) -> None:
        """publish-before-write: what this request's aborted step published names states never written."""
        step = req.in_flight["step"]
        for slot in req.in_flight["slots"]:
            ck, w = self.checkpoints.get(slot), self.last_write.get(slot)
            if ck is not None:
                ck.taint = (
                    "publish-before-write",
                    f"published by {req.request_id} at step {step} when its chunk "
                    f"was scheduled; it was aborted before the chunk ran, so the state was never written "
                    f"(the slot holds " + (f"{w.request_id}'s state@{w.covers}" if w else "nothing") + ")",
                )
        for b in req.in_flight["blocks"]:
            self.block_taint[b] = (
                "publish-before-write",
                f"KV block published by {req.request_id} at step {step} "
                f"when its chunk was scheduled; aborted before the chunk ran, never written",
            )
