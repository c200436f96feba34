"""The built-in engine's scheduler, alone: pure Python, no torch, no model."""

import subprocess
import sys

from lpf.builtin.config import EngineConfig
from lpf.builtin.request import Request
from lpf.builtin.sched_output import Sample
from lpf.builtin.scheduler import Scheduler
from lpf.builtin.state_cache import SlotPool
from lpf.core.sampling import SamplingParams


def _req(i, prompt_len=10, max_tokens=4):
    return Request(
        f"r{i}", list(range(3, 3 + prompt_len)), SamplingParams(), max_tokens, seed=i, eos_token_id=None, seq=i
    )


def _finish_step(sched, out, token=7):
    sampled = {s.request_id: Sample(token, -0.1, [], []) for s in out.scheduled if s.will_sample}
    return sched.update(out, sampled)


def test_scheduler_module_never_imports_torch():
    code = (
        "import sys, lpf.builtin.scheduler, lpf.builtin.sched_output, lpf.builtin.request, "
        "lpf.builtin.kv_cache, lpf.builtin.state_cache; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_token_budget_chunked_prefill_and_imposter_budget():
    cfg = EngineConfig(max_num_batched_tokens=13, block_size=4, enable_chunked_prefill=True)
    s = Scheduler(cfg, num_slots=8, num_blocks=64)
    for i in range(3):
        s.add(_req(i, prompt_len=6))
    out = s.schedule()
    # 6 + 6 + the last 1 token of budget goes to the third, new request
    assert [(x.request_id, x.num_scheduled_tokens, x.num_computed_tokens) for x in out.scheduled] == [
        ("r0", 6, 0),
        ("r1", 6, 0),
        ("r2", 1, 0),
    ]
    assert [x.will_sample for x in out.scheduled] == [True, True, False]
    _finish_step(s, out)
    out = s.schedule()
    # two decodes (1 token each) and the rest of r2's prompt
    assert [(x.request_id, x.num_scheduled_tokens, x.num_computed_tokens) for x in out.scheduled] == [
        ("r0", 1, 6),
        ("r1", 1, 6),
        ("r2", 5, 1),
    ]
    assert out.total_tokens <= 13


def test_no_chunking_waits_for_room():
    cfg = EngineConfig(max_num_batched_tokens=13, block_size=4, enable_chunked_prefill=False)
    s = Scheduler(cfg, num_slots=8, num_blocks=64)
    for i in range(3):
        s.add(_req(i, prompt_len=6))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["r0", "r1"]


def test_preemption_by_recompute_when_blocks_run_out():
    cfg = EngineConfig(max_num_batched_tokens=64, block_size=4)
    s = Scheduler(cfg, num_slots=8, num_blocks=6)  # 24 tokens of KV in all
    for i in range(2):
        s.add(_req(i, prompt_len=8, max_tokens=12))
    preempted, finished, steps = [], [], 0
    while s.has_unfinished() and steps < 200:
        out = s.schedule()
        preempted += out.preempted
        # never more blocks handed out than exist, never a slot shared
        held = [b for r in s.running for b in r.block_table]
        assert len(held) == len(set(held)) <= 6
        slots = [r.state_slot for r in s.running]
        assert len(slots) == len(set(slots))
        finished += _finish_step(s, out)
        steps += 1
    assert preempted == ["r1"] or "r1" in preempted
    assert sorted(r.request_id for r in finished) == ["r0", "r1"]
    assert all(len(r.output_token_ids) == 12 for r in finished)
    r1 = next(r for r in finished if r.request_id == "r1")
    assert r1.num_preemptions >= 1


def test_slot_pool_sweeps_upward_before_reuse():
    pool = SlotPool(5)
    got = []
    for _ in range(12):
        slot = pool.allocate()
        got.append(slot)
        pool.free(slot)
    assert got == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert pool.ever_used == {0, 1, 2, 3, 4}


def test_request_that_can_never_fit_is_rejected_not_hung():
    cfg = EngineConfig(block_size=4)
    s = Scheduler(cfg, num_slots=2, num_blocks=2)
    assert "raise --cache-mb" in s.why_never_runs(_req(0, prompt_len=8, max_tokens=4))
    assert s.why_never_runs(_req(0, prompt_len=4, max_tokens=4)) is None


def test_no_chunking_refuses_what_one_step_can_never_hold():
    """Without chunked prefill a request needs prompt + outputs (after a recompute) in one step: one
    that cannot get them would wait forever, so it is refused when added."""
    s = Scheduler(
        EngineConfig(block_size=4, max_num_batched_tokens=16, enable_chunked_prefill=False), num_slots=2, num_blocks=64
    )
    assert "max_num_batched_tokens is 16" in s.why_never_runs(_req(0, prompt_len=14, max_tokens=4))
    assert s.why_never_runs(_req(0, prompt_len=12, max_tokens=4)) is None


def test_max_model_len_caps_outputs_and_refuses_a_prompt_with_no_room():
    """The context limit (the model's, or max_model_len below it): outputs stop there with "length",
    a request never needs more KV than the context, and a prompt that fills it is refused when added."""
    s = Scheduler(EngineConfig(block_size=4), num_slots=2, num_blocks=2, max_context=8)
    assert "no room for an output in a 8-token context" in s.why_never_runs(_req(0, prompt_len=8, max_tokens=1))
    req = _req(1, prompt_len=5, max_tokens=100)  # 105 tokens uncapped: more than the 8-token cache
    assert s.why_never_runs(req) is None
    s.add(req)
    while s.has_unfinished():
        _finish_step(s, s.schedule())
    assert len(req.output_token_ids) == 3 and req.finish_reason == "length"


# --- prefix caching: the chunk alignment rules (align mode), one test per rule ----------------------

from lpf.builtin import chunk_align  # noqa: E402


def test_align_a_chunk_that_does_not_finish_ends_on_the_last_boundary_it_reaches():
    # 100-token prompt, 16-token Mamba blocks: a 40-token budget from 0 stops at 32, from 32 at 64
    assert chunk_align.aligned_chunk(0, 40, 100, 100, 16, max_chunk=64) == 32
    assert chunk_align.aligned_chunk(32, 40, 100, 100, 16, max_chunk=64) == 32


def test_align_a_chunk_that_reaches_no_boundary_waits_unless_a_block_never_fits_one_step():
    assert chunk_align.aligned_chunk(32, 10, 100, 100, 16, max_chunk=64) == 0  # wait for budget
    # a block wider than one step's budget: advance inside it (and end on its boundary later)
    assert chunk_align.aligned_chunk(0, 10, 100, 100, 64, max_chunk=10) == 10
    assert chunk_align.aligned_chunk(60, 10, 100, 100, 64, max_chunk=10) == 4  # mid-block start: stop at 64


def test_align_the_last_chunk_is_exempt_but_stops_where_a_resend_can_hit():
    # the whole 50-token prompt in one step: it stops at 48 = (50 - 1) // 16 * 16, then finishes
    assert chunk_align.aligned_chunk(0, 50, 50, 50, 16, max_chunk=64) == 48
    assert chunk_align.aligned_chunk(48, 2, 50, 50, 16, max_chunk=64) == 2
    # decodes and recomputes past the prompt are left alone / aligned like a prompt
    assert chunk_align.aligned_chunk(50, 1, 50, 51, 16, max_chunk=64) == 1
    assert chunk_align.aligned_chunk(0, 40, 50, 60, 16, max_chunk=64) == 32


def test_pre_fix_rule_accepts_any_chunk_end_past_the_backed_off_last_cache_position():
    """vLLM #45477 / #51113: with EAGLE's prune, last_cache_position of a 40-token prompt is 16: a chunk
    from 16 may end at 30, mid-block (the honest rule waits, or stops at 32)."""
    assert chunk_align.pre_fix_chunk(16, 14, 40, 40, 16, max_chunk=64) == 14
    assert chunk_align.aligned_chunk(16, 14, 40, 40, 16, max_chunk=64) == 0
    assert chunk_align.pre_fix_chunk(0, 20, 40, 40, 16, max_chunk=64) == 16  # the forced stop at last_cache_position
    assert chunk_align.pre_fix_chunk(0, 20, 20, 20, 16, max_chunk=64) == 20  # under two blocks: no alignment at all


def test_pre_fix_rule_advances_inside_a_block_wider_than_a_step_without_stopping_at_its_boundary():
    """A 7-token budget and 16-token blocks: the old rule would give 0 tokens forever below
    last_cache_position; it advances as the fixed rule does, but a chunk from 14 runs on to 21
    (across the boundary at 16) where #51113's fix stops it at 16."""
    assert chunk_align.pre_fix_chunk(0, 7, 100, 100, 16, max_chunk=7) == 7
    assert chunk_align.pre_fix_chunk(14, 7, 100, 100, 16, max_chunk=7) == 7
    assert chunk_align.aligned_chunk(14, 7, 100, 100, 16, max_chunk=7) == 2
    # a budget shared this step, in an engine whose step could hold a block: waits, as before
    assert chunk_align.pre_fix_chunk(0, 7, 100, 100, 16, max_chunk=48) == 0


# --- prefix caching: the scheduler and the cache, with a stand-in for the runner's writes -----------

from lpf.builtin.faults import FaultSet  # noqa: E402
from lpf.builtin.sched_output import StateWrite  # noqa: E402


def _caching(mamba_block_size=16, faults="", budget=64, **kw):
    cfg = EngineConfig(
        max_num_batched_tokens=budget, block_size=8, enable_prefix_caching=True, mamba_block_size=mamba_block_size, **kw
    )
    truth = []
    s = Scheduler(
        cfg, num_slots=16, num_blocks=64, faults=FaultSet.parse(faults), record=lambda *a, **k: truth.append((a, k))
    )
    return s, truth


def _tokens(n, start=3):
    return [start + i % 40 for i in range(n)]


def _cached_req(i, tokens, max_tokens=2):
    return Request(f"r{i}", list(tokens), SamplingParams(), max_tokens, seed=i, eos_token_id=None, seq=i)


def _step(sched, out=None):
    """Run one scheduled step as an honest runner would report it: each request's own slot and every
    checkpoint it was asked to save hold its state after the positions written."""
    out = out or sched.schedule()
    writes = []
    for s in out.scheduled:
        end = s.num_computed_tokens + s.num_scheduled_tokens
        writes.append(StateWrite(s.state_slot, s.request_id, end))
        writes += [StateWrite(slot, s.request_id, pos) for pos, slot in s.state_writes]
    reads = {}
    for s in out.scheduled:
        if s.resume_tokens:
            idx = (s.resume_tokens - 1) // sched.prefix.mbs
            reads[s.request_id] = (idx, dict(s.state_table).get(idx))
    sampled = {s.request_id: Sample(7, -0.1, [], []) for s in out.scheduled if s.will_sample}
    return out, sched.update(out, sampled, state_writes=writes, resume_reads=reads)


def _drain(sched):
    finished = []
    while sched.has_unfinished():
        finished += _step(sched)[1]
    return finished


def test_a_hit_resumes_from_the_deepest_boundary_every_layer_group_hits():
    s, truth = _caching()
    shared = _tokens(40)
    s.add(_cached_req(0, shared + [90, 91]))
    _drain(s)
    # 40 shared tokens: attention hits 5 blocks (40 tokens), the deepest Mamba checkpoint inside is 32
    s.add(_cached_req(1, shared + [92, 93, 94]))
    out, _ = _step(s)
    (r1,) = out.scheduled
    assert r1.num_computed_tokens == 32 and r1.resume_tokens == 32
    assert dict(r1.state_table)[1] is not None  # Mamba block 1 ends at 32: the checkpoint it reads
    assert s.prefix.stats["hits"] == 1 and s.prefix.stats["hit_tokens"] == 32 and not truth


def test_an_exact_resend_leaves_one_token_to_compute():
    s, _ = _caching()
    prompt = _tokens(48)
    s.add(_cached_req(0, prompt))
    _drain(s)
    s.add(_cached_req(1, prompt))
    out, _ = _step(s)
    # a hit is capped at 47 tokens: the deepest boundary there is 32 (48 itself is never a hit)
    assert out.scheduled[0].resume_tokens == 32


def test_a_hash_is_published_only_once_its_state_is_written():
    s, _ = _caching()
    s.add(_cached_req(0, _tokens(40)))
    out = s.schedule()  # scheduled, not run: nothing of it may be found yet
    s.add(_cached_req(1, _tokens(40) + [99]))
    assert s.prefix.lookup(s.waiting[0]).tokens == 0
    _step(s, out)  # ran and committed: its checkpoints at 16 and 32 are published
    assert s.prefix.lookup(s.waiting[0]).tokens == 32


def test_a_request_aborted_in_flight_publishes_nothing():
    s, _ = _caching()
    s.add(_cached_req(0, _tokens(40)))
    s.schedule()
    s.abort("r0", in_flight=True)
    assert s.slots.num_free == 16 and s.blocks.num_free == 64 and not s.slots.by_hash and not s.blocks.by_hash


def test_publish_before_write_publishes_at_schedule_time_and_an_abort_leaves_it_unwritten():
    """vLLM #56525: the drill publishes when the chunk is scheduled; the abort leaves the hash naming a
    state never written, and a retry resumes from it (recorded as corrupted)."""
    s, truth = _caching(faults="publish-before-write")
    s.add(_cached_req(0, _tokens(40)))
    s.schedule()
    assert s.slots.by_hash  # published before the chunk ran
    s.abort("r0", in_flight=True)
    s.add(_cached_req(1, _tokens(40)))
    out, _ = _step(s)
    assert out.scheduled[0].resume_tokens == 32
    assert [(a[0], a[2]) for a, _ in truth] == [("r1", "publish-before-write")]


def test_chunk_ends_stay_on_mamba_boundaries_when_checkpoints_are_due():
    s, _ = _caching(budget=20)
    s.add(_cached_req(0, _tokens(60)))
    ends = []
    while s.has_unfinished():
        out, _ = _step(s)
        ends += [x.num_computed_tokens + x.num_scheduled_tokens for x in out.scheduled]
    # 20 tokens of budget: chunks end at 16, 32, 48 (the deepest boundary a resend can hit), then 60
    assert ends[:4] == [16, 32, 48, 60]


def test_a_step_that_can_schedule_nothing_raises_instead_of_hanging(monkeypatch):
    """The pre-fix chunk rule before it learned the sub-block advance gave a 7-token budget 0 tokens
    below last_cache_position forever (found by lpf shrink, which then hung): the scheduler says so."""
    import pytest

    from conftest import pre_fix_chunk_without_the_advance
    from lpf.builtin.scheduler import SchedulerStallError

    sched, _ = _caching(faults="unaligned-chunk-hashed", budget=7)
    sched.add(_cached_req(0, _tokens(100)))
    _step(sched)  # the honest advance: 7 tokens of the 100-token prompt
    monkeypatch.setattr(chunk_align, "pre_fix_chunk", pre_fix_chunk_without_the_advance)
    with pytest.raises(SchedulerStallError, match="no progress: 0 waiting, 1 running, none schedulable in a 7-token"):
        sched.schedule()
