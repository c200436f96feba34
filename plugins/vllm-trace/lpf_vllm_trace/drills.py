"""The seed's bugs put back into real vLLM through the plugin, with their ground truth.

`LPF_VLLM_INJECT` (comma-separated):
  stale-state         the classification vLLM used before PRs #32118 / #37303 / #42430: a row with at
                      most one scheduled token is a decode, whatever num_computed_tokens says, both in
                      the batch reorder (`prefix_reorder`: the pre-fix
                      `reorder_batch_to_split_decodes_and_prefills`, which looked only at the token
                      count) and in the Mamba metadata split (`split_decodes_and_prefills` with short
                      extends counted as decodes and `is_prefilling` ignored). A new request given one
                      token of budget then runs vLLM's Mamba decode kernels (causal_conv1d_update,
                      selective_state_update) on its state slot, which nothing zeroes on reuse.
  offset-wrap:BITS    the prefill path addresses a row's state at (slot * stride) mod 2**BITS elements
                      (stride: elements between two slots of a layer's SSM state): its initial-state
                      read and final-state write (conv and SSM) land on the slot that wrapped offset
                      points at; decodes keep the exact slot. The seed's 32-bit offset overflow.
  publish-before-write
                      vLLM's align-mode prefix cache with the same-step hit guard of PR #29387 removed
                      (`forget_same_step_guard`): `cache_blocks` publishes a state block's hash at
                      schedule time (still so in 0.32; #56525 open), so a request admitted in the same
                      step resumes from a block whose state that step has not written yet.
  unaligned-chunk-hashed
                      the scheduler's block-aligned split without its clip of inner prefill chunks
                      (`unaligned_split`; #45477 / #51113): a chunk ends mid-block, the block it crossed
                      keeps the previous chunk's state and is hashed as the boundary state.
  Both need `-E enable_prefix_caching=true` on a hybrid (vLLM then runs mamba_cache_mode align).
Ground truth (`faults` rows, vLLM request ids; roles as lpf's built-in drills use them):
  stale-state  `corrupted` once a request that ran a decode with num_computed_tokens 0 on a slot an
               earlier request had used samples a token; `discarded` if vLLM preempts it first
               (recompute starts over from a prefill).
  offset-wrap  `wrapped` at a prefill whose state went to another slot, `corrupted` when the request
               then decodes from its own slot, `overwritten` for the request holding the block hit
               (its Mamba state, or its attention keys and values: the groups share one block pool).
  prefix drills `corrupted` for a request whose restored state does not cover its hit (from the
               runner's own record of what it wrote where: `prefix_log`), and for one that resumed from
               a state such a request wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DRILLS = ("stale-state", "offset-wrap", "publish-before-write", "unaligned-chunk-hashed")


@dataclass
class Drills:
    stale_state: bool = False
    offset_wrap_bits: int | None = None
    publish_before_write: bool = False
    unaligned_chunk: bool = False
    _tainted: set = field(default_factory=set)  # vLLM ids whose Mamba state a prefix drill made wrong
    _stale_reads: dict = field(default_factory=dict)  # vLLM id -> (step, detail), not yet sampled
    _wrapped: dict = field(default_factory=dict)  # vLLM id -> (step, detail), not yet decoded

    @classmethod
    def parse(cls, spec: str) -> "Drills":
        d = cls()
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            name, _, arg = item.partition(":")
            if name == "stale-state" and not arg:
                d.stale_state = True
            elif name == "publish-before-write" and not arg:
                d.publish_before_write = True
            elif name == "unaligned-chunk-hashed" and not arg:
                d.unaligned_chunk = True
            elif name == "offset-wrap":
                try:
                    bits = int(arg or 20)
                except ValueError:
                    bits = 0
                if not 1 <= bits <= 62:
                    raise ValueError(f"LPF_VLLM_INJECT: offset-wrap takes BITS in 1..62, got {arg!r}")
                d.offset_wrap_bits = bits
            else:
                raise ValueError(f"LPF_VLLM_INJECT: unknown drill {item!r} (this plugin has: {', '.join(DRILLS)})")
        return d

    @property
    def any(self) -> bool:
        return self.stale_state or self.offset_wrap_bits is not None or self.prefix

    @property
    def prefix(self) -> bool:
        return self.publish_before_write or self.unaligned_chunk

    def names(self) -> list[str]:
        return (
            (["stale-state"] if self.stale_state else [])
            + ([f"offset-wrap:{self.offset_wrap_bits}"] if self.offset_wrap_bits is not None else [])
            + (["publish-before-write"] if self.publish_before_write else [])
            + (["unaligned-chunk-hashed"] if self.unaligned_chunk else [])
        )

    def observe_prefix(self, step: int, req_ids: list[str], cols: dict[str, list]) -> list[dict]:
        """Ground truth of the prefix drills for one step's rows (`cols`: the PREFIX columns, read off
        the runner's own writes). `corrupted`: the request restored a state that does not cover its hit
        (the hash names `hit` tokens; the block held the state after `covers`, or nothing), or one a
        corrupted request wrote. Attributed to publish-before-write when the hash was published by
        another request in this very step (its chunk had not run yet), else to unaligned-chunk-hashed."""
        out = []
        for i, rid in enumerate(req_ids):
            hit = cols["prefix_cache_hit_tokens"][i] or 0
            if hit <= 0:
                continue
            writer, covers, publisher = (
                cols["resume_writer"][i],
                cols["resume_covers_tokens"][i],
                cols["resume_publisher"][i],
            )
            fault = None
            if writer is None or covers != hit:
                held = f"the state of {writer} after {covers} tokens" if writer else "a state nothing had written"
                same_step = publisher not in (None, rid) and cols["resume_publish_step"][i] == step
                if self.publish_before_write and (same_step or not self.unaligned_chunk):
                    fault = "publish-before-write"
                    detail = (
                        f"resumed at {hit} tokens from a block {publisher} published at step "
                        f"{cols['resume_publish_step'][i]}, before its chunk wrote the state; it held {held}"
                    )
                elif self.unaligned_chunk:
                    fault = "unaligned-chunk-hashed"
                    detail = (
                        f"resumed at {hit} tokens from a block hashed as the state after {hit} tokens by "
                        f"{publisher}; it held {held} (a chunk that ended mid-block)"
                    )
            elif writer in self._tainted:
                fault = self.names()[-1]
                detail = f"resumed from a state written by {writer}, whose own restored state was wrong"
            if fault is not None:
                self._tainted.add(rid)
                out.append(_fault(rid, step, fault, "corrupted", detail))
        return out

    # -- offset arithmetic -----------------------------------------------------------------------
    def wrapped_slot(self, slot: int, stride: int) -> int:
        """The slot a prefill's state lands on: the one (slot * stride) mod 2**BITS points into."""
        return (slot * stride) % (1 << self.offset_wrap_bits) // stride

    # -- ground truth, per step ----------------------------------------------------------------
    def observe(
        self,
        step: int,
        rows: list[dict],
        preempted: set[str],
        used_slots: set[int],
        wrapped: dict[str, list[tuple[int, int]]],
        owners: dict[int, str],
    ) -> list[dict]:
        """Fault rows for one step. `rows`: the step's trace rows (vLLM ids, before any wrap);
        `used_slots`: every slot some earlier step ran on; `wrapped`: request -> [(slot, target)]
        for rows whose prefill went elsewhere; `owners`: slot -> request holding it now."""
        out = []
        for rid in preempted:
            if rid in self._stale_reads:
                read_step, detail = self._stale_reads.pop(rid)
                out.append(
                    _fault(
                        rid,
                        read_step,
                        "stale-state",
                        "discarded",
                        detail + "; preempted before its first sample, so recompute discarded the stale state",
                    )
                )
            self._wrapped.pop(rid, None)
        for r in rows:
            if r["preempted"]:
                continue
            rid, slots = r["vllm_request_id"], r["state_slots"] or []
            if (
                self.stale_state
                and r["phase"] == "decode"
                and r["num_computed_tokens"] == 0
                and any(s in used_slots for s in slots)
            ):
                self._stale_reads[rid] = (
                    step,
                    f"first step ran as decode on slot(s) {_slots(slots)}, which held an earlier request's state",
                )
            samples = r["num_computed_tokens"] + r["num_scheduled_tokens"] >= r["num_prompt_tokens"]
            if samples and rid in self._stale_reads:
                read_step, detail = self._stale_reads.pop(rid)
                out.append(_fault(rid, read_step, "stale-state", "corrupted", detail))
            if rid in wrapped:
                moves = ", ".join(f"slot {s} -> {t}" for s, t in wrapped[rid])
                detail = f"prefill state written to the wrapped slot ({moves}, 2^{self.offset_wrap_bits} elements)"
                out.append(_fault(rid, step, "offset-wrap", "wrapped", detail))
                self._wrapped.setdefault(rid, (step, detail))
                for _, target in wrapped[rid]:
                    victim = owners.get(target)
                    if victim is not None and victim != rid:
                        out.append(
                            _fault(
                                victim,
                                step,
                                "offset-wrap",
                                "overwritten",
                                f"slot {target} overwritten by {rid}'s wrapped state write",
                            )
                        )
            elif r["phase"] == "decode" and r["num_computed_tokens"] > 0 and rid in self._wrapped:
                wrap_step, detail = self._wrapped.pop(rid)
                out.append(
                    _fault(
                        rid,
                        wrap_step,
                        "offset-wrap",
                        "corrupted",
                        detail + f"; step {step} decoded from slot(s) {_slots(slots)}, which its prefill never wrote",
                    )
                )
        return out


