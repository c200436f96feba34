"""The patches on vLLM 0.32's V1 runner (`GPUModelRunner`, which the CPU runner inherits).

- `execute_model`: opens a step when the scheduler scheduled tokens (dummy, profile and capture runs
  call `_dummy_run`, never this, so they are never traced) and closes it whatever happens.
- `_update_states_after_model_execute` (called by `sample_tokens` with the sampler's token ids, after
  the rejection sampler): a speculating step's rows get each row's accepted drafts there and only then
  go to the recorder (`step_rows`). The count is the runner's own (`gpu_model_runner.py:1562`, what
  the Mamba kernels get as `num_accepted_tokens` next step); the scheduler derives its from the same
  ids (`len(generated) - 1`, `core/sched/scheduler.py:2118`).
- `_may_reorder_batch`: remembers the batch order before the reorder (the `reordered` column); under
  stale-state runs the pre-fix reorder instead of vLLM's.
- `_build_attention_metadata`: after vLLM built the per-layer metadata, reads off each row's phase
  (the Mamba metadata's `num_decodes` rows come first, then prefills) and its state slot (`state_
  indices_tensor_d` / `_p`) in the runner's own batch order (`input_batch.req_ids`); under
  offset-wrap, swaps the wrapped slots into the prefill indices (a new metadata object, so vLLM's
  block table is never written).
- `Scheduler.schedule` and `MambaManager.cache_blocks` (scheduler process): every Mamba state block
  whose hash vLLM's cache manager published, carried to the runner on the step's output
  (`prefix_log`); `mamba_utils.collect_mamba_copy_meta` (runner): the block column an align-mode
  resume really copied its state from. Under publish-before-write, `MambaManager` forgets the blocks
  it cached this step (`drills.forget_same_step_guard`); under unaligned-chunk-hashed the scheduler's
  block-aligned split no longer clips a prompt's inner chunks (`drills.unaligned_split`).
- `mamba_attn.split_decodes_and_prefills` (stale-state only): counts short extends as decodes and
  ignores `is_prefilling`, the split before the fix.
- with a capture (lpf locate): the model's hooks are installed at the first real step, and each step's
  batch layout is handed to it once its metadata is built (`capture.Capture.begin_step`).
Anything unexpected inside a hook stops the recording with its reason (never the engine); offset-wrap,
which acts where the rows are read, stops with it, stale-state's reorder and split stay in force.
"""

from __future__ import annotations

import threading

_tls = threading.local()  # the step being executed on this thread (engine steps are sequential)


class _Step:
    def __init__(self, index: int, scheduler_output):
        self.index = index
        self.so = scheduler_output
        self.order_before: list[str] | None = None
        self.rows: dict | None = None  # its trace columns, while they wait for the sampler (speculation)
        self.row_ids: list[str] = []


