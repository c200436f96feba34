"""Per-request candidate features for mechanism ranking, from the trace and request metadata.

Contract: `request_features(requests, trace, engine_info) -> list[Feature]`, every feature's values
aligned to `requests` sorted by `seq` (the order of `summary.parquet`). Pure: tables and the
manifest's engine section in, numpy out; never reads fault ground truth. Features that need the
trace are simply absent when the engine wrote none. Each feature carries the words its hypothesis
sentence uses: a boolean says what the request did ("started with a decode step"), a numeric names
its quantity ("state slot id") and is split at the best threshold by `hypotheses`.

From the trace (first = the request's first scheduled, non-preempted step):
  first_phase_decode        first step classified as a decode
  first_decode_uncomputed   ... with num_computed_tokens == 0 (nothing could be in its state yet)
  admitted_as_decode        any step of it ran as a decode with num_computed_tokens == 0: its admission
                            or a readmission after a preemption (recompute starts from nothing again)
  first_slot_used_before    its first state slot had been used by another request before
  first_step_one_token      its first step was given 1 token of budget
  first_batch_mixed         its first step's batch mixed decodes with prefills/extends
  chunked_prefill           its prompt was prefilled in more than one chunk (an extend step)
  prefill_padded            a prefill/extend chunk of it was shorter than another of the same step (an
                            engine that scans a step's chunks as one right-padded batch padded it)
  preempted                 it was preempted (recomputed) at least once
  slot_offset_over_2^31/32  slot * state_slot_stride (elements, and bytes when the dtype is known)
                            reached 2^31 / 2^32 on a prefill/extend (the seed's 32-bit overflow)
  slot_offset_over_wrap     ... reached 2^BITS when the engine info says offsets wrap there
                            (`state_offset_wrap_bits`)
  max_state_slot, first_batch_size, max_batch_size, first_batch_decode_share, n_prefill_chunks
From vLLM's trace (lpf-vllm-trace's columns, present only there):
  first_step_reordered      the batch reorder moved its row on its first step
From the prefix-cache columns (any engine that fills them: the built-in engine, vLLM's plugin,
llama.cpp's timings.cache_n): `prefix_features` (prefix_cache_hit and the provenance of restored states).
From the trace's write log (`write_features`, engines that keep one: the built-in engine):
  state_overwritten, state_write_strayed (another request's state write landed in its slot; its own
  landed outside it).
From the speculative-decoding columns (`speculative_features`, the built-in engine with speculation on):
  prompt_on_verify_path, state_kept_rejected_drafts, state_rolled_back_wrong, sampled_spec_batch_over_2,
  speculated.
From the flagged requests' tokens (`onset_features`, joined by `findings` as signatures): positional_onset,
collapsed_to_one_token.
From the requests: prompt_length, rollout, seq (arrival index): `descriptive` (what a request is, not
what the engine did to it).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.feature import Feature
from lpf.analysis.prefix_features import prefix_features
from lpf.analysis.speculative_features import spec_features
from lpf.analysis.verdicts import by_arrival
from lpf.analysis.write_features import write_features

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _prompt_lengths(req: pa.Table) -> np.ndarray:
    return pc.list_value_length(req.column("prompt_token_ids")).to_numpy(zero_copy_only=False).astype(np.float64)


def request_features(requests: pa.Table, trace: pa.Table | None, engine_info: dict | None = None) -> list[Feature]:
    req = by_arrival(requests)
    feats = [
        Feature("prompt_length", "numeric", _prompt_lengths(req), "prompt length (tokens)", descriptive=True),
        Feature(
            "rollout",
            "numeric",
            req.column("rollout").to_numpy(zero_copy_only=False).astype(np.float64),
            "rollout index",
            descriptive=True,
        ),
        Feature("seq", "numeric", req.column("seq").to_numpy().astype(np.float64), "arrival index", descriptive=True),
    ]
    if trace is not None and trace.num_rows:
        feats += _trace_features(req, trace, engine_info or {})
        feats += _vllm_trace_features(req, trace)
        feats += prefix_features(req, trace, engine_info)
        feats += write_features(req, trace)
        feats += spec_features(req, trace)
    return feats


def _vllm_trace_features(req: pa.Table, trace: pa.Table) -> list[Feature]:
    """Features from the columns only vLLM's trace has (absent elsewhere: no features)."""
    if "reordered" not in trace.column_names:
        return []
    ids = req.column("request_id")
    t = trace.filter(pc.invert(trace.column("preempted").fill_null(False))).sort_by([("step", "ascending")])
    # each request's first row: the first occurrence in step order
    code = pc.index_in(t.column("request_id"), value_set=ids).fill_null(-1).to_numpy(zero_copy_only=False)
    reordered = t.column("reordered").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    first_reordered = np.zeros(req.num_rows, dtype=bool)
    seen, idx = np.unique(code, return_index=True)
    keep = seen >= 0
    first_reordered[seen[keep]] = reordered[idx[keep]]
    return [
        Feature("first_step_reordered", "bool", first_reordered, "were moved by the batch reorder on their first step")
    ]


