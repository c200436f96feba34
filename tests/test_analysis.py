"""Analysis is pure functions over Arrow tables: checked here on hand-made tables."""

import math

import numpy as np
import pyarrow as pa
import pytest

from lpf.analysis.findings import analyze
from lpf.analysis.thresholds import Thresholds
from lpf.core.errors import LpfError
from lpf.run import schema


def _tables(specs):
    """specs: {request_id: [(token, engine_lp, ref_lp, ref_top1), ...]}"""
    req, tok, ref = [], [], []
    for seq, (rid, toks) in enumerate(specs.items()):
        req.append(
            {
                "request_id": rid,
                "seq": seq,
                "prompt_id": rid,
                "rollout": 0,
                "prompt_token_ids": [1],
                "output_token_ids": [t[0] for t in toks],
                "output_text": "",
                "finish_reason": "length",
                "error": None,
                "oracle_expected": None,
                "oracle_ok": None,
            }
        )
        for pos, (t, e, r, top1) in enumerate(toks):
            tok.append(
                {
                    "request_id": rid,
                    "position": pos,
                    "token_id": t,
                    "engine_logprob": e,
                    "engine_topk_ids": [],
                    "engine_topk_logprobs": [],
                }
            )
            ref.append(
                {
                    "request_id": rid,
                    "position": pos,
                    "ref_logprob": r,
                    "ref_rank": 1 if t == top1 else 2,
                    "ref_entropy": 0.0,
                    "ref_top1_id": top1,
                    "ref_top1_logprob": max(r, -0.01),
                    "ref_topk_ids": [],
                    "ref_topk_logprobs": [],
                }
            )
    return (
        pa.Table.from_pylist(req, schema=schema.REQUESTS),
        pa.Table.from_pylist(tok, schema=schema.TOKENS),
        pa.Table.from_pylist(ref, schema=schema.REFERENCE),
    )


def test_verdicts_and_metrics():
    lg = math.log
    specs = {
        "clean": [(5, -0.1, -0.1 + 1e-6, 5), (6, -0.2, -0.2, 6)],
        "noise": [(5, -0.1, -0.12, 5), (6, -0.2, -0.2, 6)],
        "flip": [(5, -0.7, -0.7, 9), (6, -0.2, -0.2, 6)],  # greedy: engine chose a token the reference ranks 2nd
        "div": [(5, -0.1, -0.1, 5), (6, -0.2, -0.2, 6), (7, -0.1, -3.0, 7)],
        "corrupt": [(5, lg(0.9), lg(0.001), 1), (6, lg(0.99), lg(0.01), 2), (7, -0.1, -0.1, 7)],
    }
    summary, f = analyze(*_tables(specs), Thresholds(), greedy=True)
    got = dict(zip(summary.column("request_id").to_pylist(), summary.column("verdict").to_pylist()))
    assert got == {"clean": "clean", "noise": "noise", "flip": "divergent", "div": "divergent", "corrupt": "corrupt"}
    first = dict(zip(summary.column("request_id").to_pylist(), summary.column("first_divergence").to_pylist()))
    assert first == {"clean": None, "noise": None, "flip": 0, "div": 2, "corrupt": 0}
    assert f["verdict"] == "corrupt"
    assert f["counts"] == {"clean": 1, "noise": 1, "divergent": 2, "corrupt": 1}
    assert [x["request_id"] for x in f["flagged"]] == ["corrupt", "div", "flip"]
    assert f["metrics"]["abs_logprob_diff"]["max"] == pytest.approx(math.log(0.9 / 0.001))
    # same run sampled (not greedy): a token choice differing from the argmax is not a flip
    summary, _ = analyze(*_tables(specs), Thresholds(), greedy=False)
    assert summary.column("verdict").to_pylist()[2] == "clean"


def test_metric_formulas():
    from lpf.analysis.metrics import join_scored, token_metrics

    _, tok, ref = _tables({"a": [(5, -0.5, -1.5, 5)]})
    m = token_metrics(join_scored(tok, ref), True, Thresholds()).to_pylist()[0]
    d = 1.0
    assert m["abs_logprob_diff"] == pytest.approx(d)
    assert m["prob_diff"] == pytest.approx(abs(np.exp(-0.5) - np.exp(-1.5)))
    rho = np.exp(-d)
    assert m["k3_kl"] == pytest.approx(rho - np.log(rho) - 1)
    assert m["token_mult_prob_error"] == pytest.approx(np.exp(d))


def test_missing_logprob_is_never_clean():
    summary, f = analyze(*_tables({"nan": [(5, float("nan"), -0.1, 5)]}), Thresholds(), greedy=True)
    assert summary.column("verdict").to_pylist() == ["divergent"]


