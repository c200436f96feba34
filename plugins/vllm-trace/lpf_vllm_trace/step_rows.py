"""One engine step of vLLM's runner -> trace rows (and drill ground truth), read where vLLM decided.

`StepReader.read(runner, step, attn_metadata)` runs right after the runner built its per-layer
attention metadata for a real step, when `input_batch` is in its final (reordered) order and
`num_computed_tokens_cpu` still holds the tokens computed before this step. It returns the metadata
the forward pass will use: vLLM's own, or under offset-wrap a copy whose prefill state indices are
the wrapped slots.
Phase: the Mamba metadata puts its `num_decodes` decode rows first and its prefill rows after them
(Gated DeltaNet's the same, its speculating rows, `num_spec_decodes`, counted as decodes; its slots are
read from its own index tensors, `_gdn_slots`);
a prefill row is `prefill` when nothing was computed yet and `extend` otherwise. A model without
Mamba layers has no such split: its rows are classified by vLLM's (fixed) rule from the counts, and
their state slot is null.
Speculative decoding (the runner has a `speculative_config`): a decode row that carries drafts
(`scheduled_spec_decode_tokens`) is `verify`, as the built-in engine's; a decode row without drafts
stays `decode` (with K > 0 it still runs vLLM's speculative state layout). How many drafts were accepted
is only known after the sampler ran, in `sample_tokens`, after `execute_model` returned: such a step's
rows wait (`pending`) until `accepted(step, runner, sampled)` fills `num_accepted_tokens` from the
sampled ids, counted as the runner counts them for the Mamba kernels (`gpu_model_runner.py:1562`:
non-placeholder ids per row, the bonus token included), and only then reach the recorder, so the
flusher never writes a step without its counts. `emit(step)` sends a step on as it is (the sampler
never ran: its counts stay null).
Drafts: `draft_token_ids` are the row's `scheduled_spec_decode_tokens` (under async scheduling those are
placeholders: `accepted` reads the runner's real ones instead); `draft_token_probs` stays null (one-hot,
q = 1) unless the rejection sampler was given draft probabilities this step, which n-gram speculation
never is (`_draft_probs`, whose file:line citations are there).
"""

from __future__ import annotations

import dataclasses