def install(session) -> None:
    from vllm.v1.attention.backends import mamba_attn
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from lpf_vllm_trace.drills import prefix_reorder
    from lpf_vllm_trace.step_rows import StepReader

    drills = session.drills
    try:  # Gated DeltaNet's metadata is its own class, not a Mamba one
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    except ImportError:
        GDNAttentionMetadata = None
    reader = StepReader(session, mamba_attn.BaseMambaAttentionMetadata, GDNAttentionMetadata)
    orig_execute = GPUModelRunner.execute_model
    orig_reorder = GPUModelRunner._may_reorder_batch
    orig_build = GPUModelRunner._build_attention_metadata
    orig_update = GPUModelRunner._update_states_after_model_execute
    counter = {"step": 0}
    pending: dict[int, _Step] = {}  # runner -> its step whose rows wait for sample_tokens (speculation)

    def execute_model(self, scheduler_output, *args, **kwargs):
        if not session.recording or not scheduler_output.total_num_scheduled_tokens:
            return orig_execute(self, scheduler_output, *args, **kwargs)
        _tls.step = _Step(counter["step"], scheduler_output)
        counter["step"] += 1
        capture = session.capture
        if capture is not None and not capture.installed:
            try:
                capture.install(self.model)
            except Exception as e:  # noqa: BLE001 - a capture bug costs the capture, never the engine
                capture.installed, capture.why = True, f"capture not installed ({type(e).__name__}: {e})"
        step = _tls.step
        try:
            return orig_execute(self, scheduler_output, *args, **kwargs)
        finally:
            _tls.step = None
            if capture is not None:
                capture.end_step()
            if step.rows is not None:
                # vLLM 0.32 samples in sample_tokens, after this returns (the forward pass parked in
                # execute_model_state); with nothing parked no sampler runs for this step
                if getattr(self, "execute_model_state", None) is not None:
                    pending[id(self)] = step
                else:
                    reader.emit(step)

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output, *args, **kwargs):
        step = pending.pop(id(self), None)
        if step is not None and session.recording:
            try:
                if step.so is scheduler_output:
                    reader.accepted(step, self, output_token_ids)
                else:
                    reader.emit(step)
            except Exception as e:  # noqa: BLE001 - a plugin bug costs the trace, never the engine
                session.stop(f"recording stopped at step {step.index}, the plugin failed ({type(e).__name__}: {e})")
        return orig_update(self, output_token_ids, scheduler_output, *args, **kwargs)

    def _may_reorder_batch(self, scheduler_output):
        step = getattr(_tls, "step", None)
        if step is not None:
            step.order_before = list(self.input_batch.req_ids)
        if (
            drills.stale_state
            and len(self.kv_cache_config.kv_cache_groups)
            and self.reorder_batch_threshold is not None
        ):
            prefix_reorder(self.input_batch, scheduler_output, self.reorder_batch_threshold)
            return None
        return orig_reorder(self, scheduler_output)

    def _build_attention_metadata(self, *args, **kwargs):
        result = orig_build(self, *args, **kwargs)
        step = getattr(_tls, "step", None)
        if step is None or kwargs.get("for_cudagraph_capture") or not session.recording:
            return result
        try:
            attn_metadata, spec_decode_metadata = result  # vLLM 0.32 returns this pair
            attn_metadata = reader.read(self, step, attn_metadata)
            if session.capture is not None:
                try:
                    session.capture.begin_step(self, step.so, attn_metadata)
                except Exception as e:  # noqa: BLE001
                    session.capture.why = f"capture stopped at step {step.index} ({type(e).__name__}: {e})"
            return attn_metadata, spec_decode_metadata
        except Exception as e:  # noqa: BLE001 - a plugin bug costs the trace, never the engine
            session.stop(f"recording stopped at step {step.index}, the plugin failed ({type(e).__name__}: {e})")
            return result

    _install_prefix(session, reader)
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._may_reorder_batch = _may_reorder_batch
    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._update_states_after_model_execute = _update_states_after_model_execute
    if drills.stale_state:
        orig_split = mamba_attn.split_decodes_and_prefills

        def split_decodes_and_prefills(
            common_attn_metadata, decode_threshold=1, require_uniform=False, treat_short_extends_as_decodes=True
        ):
            return orig_split(common_attn_metadata, decode_threshold, require_uniform, True)

        mamba_attn.split_decodes_and_prefills = split_decodes_and_prefills


def _install_prefix(session, reader) -> None:
    """The prefix-cache hooks (see the module's docstring); inert where the engine does not cache."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.worker import mamba_utils

    from lpf_vllm_trace import drills as drill_mod
    from lpf_vllm_trace import prefix_log

    drills = session.drills
    orig_schedule = Scheduler.schedule
    orig_cache = MambaManager.cache_blocks
    orig_init = MambaManager.__init__
    orig_copy = mamba_utils.collect_mamba_copy_meta
    orig_split = Scheduler._mamba_block_aligned_split

    def schedule(self, *args, **kwargs):
        out = orig_schedule(self, *args, **kwargs)
        prefix_log.attach(out)
        return out

    def cache_blocks(self, request, num_tokens, *args, **kwargs):
        before = self.num_cached_block.get(request.request_id, 0)
        result = orig_cache(self, request, num_tokens, *args, **kwargs)
        after = self.num_cached_block.get(request.request_id, 0)
        blocks = self.req_to_blocks.get(request.request_id, [])
        for idx in range(before, min(after, len(blocks))):
            b = blocks[idx]
            if not b.is_null and b.block_hash is not None:
                prefix_log.note_published(b.block_id, request.request_id, (idx + 1) * self.block_size)
        return result

    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if drills.publish_before_write:
            drill_mod.forget_same_step_guard(self)

    def collect_mamba_copy_meta(copy_bufs, kv_cache_config, funcs, group_ids, src, dst, bias, req_state, *rest, **kw):
        if reader.prefix is not None and getattr(_tls, "step", None) is not None:
            reader.prefix.note_copy(req_state.req_id, src, dst)
        return orig_copy(copy_bufs, kv_cache_config, funcs, group_ids, src, dst, bias, req_state, *rest, **kw)

    def _mamba_block_aligned_split(self, request, num_new_tokens, *args, **kwargs):
        return drill_mod.unaligned_split(orig_split, self, request, num_new_tokens, *args, **kwargs)

    Scheduler.schedule = schedule
    MambaManager.cache_blocks = cache_blocks
    MambaManager.__init__ = init
    mamba_utils.collect_mamba_copy_meta = collect_mamba_copy_meta
    if drills.unaligned_chunk:
        Scheduler._mamba_block_aligned_split = _mamba_block_aligned_split