def test_threshold_overrides():
    th = Thresholds().with_overrides(["clean_abs_diff=0.01", "gibberish-min-tokens=4"])
    assert th.clean_abs_diff == 0.01 and th.gibberish_min_tokens == 4
    with pytest.raises(LpfError, match="did you mean"):
        Thresholds().with_overrides(["clean_abs_dif=1"])
    with pytest.raises(LpfError, match="not a number"):
        Thresholds().with_overrides(["clean_abs_diff=x"])


# -- calibration, gibberish score, shape, hypotheses (pure functions on hand-made data) -------------
def _noise_run(n_req, n_tok, scale, seed=0, liars=()):
    """Requests whose engine logprobs differ from the reference by numeric noise of `scale`; the
    requests in `liars` confidently emit tokens the reference finds improbable from position 2 on."""
    rng = np.random.default_rng(seed)
    specs = {}
    for i in range(n_req):
        toks = []
        for p in range(n_tok):
            ref = -abs(rng.normal(0.3, 0.3))
            if i in liars and p >= 2:
                toks.append((7, -0.01, -9.0, 8))
            else:
                toks.append((5, ref + rng.normal(0, scale), ref, 5))
        specs[f"r{i:04d}"] = toks
    return _tables(specs)


def test_calibration_adapts_to_the_floor_and_ignores_a_handful_of_liars():
    from lpf.analysis.calibration import calibrate
    from lpf.analysis.verdicts import segment_starts

    def thresholds(tables):
        _, tok, ref = tables
        ad = np.abs(tok.column("engine_logprob").to_numpy() - ref.column("ref_logprob").to_numpy())
        return calibrate(ad, segment_starts(tok.column("request_id")), Thresholds())

    fp32, info = thresholds(_noise_run(200, 8, 1e-6))
    assert info["source"] == "calibrated" and fp32 == Thresholds()  # float32 keeps the defaults
    bf16, _ = thresholds(_noise_run(200, 8, 0.006))
    assert bf16.clean_abs_diff > fp32.clean_abs_diff and bf16.divergent_abs_diff > fp32.divergent_abs_diff
    assert 0.5 < bf16.divergent_abs_diff < 2.0, "uncapped: the floor itself sets it"
    liars, _ = thresholds(_noise_run(200, 8, 0.006, liars=set(range(10))))
    assert liars.divergent_abs_diff == pytest.approx(bf16.divergent_abs_diff, rel=0.15)
    assert liars.clean_abs_diff == pytest.approx(bf16.clean_abs_diff, rel=0.15)
    # few requests: defaults; pinned names are never moved
    small, info = thresholds(_noise_run(5, 8, 0.08))
    assert info["source"] == "default" and small == Thresholds()
    pinned = Thresholds().with_overrides(["divergent_abs_diff=0.7"])
    _, tok, ref = _noise_run(200, 8, 0.08)
    ad = np.abs(tok.column("engine_logprob").to_numpy() - ref.column("ref_logprob").to_numpy())
    from lpf.analysis.calibration import calibrate as cal

    out, _ = cal(ad, np.arange(0, 1600, 8), pinned)
    assert out.divergent_abs_diff == 0.7 and out.clean_abs_diff > 1e-3


def test_bf16_like_noise_is_never_corrupt_and_liars_are():
    summary, f = analyze(*_noise_run(300, 12, 0.08, seed=1, liars={3, 150}), Thresholds(), greedy=True)
    got = dict(zip(summary.column("request_id").to_pylist(), summary.column("verdict").to_pylist()))
    assert got.pop("r0003") == "corrupt" and got.pop("r0150") == "corrupt"
    assert "corrupt" not in got.values() and "divergent" not in got.values()
    assert f["thresholds"]["source"] == "calibrated"
    assert f["shape"]["first_divergence"] == {"positions": {"2": 2}, "median": 2.0, "at_zero_fraction": 0.0}


