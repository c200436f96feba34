"""The per-step cause machinery on synthetic dumps (pure numpy, no model): a cause at a minority of steps is
found at those steps, the floor comes from the quiet steps when no dtype is recorded (or cannot be
judged), a spike step's floor is capped, and the rollout's top-p / top-k are read off d and the
reference's heads (`lpf.rl.nucleus`), checked against the torch kept mass `lpf rl rescore` stores."""

from __future__ import annotations

import numpy as np
import pytest

from lpf.rl import nucleus
from lpf.rl.cause_inputs import ExplainInputs
from lpf.rl.causes import CAUSES, explain

N_STEPS, PER_STEP, LENGTH, VOCAB = 12, 12, 16, 64


def _heads(rng, n, vocab=VOCAB, temp=None):
    """Random reference distributions: [n, vocab] probabilities (sorted descending) of varied entropy."""
    temp = rng.uniform(0.1, 1.0, n) if temp is None else temp
    z = rng.normal(0, 1, (n, vocab)) / temp[:, None]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return -np.sort(-p, axis=1)


def _kept(p_sorted, top_p=None, top_k=None):
    """vLLM's rule on sorted probabilities: top-k keeps K; top-p keeps a token while the mass before it < P."""
    cum = np.cumsum(p_sorted, 1)
    if top_k:
        return np.log(cum[:, top_k - 1])
    before = cum - p_sorted
    return np.log((p_sorted * (before < top_p)).sum(1))


def _dump(d, sens=0.5, **kw):
    n_resp = N_STEPS * PER_STEP
    resp = np.repeat(np.arange(n_resp), LENGTH)
    steps = np.repeat(np.arange(1, N_STEPS + 1), PER_STEP)
    r = np.full(resp.size, -1.0)
    base = dict(
        fmt="lpf",
        steps=steps,
        request_ids=[f"q{i}" for i in range(n_resp)],
        tok_resp=resp,
        tok_pos=np.tile(np.arange(LENGTH), n_resp),
        r=r,
        t=r + d,
        resp_unit=np.arange(n_resp),
        sensitivity=np.full(resp.size, sens),
        sensitivity_source="reference",
        floors={"rollout and trainer": None},
        estimate_floor=True,
    )
    base.update(kw)
    return ExplainInputs(**base)


def _step_shares(inp, ex):
    a = np.abs(inp.t - inp.r)
    st = inp.steps[inp.tok_resp]
    return {
        s: dict(zip(CAUSES, (ex.shares[st == s] * a[st == s, None]).sum(0) / a[st == s].sum())) for s in np.unique(st)
    }


def _spikes(bad_steps, steps):
    spike = np.isin(steps, list(bad_steps))
    return dict(spike_resp=spike, quiet_resp=~spike)


@pytest.mark.parametrize("setting", [{"top_p": 0.9}, {"top_p": 0.83}, {"top_k": 5}])
def test_the_rollouts_filter_is_read_off_d_and_the_references_heads(setting):
    rng = np.random.default_rng(0)
    n = N_STEPS * PER_STEP * LENGTH
    p = _heads(rng, n)
    cum = np.cumsum(p, 1)[:, :32].astype(np.float32)
    step = np.repeat(np.arange(N_STEPS), PER_STEP * LENGTH)
    bad = np.isin(step, [2, 6, 10])
    d = np.where(bad, _kept(p, **setting), rng.normal(0, 1e-6, n)) + rng.normal(0, 1e-6, n)
    got = nucleus.infer(d, cum, step, N_STEPS, grid=(0.8, 0.9, 0.95))
    assert got["steps"] == [2, 6, 10]
    if "top_k" in setting:
        assert got["setting"] == "top_k" and got["top_k"] == setting["top_k"]
        return
    lo, hi = got["top_p_interval"]
    assert got["setting"] == "top_p" and lo < setting["top_p"] <= hi and hi - lo < 0.02
    # 0.9 is a setting people write: reported as such; 0.83 is not on the grid: the interval's top
    assert got["top_p"] == (0.9 if setting["top_p"] == 0.9 else hi)
    lk = nucleus.log_kept(cum, got["top_p"])
    ok = np.isfinite(lk) & bad
    assert ok.mean() > 0.6 * bad.mean() and np.abs(lk[ok] - d[ok]).max() < 1e-3


def test_stored_heads_and_grid_are_what_vllms_filter_keeps():
    import torch

    from lpf.rl.row_stats import P_GRID, RowStats, log_kept_mass

    # seeded: an unseeded draw now and then put a row's cumulative mass within float32 rounding of a grid
    # p, where which side of the cut one token falls is the rounding's (seen once in three runs)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(200, 300, generator=g) * torch.rand(200, 1, generator=g) * 4
    stats = RowStats()
    stats(z, torch.zeros(200, dtype=torch.long))
    _, _, cum, grid = stats.take()
    for j, p in enumerate(P_GRID):
        want = log_kept_mass(z, 1.0, 0, p).numpy()
        np.testing.assert_allclose(grid[:, j], want, atol=2e-5)
        head = nucleus.log_kept(cum, p)
        ok = np.isfinite(head)
        np.testing.assert_allclose(head[ok], want[ok], atol=2e-5)
        np.testing.assert_allclose(nucleus.log_kept(cum, p, grid=(P_GRID, grid)), want, atol=2e-5)


