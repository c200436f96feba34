"""The rejection sampler's decisions checked against the reference (`lpf.analysis.speculative_decisions`).

Runs are simulated: a target distribution per output position, a proposer's q per draft, and a rejection
sampler, honest (min(1, p/q), then the residual) or reading another q, written as the trace, tokens and
reference tables an audit writes. An honest sampler's run flags nothing; a kept draft the target keeps
with a tiny probability, or a rejected draft it always keeps, makes its request divergent there.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from lpf.analysis.speculative_decisions import decision_slack, decision_test, fisher, raise_decisions

V, PLEN, K, TOPK = 40, 5, 3, 8


def _dist(rng, sharp: float) -> np.ndarray:
    z = rng.normal(size=V) * sharp
    p = np.exp(z - z.max())
    return p / p.sum()


def _run(n_requests: int, steps: int, seed: int, other_q: bool = False, one_hot: bool = False):
    """(tokens, reference, requests, trace) of a simulated speculative run at temperature 1."""
    rng = np.random.default_rng(seed)
    tok, ref, trace = [], [], []
    for r in range(n_requests):
        rid = f"r{r}"
        out: list[int] = []
        for step in range(steps):
            ps = [_dist(rng, 3.0) for _ in range(K + 1)]  # the target at the row's 1 + K positions
            qs = [_dist(rng, 4.0) for _ in range(K)]  # the proposer's
            q_used = [_dist(rng, 4.0) for _ in range(K)] if other_q else qs
            drafts = [int(np.argmax(q)) if one_hot else int(rng.choice(V, p=q)) for q in qs]
            q_of = [1.0 if one_hot else float(q[d]) for q, d in zip(qs, drafts)]
            emitted, a = [], 0
            for i, d in enumerate(drafts):
                qd = 1.0 if one_hot else float(q_used[i][d])
                if qd > 0 and rng.random() < min(1.0, ps[i][d] / qd):
                    emitted.append(d)
                    a += 1
                    continue
                res = np.clip(ps[i] - (np.eye(V)[d] if one_hot else q_used[i]), 0, None)
                emitted.append(int(rng.choice(V, p=res / res.sum())))
                break
            else:
                emitted.append(int(rng.choice(V, p=ps[K])))
            trace.append(
                {
                    "request_id": rid,
                    "step": step,
                    "phase": "verify",
                    "num_computed_tokens": PLEN + len(out) - 1,
                    "num_scheduled_tokens": 1 + K,
                    "num_draft_tokens": K,
                    "num_accepted_tokens": a,
                    "spec_sampled": True,
                    "draft_token_ids": drafts,
                    "draft_token_probs": None if one_hot else q_of,
                }
            )
            for j, t in enumerate(emitted):
                p = ps[j]
                top = np.argsort(-p)[:TOPK]
                pos = len(out) + j
                tok.append({"request_id": rid, "position": pos, "token_id": t, "engine_logprob": math.log(p[t])})
                ref.append(
                    {
                        "request_id": rid,
                        "position": pos,
                        "ref_logprob": math.log(p[t]),
                        "ref_topk_ids": top.tolist(),
                        "ref_topk_logprobs": np.log(p[top]).tolist(),
                    }
                )
            out.extend(emitted)
    requests = pa.table(
        {"request_id": [f"r{r}" for r in range(n_requests)], "prompt_token_ids": [[1] * PLEN] * n_requests}
    )
    return pa.Table.from_pylist(tok), pa.Table.from_pylist(ref), requests, pa.Table.from_pylist(trace)


@pytest.mark.parametrize("one_hot", [False, True])
def test_an_honest_rejection_sampler_is_never_flagged(one_hot):
    tokens, reference, requests, trace = _run(60, 12, seed=1, one_hot=one_hot)
    found, info = decision_test(tokens, reference, requests, trace, {"temperature": 1.0}, 1e-3, alpha=0.01)
    assert found == {}
    # every kept draft is tested; a rejected one where the reference's top-k holds it
    assert info["kept"] == sum(trace["num_accepted_tokens"].to_pylist()) > 0
    assert info["tested"] == info["kept"] + info["rejected_tested"] and info["rejected_tested"] > 0
    assert info["threshold"] == pytest.approx(0.01 / 2 / info["tested"])


def test_a_sampler_reading_another_requests_q_is_flagged_where_it_kept_an_improbable_draft():
    tokens, reference, requests, trace = _run(60, 12, seed=2, other_q=True)
    found, info = decision_test(tokens, reference, requests, trace, {"temperature": 1.0}, 1e-3, alpha=0.01)
    assert found, "another request's q keeps drafts the target's own test rejects"
    for rid, (pos, bound, detail) in found.items():
        assert bound <= (info["request_threshold"] if "together" in detail else info["threshold"])
        # a kept draft is the request's token there; a rejected one is not
        tok = tokens.filter(
            pa.compute.and_(pa.compute.equal(tokens["request_id"], rid), pa.compute.equal(tokens["position"], pos))
        )
        kept = f"kept draft {tok['token_id'][0].as_py()} at output position {pos}" in detail
        assert kept or ("rejected draft" in detail and bound == 0.0)
    assert any("kept draft" in f[2] for f in found.values())


def test_a_rejected_draft_the_target_always_keeps_is_impossible():
    tokens, reference, requests, trace = _run(1, 1, seed=3)
    row = trace.to_pylist()[0]
    lp = dict(zip(reference.to_pylist()[0]["ref_topk_ids"], reference.to_pylist()[0]["ref_topk_logprobs"]))
    top = max(lp, key=lp.get)
    row.update(num_accepted_tokens=0, draft_token_ids=[top, 1, 2], draft_token_probs=[math.exp(lp[top]) / 2, 0.5, 0.5])
    found, info = decision_test(
        tokens, reference, requests, pa.Table.from_pylist([row]), {"temperature": 1.0}, 1e-3, alpha=0.01
    )
    assert info["rejected_tested"] == 1 and found["r0"][0] == 0 and found["r0"][1] == 0.0
    assert "rejected draft" in found["r0"][2]


def test_a_position_whose_engine_logprob_disagrees_is_left_to_the_logprob_test():
    tokens, reference, requests, trace = _run(60, 12, seed=2, other_q=True)
    found, info = decision_test(tokens, reference, requests, trace, {"temperature": 1.0}, 1e-3, alpha=0.01)
    # the engine's target was another than the reference's at every position: nothing is tested
    shifted = tokens.set_column(3, "engine_logprob", pa.compute.subtract(tokens["engine_logprob"], 1.0))
    assert found and decision_test(shifted, reference, requests, trace, {"temperature": 1.0}, 1e-3, 0.01) is None


def test_nothing_is_tested_greedy_with_top_k_or_without_the_trace_columns():
    tokens, reference, requests, trace = _run(2, 2, seed=4)
    assert decision_test(tokens, reference, requests, trace, {"temperature": 0.0}, 1e-3, 0.01) is None
    assert decision_test(tokens, reference, requests, trace, {"temperature": 1.0, "top_k": 5}, 1e-3, 0.01) is None
    old = trace.drop_columns(["draft_token_ids", "draft_token_probs"])
    assert decision_test(tokens, reference, requests, old, {"temperature": 1.0}, 1e-3, 0.01) is None


def test_raise_decisions_makes_clean_and_noise_divergent_and_keeps_worse_verdicts():
    summary = pa.table(
        {
            "request_id": ["a", "b", "c"],
            "verdict": ["clean", "corrupt", "noise"],
            "first_divergence": pa.array([None, 2, None], pa.int32()),
        }
    )
    out = raise_decisions(summary, {"a": (4, 1e-9, "why a"), "b": (7, 1e-9, "why b")})
    assert out["verdict"].to_pylist() == ["divergent", "corrupt", "noise"]
    assert out["first_divergence"].to_pylist() == [4, 2, None]
    assert out["spec_decision"].to_pylist() == ["why a", "why b", None]


def test_fisher_combines_p_values_and_the_slack_follows_the_floor():
    assert fisher([0.3]) == pytest.approx(0.3)
    # two p-values of 0.1: P(chi2_4 >= -2 ln 0.01) = 0.01 (1 - ln 0.01)
    assert fisher([0.1, 0.1]) == pytest.approx(0.01 * (1 + math.log(100)))
    assert fisher([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert decision_slack(0.5, None) == 0.5
    assert decision_slack(0.5, {"token": {"q99": 4e-5}}) == 0.01  # float32: a hundredth of a nat
    assert decision_slack(2.0, {"token": {"q99": 0.53}}) == 2.0  # bfloat16: the divergent threshold


def test_a_sampler_whose_target_is_not_the_engines_is_flagged_by_its_requests_decisions_together():
    """vLLM CPU's rejection sampler divided the target's logits by uninitialised temperatures (docs/bugs.md
    25): one-hot drafts the target keeps 9 times in 10 rejected, tokens it finds improbable drawn in their
    place. No single decision is improbable enough; a request's together are."""
    rng = np.random.default_rng(5)
    tok, ref, trace = [], [], []
    for r in range(40):
        rid, out = f"r{r}", 0
        for step in range(60):
            p = _dist(rng, 3.0)
            p = 0.9 * np.eye(V)[7] + 0.1 * p  # the draft (token 7) is the target's, p = 0.9
            flat = np.full(V, 1.0 / V)  # what the broken sampler used instead
            keep = rng.random() < flat[7]
            t = 7 if keep else int(rng.choice(V, p=np.r_[flat[:7], 0, flat[8:]] / (1 - flat[7])))
            trace.append(
                {
                    "request_id": rid,
                    "step": step,
                    "phase": "verify",
                    "num_computed_tokens": PLEN + out - 1,
                    "num_scheduled_tokens": 2,
                    "num_draft_tokens": 1,
                    "num_accepted_tokens": int(keep),
                    "spec_sampled": True,
                    "draft_token_ids": [7],
                    "draft_token_probs": None,
                }
            )
            emitted = [7, int(rng.choice(V, p=p))] if keep else [t]
            for k, e in enumerate(emitted):
                top = np.argsort(-p)[:TOPK]
                tok.append({"request_id": rid, "position": out + k, "token_id": e, "engine_logprob": math.log(p[e])})
                ref.append(
                    {
                        "request_id": rid,
                        "position": out + k,
                        "ref_logprob": math.log(p[e]),
                        "ref_topk_ids": top.tolist(),
                        "ref_topk_logprobs": np.log(p[top]).tolist(),
                    }
                )
            out += len(emitted)
    requests = pa.table({"request_id": [f"r{r}" for r in range(40)], "prompt_token_ids": [[1] * PLEN] * 40})
    tables = pa.Table.from_pylist(tok), pa.Table.from_pylist(ref), requests, pa.Table.from_pylist(trace)
    found, info = decision_test(*tables, {"temperature": 1.0}, 0.01, alpha=1e-6)
    assert info["smallest"] > info["threshold"]  # no decision alone
    assert len(found) >= 30 and all("together" in f[2] for f in found.values())