def test_near_tie_flip_is_divergent_and_a_sustained_lie_is_corrupt():
    lg = math.log
    agree = [(5, -0.05, -0.05, 5)] * 6
    specs = {
        # flip where the reference's top-1 barely wins, then the reference agrees again
        "tie": [(5, -0.70, -0.701, 9)] + agree,
        # confident, reference says improbable, and it keeps disagreeing
        "state": [(5, lg(0.9), lg(0.001), 9)] + [(6, -0.05, -6.0, 9)] * 6,
        # an untrained-looking engine: never confident in absolute terms (p ~ 0.3), but its own top
        # choice is one the reference ranks low, every token
        "relative": [(5, lg(0.3), lg(0.004), 9)] * 7,
        # one confident lie, then tokens where both sides hesitate and agree (crossed wires): divergent
        "once": [(5, lg(0.9), lg(0.001), 9)] + [(5, -0.7, -0.7, 5)] * 6,
        # one overwhelming lie on the last token (an early EOS): nothing after it could agree
        "last": agree + [(2, -0.01, -15.0, 9)],
        # ... or followed only by tokens both sides are sure of (dictated by context: no evidence)
        "last_informative": [(5, -0.01, -15.0, 9)] + agree,
    }
    summary, _ = analyze(*_tables(specs), Thresholds(), greedy=True)
    rows = {r["request_id"]: r for r in summary.to_pylist()}
    assert {k: r["verdict"] for k, r in rows.items()} == {
        "tie": "divergent",
        "state": "corrupt",
        "relative": "corrupt",
        "once": "divergent",
        "last": "corrupt",
        "last_informative": "corrupt",
    }
    assert rows["tie"]["gibberish_score"] < 1e-3 and rows["state"]["gibberish_score"] == 1.0
    assert rows["once"]["gibberish_score"] == pytest.approx(1 / 7)


def test_fisher_exact_and_best_split():
    from lpf.analysis.features import Feature
    from lpf.analysis.hypotheses import rank_hypotheses

    n = 400
    flagged = np.zeros(n, bool)
    flagged[[10, 50, 90, 130, 170, 210, 250]] = True
    slot = np.arange(n) % 36.0
    slot[flagged] = 36 + np.arange(7) % 4  # flagged requests sit on slots >= 36
    first_decode = flagged.copy()
    first_decode[[5, 6, 7, 8]] = True  # four clean requests share it
    feats = [
        Feature("noise", "bool", np.arange(n) % 3 == 0, "had an index divisible by 3"),
        Feature("max_state_slot", "numeric", slot, "state slot id", stride=1000),
        Feature("first_phase_decode", "bool", first_decode, "started with a decode step"),
    ]
    hyps = rank_hypotheses(feats, flagged, np.ones(n, bool), "corrupt", "clean")
    assert [h["feature"] for h in hyps][:2] == ["max_state_slot", "first_phase_decode"]
    top = hyps[0]
    assert top["split"] == {"op": ">=", "value": 36.0} and top["flagged_with"] == 7
    assert top["sentence"].startswith(
        "7/7 corrupt requests had state slot id >= 36 (slot * stride >= 36,000 = 2^15.14); 0/393"
    )
    assert hyps[1]["sentence"] == "7/7 corrupt requests started with a decode step; 4/393 clean ones did."
    assert all(h["feature"] != "noise" for h in hyps)


def test_estimate_period():
    from lpf.analysis.periodicity import estimate_period

    spikes = np.zeros(240)
    spikes[5::12] = 1
    got = estimate_period(spikes)
    assert got["period"] == 12 and got["confidence"] > 0.8
    noisy = np.random.default_rng(0).normal(0, 0.2, 240) + 3 * spikes
    assert estimate_period(noisy)["period"] == 12
    assert estimate_period(np.random.default_rng(1).normal(size=240))["period"] is None
    assert estimate_period(np.ones(50))["period"] is None and estimate_period([])["period"] is None
    # sparse events that skip cycles at random (crossed wires every 5th step, only now and then
    # between requests that differ): phase concentration finds what autocorrelation blurs
    skip = np.zeros(600)
    skip[np.random.default_rng(0).choice(np.arange(5, 600, 5), 30, replace=False)] = 1
    assert estimate_period(skip)["period"] == 5


def test_chunked_scoring_equals_whole_run(monkeypatch):
    """Big runs are scored in request-aligned chunks, their metric columns summarized leaf by leaf:
    the results must not depend on the cut."""
    import json

    import lpf.analysis.findings as findings
    from lpf.analysis import column_stats, metrics, scoring

    tables = _noise_run(120, 9, 0.01, seed=4, liars={7, 80})
    whole = findings.analyze(*tables, Thresholds(), greedy=True)
    monkeypatch.setattr(scoring, "CHUNK", 50)  # cuts inside the 9-token requests move to their starts
    monkeypatch.setattr(column_stats, "LEAF", 200)  # smaller nodes of the same summation tree
    monkeypatch.setattr(metrics, "SMALL_SELECT", 100)  # percentiles from brackets, not a kept column
    chunked = findings.analyze(*tables, Thresholds(), greedy=True)
    assert chunked[0].equals(whole[0])
    assert json.dumps(chunked[1], sort_keys=True) == json.dumps(whole[1], sort_keys=True)