def _slots(slots) -> str:
    return "/".join(str(s) for s in slots)


def _fault(rid: str, step: int, fault: str, role: str, detail: str) -> dict:
    return {"request_id": rid, "step": step, "fault": fault, "role": role, "detail": detail}


def prefix_reorder(input_batch, scheduler_output, decode_threshold: int = 1) -> bool:
    """vLLM's batch reorder before the fix (v0.10-era `reorder_batch_to_split_decodes_and_prefills`):
    a row is a decode iff it has at most `decode_threshold` scheduled tokens; decodes found behind
    the decode region are swapped with the front-most prefills. Returns whether the batch changed."""
    decodes, prefills = [], []
    for i, req_id in enumerate(input_batch.req_ids):
        if scheduler_output.num_scheduled_tokens[req_id] <= decode_threshold:
            decodes.append(i)
        else:
            prefills.append(i)
    num_decodes, modified = len(decodes), False
    for i in range(1, min(num_decodes, len(prefills)) + 1):
        decode_idx = decodes[num_decodes - i]
        if decode_idx < num_decodes:
            break
        input_batch.swap_states(prefills[i - 1], decode_idx)
        modified = True
    return modified


class _NoGuard(set):
    """A set that remembers nothing: vLLM's `cached_blocks_this_step` as it was before the guard."""

    def add(self, item) -> None:
        pass

    def __contains__(self, item) -> bool:
        return False


