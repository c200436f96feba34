"""Analysis is pure functions over Arrow tables: checked here on hand-made tables."""

import math

import numpy as np
import pyarrow as pa
import pytest

from lpf.analysis.findings import analyze
from lpf.analysis.thresholds import Thresholds
from lpf.errors import LpfError
from lpf.run import schema


def _tables(specs):
    """specs: {request_id: [(token, engine_lp, ref_lp, ref_top1), ...]}"""
    req, tok, ref = [], [], []
    for seq, (rid, toks) in enumerate(specs.items()):
        req.append({"request_id": rid, "seq": seq, "prompt_id": rid, "rollout": 0, "prompt_token_ids": [1],
                    "output_token_ids": [t[0] for t in toks], "output_text": "", "finish_reason": "length",
                    "error": None, "oracle_expected": None, "oracle_ok": None})
        for pos, (t, e, r, top1) in enumerate(toks):
            tok.append({"request_id": rid, "position": pos, "token_id": t, "engine_logprob": e,
                        "engine_topk_ids": [], "engine_topk_logprobs": []})
            ref.append({"request_id": rid, "position": pos, "ref_logprob": r, "ref_rank": 1, "ref_entropy": 0.0,
                        "ref_top1_id": top1, "ref_top1_logprob": max(r, -0.01), "ref_topk_ids": [],
                        "ref_topk_logprobs": []})
    return (pa.Table.from_pylist(req, schema=schema.REQUESTS), pa.Table.from_pylist(tok, schema=schema.TOKENS),
            pa.Table.from_pylist(ref, schema=schema.REFERENCE))


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
