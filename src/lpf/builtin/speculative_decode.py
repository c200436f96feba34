"""The model runner's speculative-decoding part: which requests take the verify path, where that path
keeps their state, the rejection sampler's verdict per request, the rollback of the Mamba state to the
last accepted position, the checkpoints a verify step may save, and the drills of this bug class.

As vLLM runs speculative decoding on hybrids: a decoding request with drafts schedules its last sampled
token and its K drafts (1 + K positions) in one step; attention writes their K/V and attends causally
(the KV entries of rejected drafts lie past num_computed_tokens and are overwritten by later steps); the
Mamba layers run them through the decode kernel one position at a time from the request's state slot,
keeping every position's conv and SSM state (`mamba_base._verify`; vLLM keeps them in 1 + K state
blocks), and write the last position's state to the slot. After the rejection sampler
(`speculative_sampler`) the slot is rolled back to the state after the last accepted position. With prefix
caching a checkpoint due at a boundary inside the step is saved from the snapshot at that boundary,
and only when the boundary lies within what the step accepted.

The verify path's state index for a request comes from its state table, which a request gets once it
has run (vLLM's spec-decode state indices): a request that has computed nothing would read and write
the null slot (`StateCache.null_slot`, one scratch slot every such write lands in). The honest phase
rule never sends such a request there (a request with nothing computed is a prefill).

Drills (each needs speculative decoding on):
  spec-prefill-verify     a prompt of exactly 1 + K tokens prefilled in one step is classified by its
                          query length alone, as a uniform decode-and-verify row, and takes the verify
                          path with the null state slot: its own slot is never written (vLLM #49918 /
                          #53051, fixing #47123 and #53059: the seed's imposter in a new costume). Only
                          a whole prompt of 1 + K tokens (not a 1 + K-token first chunk of a longer one).
  spec-accepted-permuted  the accepted-token counts are applied to the rollback in the kernel's batch
                          order (the persistent batch: a finished request's row is filled by the last
                          one, as vLLM's InputBatch condenses) while they were computed in the
                          scheduler's order: after a permutation a request's state is rolled back by
                          another request's count (vLLM #51571, PRs #51599 / #53919).
  spec-no-rollback        the rollback is skipped: a request whose drafts were rejected keeps the state
                          after all 1 + K positions, rejected drafts included.
  spec-checkpoint-rejected  (with prefix caching) a checkpoint due at a boundary inside what a verify
                          step accepted is saved from the state the verify pass ended with (its last
                          position, rejected drafts included), as a chunk's end state is, not from the
                          boundary's snapshot: the block's hash names a state it does not hold, and a
                          request resuming from it (a recompute after preemption) restores it (vLLM
                          #57278 / #55507's neighbourhood: align-mode checkpoints taken at the wrong end
                          when a step advances several tokens). Its ground truth is the prefix cache's.
  spec-draft-probs-permuted  (with a draft model, sampled requests) the draft probabilities are read by
                          the kernel's row after the persistent batch was permuted: a sampled request is
                          verified against another request's draft distribution q (accepted with
                          min(1, p/q_other), resampled from max(0, p - q_other)), so its tokens no longer
                          follow the target's distribution; greedy verification never reads q, and a batch
                          of one or two sequences is never permuted (1Cat-vLLM #656: MTP with probabilistic
                          drafting corrupts only with more than 2 sequences and temperature > 0, the
                          acceptance rate normal). Recorded `corrupted` at each such step whose tokens
                          differ from those the request's own q gives with the same random draws, else
                          `unchanged` (its output is the honest engine's, exactly).
  spec-verify-zero-state  the verify path replays a request's 1 + K positions from a zero-filled state
                          buffer instead of its slot's state (sglang PR #27658's review of the KDA verify
                          path): every verify step's tokens come from a state that forgot the request.
                          The runner passes has_initial_state=False; `mamba_base._verify` zero-fills.
  spec-state-block-zero   the state the next step reads is the snapshot of the verify step's first
                          position (vLLM's state block 0), not the last accepted token's (vLLM #39273,
                          fix PR #40738): right only when no draft was accepted.
  spec-state-before-accept  the verify step's state is committed before the rejection sampler has
                          counted the accepted drafts, with the count known then (the request's previous
                          verify step's; 0 at its first): right only when the count repeats (sglang
                          #36537, whose lazy materialisation fixed it).
Ground truth: a request whose state was left at another position than its last accepted token is
recorded `corrupted` at its next step (which reads that state); a preemption first discards it
(recompute starts over). spec-prefill-verify is recorded when the request next reads its own slot.
"""