def test_a_cause_at_three_of_twelve_steps_is_found_there_with_their_mass():
    rng = np.random.default_rng(1)
    n = N_STEPS * PER_STEP * LENGTH
    p = _heads(rng, n)
    lk = _kept(p, top_p=0.9)
    inp0 = _dump(np.zeros(n))
    st = inp0.steps[inp0.tok_resp]
    bad = np.isin(st, [3, 7, 11])
    d = np.where(bad, lk, 0.0) + rng.normal(0, 1e-6, n)
    inp = _dump(d, log_kept=lk, **_spikes([3, 7, 11], inp0.steps))
    ex = explain(inp)
    t = ex.tests["processed_logprobs"]
    assert t["status"] == "passed" and t["steps"] == [3, 7, 11]
    for s, sh in _step_shares(inp, ex).items():
        if s in (3, 7, 11):
            assert sh["processed_logprobs"] > 0.99, (s, sh)
        else:
            assert sh["processed_logprobs"] < 1e-6 and sh["dtype_floor"] > 0.99, (s, sh)
    assert "estimated from the dump's 9 quiet steps" in ex.tests["dtype_floor"]["detail"]


def test_growth_at_two_spike_steps_is_tested_there_against_the_quiet_steps():
    rng = np.random.default_rng(2)
    inp0 = _dump(np.zeros(N_STEPS * PER_STEP * LENGTH))
    st, pos = inp0.steps[inp0.tok_resp], inp0.tok_pos
    grow = np.isin(st, [5, 9])
    d = np.where(grow, rng.normal(0, 1, pos.size) * 0.01 * pos, 0.0) + rng.normal(0, 1e-6, pos.size)
    inp = _dump(d, **_spikes([5, 9], inp0.steps))
    ex = explain(inp)
    t = ex.tests["position_growth"]
    assert t["status"] == "passed" and t["steps"] == [5, 9]
    for s, sh in _step_shares(inp, ex).items():
        key = "position_growth" if s in (5, 9) else "dtype_floor"
        assert sh[key] > 0.95, (s, sh)


def test_without_dtypes_or_quiet_responses_the_floor_cannot_be_judged():
    rng = np.random.default_rng(3)
    n = N_STEPS * PER_STEP * LENGTH
    d = rng.normal(0, 0.05, n)
    inp = _dump(d, spike_resp=np.ones(N_STEPS * PER_STEP, bool), quiet_resp=np.zeros(N_STEPS * PER_STEP, bool))
    ex = explain(inp)
    assert ex.tests["dtype_floor"]["status"] == "cannot judge"
    assert (ex.shares[:, CAUSES.index("dtype_floor")] == 0).all()


def test_a_lenient_floor_cannot_swallow_a_spike_step():
    rng = np.random.default_rng(4)
    n = N_STEPS * PER_STEP * LENGTH
    inp0 = _dump(np.zeros(n))
    st = inp0.steps[inp0.tok_resp]
    d = np.where(st == 4, rng.normal(0, 0.02, n), rng.normal(0, 1e-4, n))
    lenient = {"token": {"median": 0.5, "q99": 2.0}, "settled": {}, "pair": "bfloat16/float32", "detail": "lenient"}
    inp = _dump(d, floors={"rollout and trainer": lenient}, estimate_floor=False, **_spikes([4], inp0.steps))
    ex = explain(inp)
    sh = _step_shares(inp, ex)
    assert sh[4]["unexplained"] > 0.9 and 4 in ex.tests["dtype_floor"]["capped_at_spike_steps"]
    assert all(sh[s]["dtype_floor"] > 0.99 for s in sh if s != 4)


def test_a_bias_at_every_step_is_no_floor_even_when_nothing_spikes():
    # every step carries the same processed-logprob offset and no reference: nothing stands out, so the
    # quiet responses are all of them, but their residual is one-sided: a bias, not rounding
    rng = np.random.default_rng(5)
    n = N_STEPS * PER_STEP * LENGTH
    d = _kept(_heads(rng, n), top_p=0.9)
    n_resp = N_STEPS * PER_STEP
    inp = _dump(d, spike_resp=np.zeros(n_resp, bool), quiet_resp=np.ones(n_resp, bool))
    ex = explain(inp)
    assert ex.tests["dtype_floor"]["status"] == "cannot judge"
    assert "one-sided" in ex.tests["dtype_floor"]["detail"]
    assert (ex.shares[:, CAUSES.index("dtype_floor")] == 0).all()