def _offset_wrap_bits(engine_info: dict) -> int | None:
    """The engine's declared prefill state-offset width, when it computes offsets modulo 2^BITS (the
    offset-wrap drill says so through the engine info: `drill_catalog`'s facts, never its name)."""
    bits = engine_info.get("state_offset_wrap_bits")
    return int(bits) if bits is not None else None


def _trace_features(req: pa.Table, trace: pa.Table, engine_info: dict) -> list[Feature]:
    n = req.num_rows
    ids = req.column("request_id")
    t = trace.filter(pc.invert(trace.column("preempted").fill_null(False)))
    t = t.sort_by([("step", "ascending")])
    code = pc.index_in(t.column("request_id"), value_set=ids).fill_null(-1).to_numpy(zero_copy_only=False)
    keep = code >= 0
    code = code[keep].astype(np.int64)
    step = t.column("step").to_numpy()[keep]
    phase = t.column("phase").fill_null("").to_numpy(zero_copy_only=False)[keep]
    computed = t.column("num_computed_tokens").to_numpy(zero_copy_only=False)[keep]
    sched = t.column("num_scheduled_tokens").to_numpy(zero_copy_only=False)[keep]
    slot = t.column("state_slot").fill_null(-1).to_numpy(zero_copy_only=False)[keep].astype(np.int64)
    bsize = t.column("batch_size").to_numpy(zero_copy_only=False)[keep].astype(np.float64)

    # first row per request (rows are in step order, so the first occurrence of each code)
    has = np.zeros(n, dtype=bool)
    first = np.full(n, -1, dtype=np.int64)
    uniq, idx = np.unique(code, return_index=True)
    first[uniq] = idx
    has[uniq] = True
    fi = first[has]

    def at_first(values, fill):
        out = np.full(n, fill, dtype=np.asarray(values).dtype if np.asarray(values).dtype != object else object)
        out[has] = values[fi]
        return out

    is_decode = phase == "decode"
    first_decode = at_first(is_decode, False).astype(bool)
    first_uncomputed = first_decode & (at_first(computed, 1) == 0)
    first_one = at_first(sched, 0) == 1
    # was the first slot used by another request at an earlier step? (any row counts: an attempt the
    # run did not keep, e.g. one its client cancelled, used its slot too)
    slot_first_step = {}
    all_slot = t.column("state_slot").fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    all_step = t.column("step").to_numpy()
    order = np.argsort(all_slot, kind="stable")
    s_sorted, st_sorted = all_slot[order], all_step[order]
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
    for s0, i in zip(s_sorted[starts], starts):
        slot_first_step[int(s0)] = int(st_sorted[i])
    fslot, fstep = at_first(slot, -1), at_first(step, -1)
    used_before = np.array(
        [has[i] and fslot[i] >= 0 and slot_first_step.get(int(fslot[i]), 1 << 62) < fstep[i] for i in range(n)],
        dtype=bool,
    )
    # batch composition per step
    ustep, sinv = np.unique(step, return_inverse=True)
    dec_per_step = np.bincount(sinv, weights=is_decode.astype(np.float64))
    rows_per_step = np.bincount(sinv).astype(np.float64)
    mixed_step = (dec_per_step > 0) & (dec_per_step < rows_per_step)
    share_step = dec_per_step / rows_per_step
    first_mixed = at_first(mixed_step[sinv], False).astype(bool)
    first_share = at_first(share_step[sinv], np.nan)

    def per_request(values, op, fill):
        out = np.full(n, fill, dtype=np.float64)
        order = np.argsort(code, kind="stable")
        c, v = code[order], values[order].astype(np.float64)
        if c.size:
            st = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
            out[c[st]] = op.reduceat(v, st)
        return out

    prefill_like = (phase == "prefill") | (phase == "extend")
    n_chunks = per_request(prefill_like.astype(np.float64), np.add, 0.0)
    # a chunk shorter than another prefill/extend chunk of its step: right-padded to it in a batched scan
    chunk_len = np.where(prefill_like, sched, 0).astype(np.float64)
    step_longest = np.zeros(len(ustep))
    np.maximum.at(step_longest, sinv, chunk_len)
    padded = per_request((prefill_like & (chunk_len < step_longest[sinv])).astype(np.float64), np.maximum, 0.0) > 0
    # any (re)admission run as a decode: a preempted request is admitted again with nothing computed,
    # and its first step then is the same trap as a new request's
    admitted_decode = per_request((is_decode & (computed == 0)).astype(np.float64), np.maximum, 0.0) > 0
    max_slot = per_request(slot.astype(np.float64), np.maximum, np.nan)
    max_prefill_slot = per_request(np.where(prefill_like, slot, -1).astype(np.float64), np.maximum, np.nan)
    max_batch = per_request(bsize, np.maximum, np.nan)
    all_rows = trace.filter(pc.is_in(trace.column("request_id"), value_set=ids))
    preempted_ids = all_rows.filter(all_rows.column("preempted").fill_null(False)).column("request_id")
    preempted = (
        pc.is_in(ids, value_set=pc.unique(preempted_ids)).to_numpy(zero_copy_only=False)
        if len(preempted_ids)
        else np.zeros(n, dtype=bool)
    )

    cache = engine_info.get("cache") or {}
    stride = cache.get("state_slot_stride") or engine_info.get("state_slot_stride")
    feats = [
        Feature(
            "first_decode_uncomputed",
            "bool",
            first_uncomputed,
            "started with a decode step while num_computed_tokens was 0",
        ),
        Feature("first_phase_decode", "bool", first_decode, "started with a decode step"),
        Feature(
            "admitted_as_decode",
            "bool",
            admitted_decode & has,
            "ran a step as a decode while num_computed_tokens was 0 (at admission or readmission after a preemption)",
        ),
        Feature(
            "first_slot_used_before", "bool", used_before & has, "started on a state slot an earlier request had used"
        ),
        Feature("first_step_one_token", "bool", first_one & has, "got 1 token of budget on their first step"),
        Feature("first_batch_mixed", "bool", first_mixed & has, "started in a batch mixing decodes and prefills"),
        Feature("chunked_prefill", "bool", (n_chunks > 1) & has, "had its prompt prefilled in several chunks"),
        Feature(
            "prefill_padded",
            "bool",
            padded & has,
            "had a prefill chunk shorter than another of its step (padded to it in a batched scan)",
        ),
        Feature("preempted", "bool", preempted, "were preempted and recomputed"),
        Feature("max_state_slot", "numeric", max_slot, "state slot id", stride=int(stride) if stride else None),
        Feature(
            "first_batch_size", "numeric", at_first(bsize, np.nan).astype(np.float64), "batch size at their first step"
        ),
        Feature("max_batch_size", "numeric", max_batch, "largest batch they ran in (concurrency)"),
        Feature(
            "first_batch_decode_share",
            "numeric",
            first_share.astype(np.float64),
            "a decode share in their first step's batch",
        ),
        Feature("n_prefill_chunks", "numeric", n_chunks, "number of prefill chunks"),
    ]
    if stride:
        offset = max_prefill_slot * float(stride)
        elem = _DTYPE_BYTES.get(str((engine_info.get("options") or {}).get("dtype") or "float32"), 4)
        for bits in (31, 32):
            feats.append(
                Feature(
                    f"slot_offset_over_2^{bits}",
                    "bool",
                    offset >= 2.0**bits,
                    f"had slot * stride >= 2^{bits} elements on a prefill",
                )
            )
            feats.append(
                Feature(
                    f"slot_byte_offset_over_2^{bits}",
                    "bool",
                    offset * elem >= 2.0**bits,
                    f"had a state byte offset (slot * stride * {elem}) >= 2^{bits} on a prefill",
                )
            )
        bits = _offset_wrap_bits(engine_info)
        if bits is not None:
            feats.append(
                Feature(
                    "slot_offset_over_wrap",
                    "bool",
                    offset >= 2.0**bits,
                    f"prefilled into a slot past the offset wrap (slot * stride >= 2^{bits}, "
                    f"slot >= {int(np.ceil(2.0**bits / stride))})",
                )
            )
    return feats
