"""Tokens that came back without a logprob (`lpf.analysis.absent`), in a run whose other tokens have one.

llama-server sends no probabilities for a token that ends inside a UTF-8 character: an honest float32 run
then has a null engine_logprob here and there. Such a token is judged from the token alone, as the
tokens-only path judges every token (a greedy flip past the tie margin still flags its request), and is
no logprob error; a NaN logprob *value* stays an engine error, never clean. Pure analysis on synthetic
Arrow tables (`test_run_test.synthetic_run`: the truth is known): fast."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from lpf.analysis import metrics as m
from lpf.analysis import scoring
from lpf.analysis.returned import what_came_back
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.verdicts import CODES, reduce_requests
from test_run_test import MODEL, floor_of, run, synthetic_run


@pytest.fixture(scope="module")
def table():
    """A float32 floor measured on an honest run (logit error 2e-4), as floors.json has one."""
    f32 = floor_of(synthetic_run(sigma=2e-4, seed=2))
    return {"pairs": {"float32/float32": {"envelope": f32, "models": {MODEL: f32}}}}


def _set(t: pa.Table, name: str, values) -> pa.Table:
    return t.set_column(t.schema.get_field_index(name), name, values)


def without_logprobs(tokens: pa.Table, rows: np.ndarray, nan_rows=(), scrambled_topk=False) -> pa.Table:
    """`tokens` with no logprob and no top-k at `rows` (as the llama.cpp wire stores a token
    llama-server sent no probabilities for; `scrambled_topk`: top-k lists kept there, their logprobs
    scrambled), and a NaN logprob value at `nan_rows`."""
    lp = tokens.column("engine_logprob").to_numpy().copy()
    lp[list(nan_rows)] = np.nan
    null = np.zeros(tokens.num_rows, bool)
    null[rows] = True
    out = _set(tokens, "engine_logprob", pa.array(lp, pa.float64(), mask=null))
    for name in ("engine_topk_ids", "engine_topk_logprobs"):
        lists = out.column(name).to_pylist()
        if scrambled_topk:
            lists = [[v * 3.0 - i % 5 for v in x] if null[i] and "logprobs" in name else x for i, x in enumerate(lists)]
        else:
            lists = [[] if null[i] else x for i, x in enumerate(lists)]
        out = _set(out, name, pa.array(lists, out.schema.field(name).type))
    return out


def honest(seed=11, n_req=60):
    return synthetic_run(n_req=n_req, n_tok=10, sigma=2e-4, seed=seed)


def audit(tables, table):
    return run(tables, table, engine_dtype="float32")


def test_tokens_without_a_logprob_leave_an_honest_run_clean_and_same(table):
    req, tok, ref = honest()
    rows = np.arange(3, tok.num_rows, 7)  # every 7th token, in most requests
    summary, f = audit((req, without_logprobs(tok, rows), ref), table)
    assert f["counts"]["divergent"] == f["counts"]["corrupt"] == 0 and f["verdict"] in ("clean", "noise")
    rt = f["run_test"]
    assert rt["result"] == "same" and rt["tests"]["over"]["k"] == 0, rt["sentence"]
    # said per request: how many came back without one; |d| is over the others, never infinite
    per = dict(zip(summary.column("request_id").to_pylist(), summary.column("n_no_logprob").to_pylist()))
    want = pc.value_counts(tok.column("request_id").take(pa.array(rows))).to_pylist()
    assert per == {**{r: 0 for r in per}, **{c["values"]: c["counts"] for c in want}}
    worst = summary.column("max_abs_logprob_diff").to_numpy()
    assert np.isfinite(worst).all() and worst.max() < 1e-2
    # the same run with every logprob: the same verdict and run test
    _, full = audit((req, tok, ref), table)
    assert full["verdict"] == f["verdict"] and full["run_test"]["result"] == "same"


def test_top_k_lists_beside_a_missing_logprob_are_no_evidence(table):
    """An adapter that kept top-k lists for a token without a logprob: they are not judged either (the
    top-k sub-test and the observed floor read the other tokens only)."""
    req, tok, ref = honest()
    rows = np.arange(3, tok.num_rows, 7)
    _, f = audit((req, without_logprobs(tok, rows, scrambled_topk=True), ref), table)
    rt = f["run_test"]
    assert rt["result"] == "same" and rt["tests"]["topk"]["n"] == tok.num_rows - rows.size and f["verdict"] == "clean"


def test_a_greedy_flip_without_a_logprob_still_makes_its_request_divergent(table):
    req, tok, ref = honest()
    at = 4 * 10 + 5  # request r00004, position 5: the engine's token becomes the reference's second choice
    second = ref.column("ref_topk_ids")[at].as_py()[1]
    second_lp = ref.column("ref_topk_logprobs")[at].as_py()[1]
    assert ref.column("ref_top1_logprob")[at].as_py() - second_lp > 0.01  # past any float32 tie margin
    ids = tok.column("token_id").to_numpy().copy()
    ids[at] = second
    tok = _set(tok, "token_id", pa.array(ids, tok.schema.field("token_id").type))
    for name, v in (("ref_logprob", second_lp), ("ref_rank", 2)):
        col = ref.column(name).to_numpy().copy()
        col[at] = v
        ref = _set(ref, name, pa.array(col, ref.schema.field(name).type))
    rows = np.r_[np.arange(3, tok.num_rows, 7), at]
    summary, f = audit((req, without_logprobs(tok, rows), ref), table)
    flagged = {x["request_id"]: x for x in f["flagged"]}
    assert list(flagged) == ["r00004"] and flagged["r00004"]["verdict"] == "divergent"
    assert flagged["r00004"]["first_divergence"] == 5
    row = summary.filter(pc.equal(summary.column("request_id"), "r00004")).to_pylist()[0]
    assert row["n_greedy_flips"] == 1 and row["n_no_logprob"] >= 1 and np.isfinite(row["max_abs_logprob_diff"])
    # the run test counts the flip (its `logprob` sub-test), not a logprob error (`over`)
    assert f["run_test"]["tests"]["logprob"]["k"] >= 1 and f["run_test"]["tests"]["over"]["k"] == 0


def test_a_nan_logprob_value_stays_never_clean(table):
    """A NaN the engine computed is evidence: never clean, beside tokens that merely came without one."""
    req, tok, ref = honest()
    nan_at = 7 * 10 + 2  # request r00007
    summary, f = audit((req, without_logprobs(tok, np.arange(3, tok.num_rows, 7), nan_rows=[nan_at]), ref), table)
    assert tok.column("engine_logprob").null_count == 0
    verdict = dict(zip(summary.column("request_id").to_pylist(), summary.column("verdict").to_pylist()))
    assert verdict["r00007"] == "divergent"
    assert {v for r, v in verdict.items() if r != "r00007"} <= {"clean", "noise"}
    row = summary.filter(pc.equal(summary.column("request_id"), "r00007")).to_pylist()[0]
    assert row["max_abs_logprob_diff"] == np.inf
    # the run test's `over` sub-test counts the NaN (never within the floor), not the nulls
    assert f["run_test"]["tests"]["over"]["k"] == 1


def test_what_came_back_says_so():
    req, tok, ref = honest(n_req=5)
    got = what_came_back(without_logprobs(tok, np.array([1, 2, 3])), False, {}, {"temperature": 0})
    assert got["logprobs"] == "some" and got["no_logprob"] == 3
    assert "3 tokens came back without a logprob: judged from their tokens alone" in got["steps"]["per_request"]
    assert "never clean" not in got["steps"]["per_request"]


@pytest.mark.parametrize("greedy", [True, False])
def test_sparse_scoring_is_the_dense_rule_with_missing_logprobs(greedy):
    """`scoring.score_requests` (sparse) is `metric_arrays` then `reduce_requests` (dense) bit for bit
    with tokens that came without a logprob, a NaN value, a request with none at all, greedy flips and
    improbable tokens among them."""
    rng = np.random.default_rng(4)
    req, tok, ref = synthetic_run(n_req=40, n_tok=12, sigma=0.3, seed=9, temperature=0.0 if greedy else 1.0)
    rows = np.r_[rng.choice(tok.num_rows, 80, replace=False), np.arange(12 * 6, 12 * 7)]  # request 6: none
    tok = without_logprobs(tok, rows, nan_rows=[5])
    joined, starts = m.join_grouped(tok, ref)
    cols = m.input_arrays(joined)
    cols["position"] = joined.column("position").to_numpy()
    assert cols["no_logprob"].sum() == len(set(rows.tolist()) - {5})
    th = Thresholds()
    dense = reduce_requests({**cols, **m.metric_arrays(cols, greedy, th, temperature=1.0)}, th, starts)
    sparse, _, _ = scoring.score_requests(cols, starts, greedy, th, temperature=1.0)
    for k in dense:
        np.testing.assert_array_equal(sparse[k], dense[k], err_msg=k)
    assert np.isnan(dense["max_abs_logprob_diff"][6]) and dense["n_no_logprob"][6] == 12
    assert dense["max_abs_logprob_diff"][0] == np.inf  # the NaN value, request 0
    assert {CODES[v] for v in dense["verdict"]} & {"divergent", "corrupt"}  # the rule judges something here


def test_an_answer_that_only_left_logprobs_out_is_not_raised():
    """`evidence.apply_inconsistency` raises a noise answer with an inconsistency to divergent, but not
    for `logprobs_missing` alone (the tokens without a logprob were judged from their tokens); the
    inconsistency stays in the summary as evidence."""
    from lpf.analysis.evidence import apply_inconsistency

    reasons = [
        "logprobs_missing: no completion_probabilities entry for 2 of 12 tokens",
        "logprobs_missing: no completion_probabilities entry for 1 of 12 tokens; token_count: 11 for 12",
        None,
    ]
    requests = pa.table({"request_id": ["a", "b", "c"], "seq": [0, 1, 2], "inconsistency": reasons})
    summary = pa.table({"request_id": ["a", "b", "c"], "verdict": ["noise"] * 3})
    out = apply_inconsistency(summary, requests)
    assert out.column("verdict").to_pylist() == ["noise", "divergent", "noise"]
    assert out.column("inconsistency").to_pylist() == reasons
