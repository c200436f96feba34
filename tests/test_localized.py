"""`lpf.analysis.localized`: a noise request whose own tokens reject the expected floor, in a run the
run-level test rejected while other requests are clean, is divergent; nothing else moves.

Pure unit tests on hand-made summaries and per-token evidence (the end-to-end check is the
stale-conv-on-reuse drill in test_prefix_drills, where it raises the requests a nearly-right conv
state left at ~0.2 nats)."""

import numpy as np
import pyarrow as pa

from lpf.analysis.localized import MIN_CLEAN, raise_localized

REJECTED = {"result": "different"}


def summary(verdicts):
    return pa.table({"request_id": [f"r{i}" for i in range(len(verdicts))], "verdict": verdicts})


def evidence(per_request):
    """per_request: [(n tokens, k exceeding)] -> (exceed, request id of each token)."""
    exceed, ids = [], []
    for i, (n, k) in enumerate(per_request):
        exceed += [True] * k + [False] * (n - k)
        ids += [f"r{i}"] * n
    return np.array(exceed), pa.array(ids)


def test_a_noise_request_past_the_floor_on_most_tokens_is_divergent_and_one_near_it_stays_noise():
    v = ["clean"] * 20 + ["noise", "noise", "corrupt"]
    ex, ids = evidence([(8, 0)] * 20 + [(8, 8), (8, 1), (8, 8)])
    out, info = raise_localized(summary(v), REJECTED, ex, ids)
    got = out.column("verdict").to_pylist()
    assert got[20] == "divergent" and got[21] == "noise" and got[22] == "corrupt" and got[:20] == v[:20]
    assert info["requests"] == 1 and info["clean"] == 20 and info["scored"] == 23


def test_a_run_the_run_test_accepts_keeps_its_verdicts():
    v = ["clean"] * 20 + ["noise"]
    ex, ids = evidence([(8, 0)] * 20 + [(8, 8)])
    for test in (None, {"result": "same"}, {"result": None}):
        out, info = raise_localized(summary(v), test, ex, ids)
        assert out.column("verdict").to_pylist() == v and info is None


def test_a_departure_everywhere_stays_the_run_level_systematic():
    """No request is clean (a quantized model, noise on every logprob): the requests keep `noise`."""
    v = ["noise"] * 40 + ["clean"] * (MIN_CLEAN - 1)
    ex, ids = evidence([(8, 8)] * 40 + [(8, 0)] * (MIN_CLEAN - 1))
    out, info = raise_localized(summary(v), REJECTED, ex, ids)
    assert out.column("verdict").to_pylist() == v and info is None


def test_the_bonferroni_bound_needs_more_exceedances_in_a_bigger_run():
    """6 of 8 tokens past the floor: p ~ 2.8e-11, below 1e-6 / 1,000 requests; 5 of 8 (p ~ 5.6e-9) is not."""
    v = ["clean"] * 998 + ["noise", "noise"]
    ex, ids = evidence([(8, 0)] * 998 + [(8, 6), (8, 5)])
    out, _ = raise_localized(summary(v), REJECTED, ex, ids)
    assert out.column("verdict").to_pylist()[-2:] == ["divergent", "noise"]


def test_few_clean_requests_count_when_their_own_tokens_accept_the_floor():
    """A drill that corrupts 96% of a run leaves fewer than CLEAN_SHARE clean: those clean requests'
    tokens, pooled, accept the floor (0 of 80 past it), so the departure is localized and the noise
    requests past the floor are raised; with the clean requests' tokens past the floor too (a lie small
    everywhere that left a few requests inside the clean threshold) nothing moves."""
    v = ["clean"] * 10 + ["noise"] * 200 + ["corrupt"] * 100
    ex, ids = evidence([(8, 0)] * 10 + [(8, 8)] * 200 + [(8, 8)] * 100)
    out, info = raise_localized(summary(v), REJECTED, ex, ids)
    assert out.column("verdict").to_pylist()[10:210] == ["divergent"] * 200
    assert info["requests"] == 200 and "own tokens accept the floor" in info["rule"]
    ex, ids = evidence([(8, 3)] * 10 + [(8, 8)] * 200 + [(8, 8)] * 100)  # 30 of 80 past: p far below 1e-6
    out, info = raise_localized(summary(v), REJECTED, ex, ids)
    assert out.column("verdict").to_pylist() == v and info is None
    ex, ids = evidence([(0, 0)] * 10 + [(8, 8)] * 200 + [(8, 8)] * 100)  # clean requests the test read no token of
    out, info = raise_localized(summary(v), REJECTED, ex, ids)
    assert out.column("verdict").to_pylist() == v and info is None