from __future__ import annotations

import torch

from lpf.builtin.sched_output import Sample, StateWrite
from lpf.builtin.speculative_sampler import verify_tokens
from lpf.core.torch_utils import logprob_rows


class SpecDecode:
    def __init__(self, faults, truth, state_cache, num_speculative_tokens: int, draft_probs=None):
        self.faults = faults
        # request id -> the [k, V] rows its drafts were drawn from (a draft model's; None: one-hot drafts)
        self.draft_probs = draft_probs or (lambda rid: None)
        self.truth = truth
        self.cache = state_cache
        self.k = num_speculative_tokens
        self._pending: dict[str, tuple[int, str, str]] = {}  # wrong state left, not read yet
        self._batch: list[str] = []  # the persistent batch's rows (spec-accepted-permuted's kernel order)
        self._last_accepted: dict[str, int] = {}  # spec-state-before-accept: each request's previous count

    def phase(self, s, phase: str) -> str:
        """The phase `s` runs in: verify when it carries drafts; under spec-prefill-verify also a whole
        prompt of 1 + K tokens prefilled in one step (the pre-fix rule looked at the query length)."""
        if s.draft_token_ids:
            return "verify"
        if (
            self.faults.spec_prefill_verify
            and s.num_computed_tokens == 0
            and s.will_sample
            and s.num_scheduled_tokens == 1 + self.k
        ):
            return "verify"
        return phase

    def slot(self, s) -> int:
        """The state slot the verify path reads and writes for `s`: its own once it has run, else null."""
        return s.state_slot if s.num_computed_tokens > 0 else self.cache.null_slot

    def preempted(self, request_ids) -> None:
        for rid in request_ids:
            if rid in self._pending:
                step, fault, detail = self._pending.pop(rid)
                self.truth.record(rid, step, fault, detail + "; preempted before reading it", role="discarded")

    def scheduled(self, so, s) -> None:
        """A request whose state was left wrong reads it now: the ground truth's `corrupted`."""
        if s.request_id in self._pending and s.num_computed_tokens > 0:
            step, fault, detail = self._pending.pop(s.request_id)
            self.truth.record(s.request_id, step, fault, detail + f"; step {so.step} read it")

    def finish(self, so, pairs, hidden, logits_fn, ctx, batch_size: int):
        """After the forward pass, for `pairs` [(SeqMeta, ScheduledRequest)] of the verify phase:
        (spec samples {rid: [Sample]}, trace columns {rid: {...}}, state writes [StateWrite])."""
        self._condense(so)
        spec = [(m, s) for m, s in pairs if s.draft_token_ids]
        samples: dict[str, list[Sample]] = {}
        accepted: dict[str, int] = {}
        if spec:
            idx = torch.cat([torch.arange(m.start, m.end) for m, _ in spec]).to(hidden.device)
            z = logits_fn(hidden[idx], batch_size).float()
            at, emitted, keep = 0, [], []
            rows, whose = self._draft_rows(spec)
            for m, s in spec:
                tokens, a = verify_tokens(z[at : at + m.num_tokens], s, rows[s.request_id])
                if s.request_id in whose:
                    self._truth_draft_probs(so, s, z[at : at + m.num_tokens], tokens, whose[s.request_id])
                keep.append(torch.arange(at, at + len(tokens)))
                emitted.append(tokens)
                accepted[s.request_id] = a
                at += m.num_tokens
            k = max(s.sampling.logprobs for _, s in spec)
            flat = torch.tensor([t for tokens in emitted for t in tokens])
            chosen, top_ids, top_lp, _, _ = logprob_rows(z[torch.cat(keep).to(z.device)], flat, k)
            chosen, top_ids, top_lp = chosen.tolist(), top_ids.tolist(), top_lp.tolist()
            at = 0
            for (_, s), tokens in zip(spec, emitted):
                kk = s.sampling.logprobs
                samples[s.request_id] = [
                    Sample(t, chosen[at + j], top_ids[at + j][:kk], top_lp[at + j][:kk]) for j, t in enumerate(tokens)
                ]
                at += len(tokens)
        applied = self._applied(spec, accepted)
        snaps = ctx.memo.get("spec_states", {})
        trace, writes, back = {}, [], []
        row = {rid: b for b, rid in enumerate(next(iter(snaps.values()))[0])} if snaps else {}
        for m, s in pairs:
            b = row.get(s.request_id)
            n = m.num_tokens
            true_pos = n - 1 if s.request_id not in accepted else accepted[s.request_id]
            pos = applied.get(s.request_id, true_pos)
            if pos != n - 1 and b is not None:  # roll back: the state after position `pos` of the step
                back.append((b, pos, m.state_slot))
            start = s.num_computed_tokens
            writes.append(StateWrite(m.state_slot, s.request_id, start + 1 + pos))
            for cp, slot in s.state_writes:  # prefix caching: boundaries inside what was accepted
                if cp <= start + 1 + true_pos and not self.faults.snapshot_never_written:
                    # spec-checkpoint-rejected: saved from the pass's last position, as a chunk's end
                    at = n - 1 if self.faults.spec_checkpoint_rejected else cp - start - 1
                    for layer, (_, conv, ssm) in snaps.items():
                        self.cache.write(layer, "conv", [slot], conv[at, b : b + 1], "decode")
                        self.cache.write(layer, "ssm", [slot], ssm[at, b : b + 1], "decode")
                    writes.append(StateWrite(slot, s.request_id, start + 1 + at))
            trace[s.request_id] = {
                "num_draft_tokens": len(s.draft_token_ids),
                "num_accepted_tokens": accepted.get(s.request_id),
                "verify_state_slot": m.state_slot,
                "state_tokens_before_rollback": start + n,
                "state_tokens_after_rollback": start + 1 + pos,
                "spec_sampled": s.sampling.temperature > 0 if s.draft_token_ids else None,
                "draft_token_ids": list(s.draft_token_ids) if s.draft_token_ids else None,
                "draft_token_probs": self._own_probs(s) if s.draft_token_ids else None,
            }
            self._truth(so, m, s, pos, true_pos)
        if back:  # one gather and one write per layer and part for every request rolled back
            rows = torch.tensor([b for b, _, _ in back])
            at = torch.tensor([p for _, p, _ in back])
            slots = [slot for _, _, slot in back]
            for layer, (_, conv, ssm) in snaps.items():
                self.cache.write(layer, "conv", slots, conv[at, rows], "decode")
                self.cache.write(layer, "ssm", slots, ssm[at, rows], "decode")
        return samples, trace, writes

    def _own_probs(self, s) -> list[float] | None:
        """q_i(d_i): the proposer's probability of each of `s`'s drafts as it drew them (what the scheduler
        handed the sampler; None for one-hot drafts: n-gram, or a greedy request's)."""
        q = self.draft_probs(s.request_id)
        if q is None:
            return None
        return q[torch.arange(len(s.draft_token_ids)), torch.tensor(s.draft_token_ids)].tolist()

    def _draft_rows(self, spec) -> tuple[dict, dict]:
        """The draft probabilities the rejection sampler reads for each speculating request: its own (the
        proposer's rows, None for n-gram drafts); under spec-draft-probs-permuted the rows, stacked in the
        scheduler's order, are read by the kernel's row (the persistent batch's, as spec-accepted-permuted's
        counts are), so after a permutation (a leaver's row refilled: three sequences or more) a request is
        verified against another request's draft distribution. Greedy verification never reads them.
        Also {request id: whose rows it read} for the sampled requests that read another's."""
        own = {s.request_id: self.draft_probs(s.request_id) for _, s in spec}
        if not self.faults.spec_draft_probs_permuted:
            return own, {}
        stacked = [own[s.request_id] for _, s in spec]
        row = {rid: i for i, rid in enumerate(self._batch)}
        kernel = sorted(spec, key=lambda ms: row[ms[1].request_id])
        out, whose = {}, {}
        for j, (_, s) in enumerate(kernel):
            theirs, other = stacked[j], spec[j][1].request_id
            k = len(s.draft_token_ids)
            if theirs is not None and len(theirs) < k:  # a shorter block: its last row repeats (the kernel clamps)
                theirs = torch.cat([theirs, theirs[-1:].expand(k - len(theirs), -1)])
            out[s.request_id] = theirs
            if other != s.request_id and s.sampling.temperature > 0:
                whose[s.request_id] = other
        return out, whose

    def _truth_draft_probs(self, so, s, z, tokens: list[int], other: str) -> None:
        """spec-draft-probs-permuted's ground truth: `corrupted` when the tokens drawn against the other
        request's q differ from those its own q gives with the same random draws (the verify pass's
        generators are seeded by request and position); `unchanged` when they are the same (its output is
        exactly the honest engine's: nothing in it to find)."""
        honest, _ = verify_tokens(z, s, self.draft_probs(s.request_id))
        k = len(s.draft_token_ids)
        if honest == tokens:
            self.truth.record(
                s.request_id,
                so.step,
                "spec-draft-probs-permuted",
                f"its {k} drafts (sampled) were verified against {other}'s draft probabilities; "
                "the same tokens as its own give",
                role="unchanged",
            )
            return
        self.truth.record(
            s.request_id,
            so.step,
            "spec-draft-probs-permuted",
            f"its {k} drafts (sampled) were verified against {other}'s draft probabilities: emitted {tokens}, "
            f"its own give {honest}",
        )

    def _applied(self, spec, accepted: dict[str, int]) -> dict[str, int]:
        """The position each speculating request's state is rolled back to (its accepted count)."""
        if self.faults.spec_no_rollback:
            return {s.request_id: m.num_tokens - 1 for m, s in spec}
        if self.faults.spec_state_block_zero:  # the next step reads block 0: the first position's state
            return {s.request_id: 0 for _, s in spec}
        if self.faults.spec_state_before_accept:  # committed with the count known then: the previous one
            out = {s.request_id: min(self._last_accepted.get(s.request_id, 0), m.num_tokens - 1) for m, s in spec}
            self._last_accepted.update(accepted)
            return out
        if not self.faults.spec_accepted_permuted:
            return dict(accepted)
        # the counts, computed in the scheduler's order, indexed by the kernel's rows (the persistent
        # batch's order); a count past a request's own snapshots reads its last one (the kernel clamps
        # to its block)
        counts = [accepted[s.request_id] for _, s in spec]
        row = {rid: i for i, rid in enumerate(self._batch)}
        kernel = sorted(spec, key=lambda ms: row[ms[1].request_id])
        return {s.request_id: min(counts[j], m.num_tokens - 1) for j, (m, s) in enumerate(kernel)}

    def _condense(self, so) -> None:
        """The persistent batch (vLLM's InputBatch): a request keeps its row while it runs; a request that
        left (not scheduled this step) leaves a hole the last row moves into; newcomers are appended."""
        here = {s.request_id for s in so.scheduled}
        rows = self._batch
        i = 0
        while i < len(rows):
            if rows[i] in here:
                i += 1
                continue
            last = rows.pop()
            if i < len(rows):
                rows[i] = last
        known = set(rows)
        rows.extend(s.request_id for s in so.scheduled if s.request_id not in known)

    def _truth(self, so, m, s, pos: int, true_pos: int) -> None:
        rid = s.request_id
        if not s.draft_token_ids and s.num_computed_tokens == 0:  # spec-prefill-verify's imposter
            self._pending[rid] = (
                so.step,
                "spec-prefill-verify",
                f"its {m.num_tokens}-token prompt (1 + K) ran on the verify path with the null state slot "
                f"{m.state_slot}: its own slot {s.state_slot} was never written",
            )
            return
        if self.faults.spec_verify_zero_state and s.draft_token_ids:  # its tokens came from the zero state
            self.truth.record(
                rid,
                so.step,
                "spec-verify-zero-state",
                f"its {len(s.draft_token_ids)} drafts were verified from a zero-filled state, not its slot "
                f"{m.state_slot}'s",
            )
        if pos == true_pos:
            return
        fault = next(
            d
            for d in ("spec-no-rollback", "spec-state-block-zero", "spec-state-before-accept", "spec-accepted-permuted")
            if getattr(self.faults, d.replace("-", "_"))
        )
        start = s.num_computed_tokens
        self._pending[rid] = (
            so.step,
            fault,
            f"state left at {start + 1 + pos} tokens after a verify step that accepted "
            f"{true_pos} of {len(s.draft_token_ids)} drafts (it should cover {start + 1 + true_pos})",
        )