class StepReader:
    def __init__(self, session, mamba_metadata_cls, gdn_metadata_cls=None):
        self.session = session
        self.mamba_cls = mamba_metadata_cls
        self.gdn_cls = gdn_metadata_cls  # Gated DeltaNet's metadata (Qwen3-Next, Qwen3.5): no Mamba subclass
        self.groups: list[tuple[int, str]] | None = None  # (kv-cache group id, first layer) per Mamba group
        self.stride: int | None = None
        self.used_blocks: set[int] = set()  # every block some request has held (stale-state)
        self.writes = True  # this process's runner writes the rows (rank 0)
        self.prefix = None  # ProvenanceLog, when vLLM runs the align-mode Mamba prefix cache

    def _init(self, runner) -> None:
        import torch.distributed as dist
        from vllm.v1.kv_cache_interface import MambaSpec

        # every tensor/pipeline-parallel rank runs a runner on the same batch: rank 0 writes for all
        # (the drills act on every rank, so every rank runs the same faulty classification)
        self.writes = not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)
        groups = []
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            if isinstance(group.kv_cache_spec, MambaSpec) and group.layer_names:
                groups.append((gid, group.layer_names[0]))
        self.groups = groups
        cache = runner.cache_config
        mode = getattr(cache, "mamba_cache_mode", None)
        mbs = int(runner.kv_cache_config.kv_cache_groups[groups[0][0]].kv_cache_spec.block_size) if groups else None
        if groups and cache.enable_prefix_caching and mode == "align":
            from lpf_vllm_trace.prefix_log import ProvenanceLog

            self.prefix = ProvenanceLog(mbs)
        if groups:
            layer = runner.compilation_config.static_forward_context[groups[0][1]]
            # elements between two slots of the first Mamba layer's SSM state: what `slot * stride` means
            # (a short-conv layer, Lfm2's, holds a conv state only: its stride then)
            states = layer.kv_cache
            self.stride = int(states[1 if len(states) > 1 else 0].stride(0))
        if self.writes:
            self.session.recorder.writes_steps()
            self.session.recorder.write_status(
                {
                    "mamba_groups": len(groups),
                    "state_slot_stride": self.stride,
                    "kv_cache_blocks": int(runner.kv_cache_config.num_blocks),
                    "enable_prefix_caching": bool(cache.enable_prefix_caching),
                    "mamba_cache_mode": mode,
                    "mamba_block_size": mbs,
                    "cache_config_block_size": int(cache.block_size),
                    "kv_cache_group_block_sizes": [
                        int(g.kv_cache_spec.block_size) for g in runner.kv_cache_config.kv_cache_groups
                    ],
                    "provenance": self.prefix is not None,
                }
            )

    def read(self, runner, step, attn_metadata):
        if self.groups is None:
            self._init(runner)
        if not isinstance(attn_metadata, dict):
            raise TypeError("micro-batched attention metadata (a list) is not supported")
        so, ib = step.so, runner.input_batch
        n = ib.num_reqs
        req_ids = list(ib.req_ids[:n])
        computed = ib.num_computed_tokens_cpu[:n].tolist()
        prompt = ib.num_prompt_tokens[:n].tolist()
        sched = [int(so.num_scheduled_tokens[r]) for r in req_ids]
        metas = [attn_metadata.get(layer) for _, layer in self.groups]
        kinds = tuple(c for c in (self.mamba_cls, self.gdn_cls) if c is not None)
        metas = [m if isinstance(m, kinds) else None for m in metas]
        slots_per_row, num_decodes = self._slots(metas, n)
        drills = self.session.drills
        wrapped: dict[str, list[tuple[int, int]]] = {}
        if drills.offset_wrap_bits is not None and self.stride:
            attn_metadata, wrapped = self._wrap(attn_metadata, metas, req_ids, num_decodes or 0)
        if not self.writes:
            return attn_metadata
        # prompt tokens the prefix cache supplied at (re)admission: what was computed before any step ran
        hits = {r.req_id: int(r.num_computed_tokens) for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        for j, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:
                hits[rid] = int(cached.num_computed_tokens[j])
        before = {rid: i for i, rid in enumerate(step.order_before or req_ids)}
        if num_decodes is None:  # no Mamba metadata: vLLM's fixed rule on the counts
            phases = [
                "prefill" if c == 0 else ("decode" if s == 1 and c >= p else "extend")
                for c, s, p in zip(computed, sched, prompt)
            ]
        else:
            phases = [
                "decode" if i < num_decodes else ("prefill" if c == 0 else "extend") for i, c in enumerate(computed)
            ]
        spec = runner.speculative_config is not None
        scheduled = [list(so.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids] if spec else [[]] * n
        drafts = [len(s) for s in scheduled] if spec else [None] * n
        # the drafts verified, as scheduled; under async scheduling the scheduler only holds placeholders
        # (-1s, vllm/v1/core/sched/async_scheduler.py:18): null until `accepted` reads the runner's own
        if getattr(runner, "use_async_scheduling", False):
            scheduled = [[]] * n
        if spec:  # a decode row with drafts takes the verify path (the built-in engine's phase name)
            phases = ["verify" if d and ph == "decode" else ph for d, ph in zip(drafts, phases)]
        preempted = sorted(so.preempted_req_ids or ())
        k, m = len(preempted), len(preempted) + n
        # columns, not row dicts: a step costs a few list operations, and a part one Arrow conversion
        cols = {
            "step": [step.index] * m,
            "request_id": preempted + req_ids,
            "phase": [None] * k + phases,
            "num_computed_tokens": [0] * k + computed,
            "num_scheduled_tokens": [0] * k + sched,
            "state_slot": [None] * k + [s[0] if s else None for s in slots_per_row],
            "batch_size": [n] * m,
            "batch_tokens": [int(so.total_num_scheduled_tokens)] * m,
            "preempted": [True] * k + [False] * n,
            "vllm_request_id": preempted + req_ids,
            "batch_index": [None] * k + list(range(n)),
            "reordered": [False] * k + [before.get(rid, i) != i for i, rid in enumerate(req_ids)],
            "num_prompt_tokens": [0] * k + prompt,
            "prefix_cache_hit_tokens": [0] * k + [hits.get(r, 0) for r in req_ids],
            "state_slots": [[]] * k + slots_per_row,
            "num_draft_tokens": [None] * k + drafts,
            "num_accepted_tokens": [None] * m,  # after sampling (`accepted`)
            "spec_sampled": [None] * k + [bool(ib.temperature_cpu[i] > 0) if d else None for i, d in enumerate(drafts)],
            "draft_token_ids": [None] * k + [s or None for s in scheduled],
            "draft_token_probs": [None] * m,  # null (one-hot) unless `accepted` finds the sampler's q
        }
        if self.prefix is not None:
            gid = self.groups[0][0]
            tables = [list(runner.requests[r].block_ids[gid]) for r in req_ids]
            first = [s[0] if s else None for s in slots_per_row]
            prefix = self.prefix.columns(step.index, so, req_ids, computed, sched, first, tables, hits)
            for name, values in prefix.items():
                cols[name] = [0 if name == "prefix_cache_hit_tokens" else None] * k + values
            if drills.prefix:
                self.session.recorder.add_rows("faults", drills.observe_prefix(step.index, req_ids, prefix))
        rec = self.session.recorder
        step.rows, step.row_ids = cols, req_ids
        if not spec:
            self.emit(step)
        if drills.any:
            rows = [dict(zip(cols, values)) for values in zip(*cols.values())]
            owners = self._owners(runner) if wrapped else {}
            rec.add_rows("faults", drills.observe(step.index, rows, set(preempted), self.used_blocks, wrapped, owners))
            if drills.stale_state:
                for rid in req_ids:
                    for blocks in runner.requests[rid].block_ids:
                        self.used_blocks.update(blocks)
        return attn_metadata

    def accepted(self, step, runner, sampled) -> None:
        """Fill the step's accepted counts from the sampler's [rows, 1 + K] token ids (-1: a rejected or
        absent position) and send its rows on. Rows are the input batch's, in the order read() saw
        (nothing reorders the batch between the forward pass and sampling); a batch that no longer
        matches keeps its counts null."""
        cols = step.rows
        if cols is None:
            return
        ids = step.row_ids
        if list(runner.input_batch.req_ids[: len(ids)]) == ids and int(sampled.shape[0]) >= len(ids):
            valid = (sampled[: len(ids)] != -1).sum(dim=1).tolist()
            k = len(cols["request_id"]) - len(ids)  # preemption rows come first
            for i, d in enumerate(cols["num_draft_tokens"][k:]):
                if d:  # the first valid id is the target's own token, the rest accepted drafts
                    cols["num_accepted_tokens"][k + i] = max(int(valid[i]) - 1, 0)
            if "draft_token_ids" in cols:
                rows = [(k + i, rid, d) for i, (rid, d) in enumerate(zip(ids, cols["num_draft_tokens"][k:])) if d]
                if rows and getattr(runner, "use_async_scheduling", False):
                    self._device_drafts(runner, rows, cols["draft_token_ids"])
                if rows:
                    self._draft_probs(runner, rows, cols)
        self.emit(step)

    @staticmethod
    def _device_drafts(runner, rows, out) -> None:
        """Async scheduling: this step's real drafts, from the runner's last proposal (rows by the previous
        batch's `prev_req_id_to_index`, as `_prepare_input_ids` scatters them, gpu_model_runner.py:1853-1873);
        one small device copy after the sampler's own sync. Left null when the runner holds none."""
        import torch

        proposed = getattr(runner, "_draft_token_ids", None)
        prev = getattr(runner.input_batch, "prev_req_id_to_index", None) or {}
        if not torch.is_tensor(proposed) or any(rid not in prev for _, rid, _ in rows):
            return
        host = proposed[torch.tensor([prev[rid] for _, rid, _ in rows], device=proposed.device)].tolist()
        for (j, _, d), ids in zip(rows, host):
            out[j] = [int(t) for t in ids[:d]]

    @staticmethod
    def _draft_probs(runner, rows, cols) -> None:
        """q_i(d_i) as the rejection sampler read it. It is given draft probabilities only through
        `_get_spec_decode_draft_probs` (gpu_model_runner.py:3459, 4719-4746): None unless the last proposal
        set `_draft_probs` (only a drafter with `take_last_draft_probs`, gpu_model_runner.py:5019-5023;
        `propose_draft_token_ids` clears it first, :4764-4765, and the n-gram branch, :4766, never sets it),
        or when a drafted row has no cached row (:4731-4738, vLLM's own fallback). None reads every draft as
        q = 1 (rejection_sampler.py:871-872): the column stays null (one-hot), as it does for every n-gram
        step. Otherwise one gather of [rows x K] values from the [requests, K, vocab] tensor; a padded
        draft (-1, rejected without reading q, rejection_sampler.py:864) gets a null element."""
        import torch

        q, qids = getattr(runner, "_draft_probs", None), getattr(runner, "_draft_prob_req_ids", None)
        if q is None or qids is None:
            return
        at = {rid: i for i, rid in enumerate(qids)}
        drafts = [cols["draft_token_ids"][j] for j, _, _ in rows]
        if any(rid not in at for _, rid, _ in rows) or any(ids is None for ids in drafts):
            return  # vLLM falls back to q = 1 itself; drafts unknown: q cannot be read (left null)
        r, p, t = [], [], []
        for (_, rid, _), ids in zip(rows, drafts):
            for pos, tok in enumerate(ids):
                r.append(at[rid]), p.append(pos), t.append(max(int(tok), 0))
        dev = q.device
        vals = q[torch.tensor(r, device=dev), torch.tensor(p, device=dev), torch.tensor(t, device=dev)].tolist()
        i = 0
        for (j, _, _), ids in zip(rows, drafts):
            cols["draft_token_probs"][j] = [
                float(v) if tok >= 0 else None for v, tok in zip(vals[i : i + len(ids)], ids)
            ]
            i += len(ids)

    def emit(self, step) -> None:
        if step.rows is not None:
            self.session.recorder.add("trace", step.rows)
            step.rows = None

    def _slots(self, metas, n):
        """Per row, the state slot of every Mamba group; and the metadata's decode count."""
        live = [m for m in metas if m is not None]
        if not live:
            return [[] for _ in range(n)], None
        num_decodes = int(live[0].num_decodes) + int(getattr(live[0], "num_spec_decodes", 0))
        per_group = []
        for m in live:
            if hasattr(m, "non_spec_state_indices_tensor"):
                per_group.append(_gdn_slots(m, n))
                continue
            d = m.state_indices_tensor_d[: m.num_decodes, 0].tolist() if m.num_decodes else []
            p = m.state_indices_tensor_p[: m.num_prefills].tolist() if m.num_prefills else []
            per_group.append([int(s) for s in d + p])
        return [[g[i] if i < len(g) else None for g in per_group] for i in range(n)], num_decodes

    def _wrap(self, attn_metadata, metas, req_ids, num_decodes):
        """Swap each prefill row's slot for the one its wrapped offset points at, per Mamba group."""
        import torch

        drills, stride = self.session.drills, self.stride
        wrapped: dict[str, list[tuple[int, int]]] = {}
        replaced = {}
        for m in metas:
            if m is None or not hasattr(m, "state_indices_tensor_p") or not m.num_prefills or id(m) in replaced:
                continue
            idx = m.state_indices_tensor_p[: m.num_prefills].tolist()
            new = [drills.wrapped_slot(s, stride) if s * stride >= (1 << drills.offset_wrap_bits) else s for s in idx]
            if new == idx:
                replaced[id(m)] = m
                continue
            for j, (s, t) in enumerate(zip(idx, new)):
                if s != t:
                    wrapped.setdefault(req_ids[num_decodes + j], []).append((int(s), int(t)))
            tensor = torch.tensor(new, dtype=m.state_indices_tensor_p.dtype, device=m.state_indices_tensor_p.device)
            replaced[id(m)] = dataclasses.replace(m, state_indices_tensor_p=tensor)
        if not wrapped:
            return attn_metadata, wrapped
        return {k: replaced.get(id(v), v) for k, v in attn_metadata.items()}, wrapped

    def _owners(self, runner) -> dict[int, str]:
        """block -> the live request holding it, in any KV-cache group: the groups share one block
        pool and each cache tensor is shared by one layer of every group, so a state write into
        block b lands in whatever b holds now, a Mamba state or attention keys and values."""
        owners = {}
        for rid, state in runner.requests.items():
            for blocks in state.block_ids:
                for b in blocks:
                    owners[int(b)] = rid
        return owners


def _gdn_slots(m, n: int) -> list[int | None]:
    """Each row's state slot under Gated DeltaNet's metadata (`v1/attention/backends/gdn_attn.py`, `build`),
    in batch order: without speculation `non_spec_state_indices_tensor` is every row's (block table column
    0); with it, a speculating row's is its `spec_state_indices_tensor` row's column 0 (the slot its verify
    starts from) and the others' follow in `non_spec_state_indices_tensor`, in batch order."""
    masks = m.spec_sequence_masks_cpu
    spec = m.spec_state_indices_tensor[:, 0].tolist() if m.spec_state_indices_tensor is not None else []
    rest = m.non_spec_state_indices_tensor.tolist() if m.non_spec_state_indices_tensor is not None else []
    if masks is None:
        return [int(s) for s in rest[:n]]
    out, si, ri = [], 0, 0
    for speculating in masks.tolist()[:n]:
        src, at = (spec, si) if speculating else (rest, ri)
        out.append(int(src[at]) if at < len(src) else None)
        si, ri = (si + 1, ri) if speculating else (si, ri + 1)
    return out
