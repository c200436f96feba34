"""The tokens-only analysis (no engine logprobs) on synthetic runs where the truth is known (the synthetic
runs and floor table of test_run_test): an honest engine's tokens are `same` and clean, an engine with a
larger logit error flips greedy tokens past the tie margin and is `different`; sampled runs are judged by
the top-1 share at their temperature; the reference's own argmax is never a lie, however flat."""

import numpy as np
import pyarrow as pa

from lpf.analysis import token_test
from lpf.analysis.returned import tokens_only, what_came_back
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.tokens_only import analyze_tokens_only
from test_run_test import MODEL, synthetic_run, table  # noqa: F401  (the fixture)


def _no_logprobs(tables):
    requests, tokens, reference = tables
    n = tokens.num_rows
    tokens = tokens.set_column(tokens.column_names.index("engine_logprob"), "engine_logprob", pa.nulls(n, pa.float64()))
    empty = pa.array([[]] * n, pa.list_(pa.int32()))
    tokens = tokens.set_column(tokens.column_names.index("engine_topk_ids"), "engine_topk_ids", empty)
    tokens = tokens.set_column(
        tokens.column_names.index("engine_topk_logprobs"),
        "engine_topk_logprobs",
        pa.array([[]] * n, pa.list_(pa.float32())),
    )
    return requests, tokens, reference


def _judge(tables, table, engine_dtype="float32", temperature=0.0, seeded=None):
    info = {
        "engine_dtype": engine_dtype,
        "reference_dtype": "float32",
        "model": MODEL,
        "sampling": {"temperature": temperature, "top_k": 0, "top_p": 1.0},
    }
    return analyze_tokens_only(
        *tables,
        Thresholds(),
        greedy=temperature == 0,
        temperature=temperature,
        floor_table=table,
        run_info=info,
        seeded=seeded,
    )


def test_greedy_tokens_alone_honest_is_same_and_a_larger_error_is_different(table):
    honest = _no_logprobs(synthetic_run(sigma=2e-4, seed=5))
    assert tokens_only(honest[1])
    summary, f = _judge(honest, table)
    assert f["run_test"]["kind"] == "tokens" and f["run_test"]["result"] == "same", f["run_test"]["sentence"]
    assert f["verdict"] == "clean" and f["counts"]["noise"] == 0
    assert (
        summary.column("max_abs_logprob_diff").null_count
        + np.isnan(summary.column("max_abs_logprob_diff").to_numpy(zero_copy_only=False)).sum()
        >= summary.num_rows
    )  # not judged
    lying = _no_logprobs(synthetic_run(sigma=0.3, seed=5))
    _, f = _judge(lying, table)
    t = f["run_test"]
    assert t["result"] == "different" and t["test"] == "flips" and t["tests"]["flips"]["k"] >= 5, t["sentence"]
    assert f["verdict"] in ("systematic", "divergent", "corrupt") and f["counts"]["divergent"] > 0
    # the same lie judged against bfloat16's floor (a much wider tie margin) is within it more often
    _, g = _judge(lying, table, engine_dtype="bfloat16")
    assert g["run_test"]["tests"]["flips"]["k"] < t["tests"]["flips"]["k"]


def test_sampled_tokens_alone_use_the_top1_share_and_a_seeded_replay(table):
    honest = _no_logprobs(synthetic_run(sigma=2e-4, seed=6, temperature=1.0))
    _, f = _judge(honest, table, temperature=1.0)
    assert f["run_test"]["result"] == "same" and set(f["run_test"]["tests"]) == {"sampling"}
    hot = _no_logprobs(synthetic_run(sigma=2e-4, seed=6, temperature=1.0, engine_temperature=0.5))
    _, f = _judge(hot, table, temperature=1.0)
    assert f["run_test"]["result"] == "different" and f["run_test"]["test"] == "sampling"
    # a replay that disagrees with the engine past the floor on 10% of its tokens: different, and each
    # such token a lie of its request; one that agrees everywhere: same
    requests, tokens, reference = honest
    tok = tokens.column("token_id").to_numpy()
    n = len(tok)
    wrong = np.arange(n) % 10 == 0
    draws = pa.table(
        {
            "request_id": tokens.column("request_id"),
            "position": tokens.column("position"),
            "seeded_token": pa.array(np.where(wrong, tok + 1, tok).astype(np.int32)),
            "seeded_margin": pa.array(np.where(wrong, 2.0, 0.0)),
            "seeded_runner_up": pa.array(np.full(n, 1.0)),
        }
    )
    _, f = _judge(honest, table, temperature=1.0, seeded=draws)
    assert f["run_test"]["result"] == "different" and f["run_test"]["test"] == "seeded"
    assert f["counts"]["clean"] < requests.num_rows
    agree = draws.set_column(2, "seeded_token", tokens.column("token_id")).set_column(
        3, "seeded_margin", pa.array(np.zeros(n))
    )
    _, f = _judge(honest, table, temperature=1.0, seeded=agree)
    assert f["run_test"]["result"] == "same" and f["verdict"] == "clean"


def test_the_references_argmax_is_never_a_lie_however_flat(table):
    flat = _no_logprobs(synthetic_run(sigma=0.0, seed=7, logit_scale=0.05))  # every token p ~ 1/40 < 0.05
    _, f = _judge(flat, table)
    assert f["verdict"] == "clean" and f["counts"]["corrupt"] == f["counts"]["divergent"] == 0


def test_what_came_back_says_what_each_step_judged():
    _, tokens, _ = synthetic_run(n_req=3, n_tok=4, sigma=0.0)
    j = what_came_back(tokens, False, {"routes": {"/completions": 3}, "notes": ["x"]}, {"temperature": 0})
    assert j["logprobs"] == "all" and j["top_k"] == 5 and "top-5 spread" in j["steps"]["run_test"]
    j = what_came_back(_no_logprobs((None, tokens, None))[1], False, {}, {"temperature": 0})
    assert j["logprobs"] == "none" and j["top_k"] == 0 and "greedy flips" in j["steps"]["run_test"]
    assert token_test.decide({"n": 5, "tie_margin": 1e-3}, 0, 5)["result"] is None
