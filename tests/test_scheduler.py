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
    return Request(f"r{i}", list(range(3, 3 + prompt_len)), SamplingParams(), max_tokens, seed=i, eos_token_id=None, seq=i)


def _finish_step(sched, out, token=7):
    sampled = {s.request_id: Sample(token, -0.1, [], []) for s in out.scheduled if s.will_sample}
    return sched.update(out, sampled)


def test_scheduler_module_never_imports_torch():
    code = ("import sys, lpf.builtin.scheduler, lpf.builtin.sched_output, lpf.builtin.request, "
            "lpf.builtin.kv_cache, lpf.builtin.state_cache; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_token_budget_chunked_prefill_and_imposter_budget():
    cfg = EngineConfig(max_num_batched_tokens=13, block_size=4, enable_chunked_prefill=True)
    s = Scheduler(cfg, num_slots=8, num_blocks=64)
    for i in range(3):
        s.add(_req(i, prompt_len=6))
    out = s.schedule()
    # 6 + 6 + the last 1 token of budget goes to the third, new request
    assert [(x.request_id, x.num_scheduled_tokens, x.num_computed_tokens) for x in out.scheduled] == \
        [("r0", 6, 0), ("r1", 6, 0), ("r2", 1, 0)]
    assert [x.will_sample for x in out.scheduled] == [True, True, False]
    _finish_step(s, out)
    out = s.schedule()
    # two decodes (1 token each) and the rest of r2's prompt
    assert [(x.request_id, x.num_scheduled_tokens, x.num_computed_tokens) for x in out.scheduled] == \
        [("r0", 1, 6), ("r1", 1, 6), ("r2", 5, 1)]
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
    s = Scheduler(EngineConfig(block_size=4, max_num_batched_tokens=16, enable_chunked_prefill=False),
                  num_slots=2, num_blocks=64)
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