def forget_same_step_guard(manager) -> None:
    """publish-before-write: `MambaManager.cache_blocks` publishes a state block's hash at schedule time,
    for tokens the step has not computed yet (still so in vLLM 0.32, #56525 open). PR #29387 added
    `cached_blocks_this_step`, which `get_num_blocks_to_allocate` reads to defer a request whose hit
    ends on a block cached in this very schedule pass. Without it (the code before #29387) such a
    request is scheduled in the same step, and `preprocess_mamba` copies the block's state before the
    publisher's forward writes it: it restores whatever the block held (the publisher's state one chunk
    earlier, or another request's)."""
    manager.cached_blocks_this_step = _NoGuard()


def unaligned_split(
    orig,
    scheduler,
    request,
    num_new_tokens: int,
    num_new_local_computed_tokens: int = 0,
    num_external_computed_tokens: int = 0,
) -> int:
    """unaligned-chunk-hashed (vLLM #45477 / #51113; the invariant of #30877's block-aligned scheduling):
    `Scheduler._mamba_block_aligned_split` clips a prefill chunk that is not the prompt's last so it
    ends on a Mamba block boundary ("slot p holds the state after exactly (p + 1) * block_size
    tokens"). Put back without that clip, a chunk may end mid-block: its state goes to the column of
    the block it ends in, the block it crossed keeps the state of the chunk before, and
    `cache_blocks` still hashes that block as the boundary state. The prompt's last chunk keeps
    vLLM's handling (the CPU build cannot export a mid-chunk checkpoint: docs/conformance.md)."""
    start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    if start < prefill_end and start + num_new_tokens < prefill_end:
        return num_new_tokens
    return orig(scheduler, request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
