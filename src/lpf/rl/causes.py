"""Rollout/trainer mismatch split into named causes, per token, then per step and per sequence. Pure numpy.

`explain(inputs, seed=0) -> Explanation` (inputs: `lpf.rl.cause_inputs.ExplainInputs`). Per scored
token d = t - r (trainer - rollout logprob); its mass is |d| (and, for the framework's own metric,
that metric's per-token term, split in the same proportions). The tests are `lpf.rl.cause_tests`:

1. Exact causes, one least-absolute-deviations fit of d on their per-token predictions: processed logprobs
   (c = log kept mass; d = c exactly when the rollout reports post-filter logprobs; without the rollout's
   settings, c from the top-p / top-k `lpf.rl.nucleus` infers) and stale weights (c = score now - score
   of the generating policy, the lag that fits best; applied to the responses whose |d| it lowers).
   Processed logprobs are also fitted step by step and applied at the steps that carry them (a cause at
   3 of 12 steps is found there). A cause that passes is subtracted: e = d - sum c.
2. The residual's statistical causes (`lpf.rl.cause_residual.fit_side`): position growth, batch
   shape, the dtype floor (from the floor table, `lpf.analysis.floors`) and what stays unexplained.
   With a reference f the residual is split exactly into its rollout side (f - r - exact causes:
   an engine's state path) and its trainer side (t - f: a micro-batch-dependent trainer), each fitted
   on its own against its own floor (the side's dtype against the reference's); without one, the
   whole residual against the rollout/trainer floor (no dtype recorded: the quiet responses' level, or
   cannot judge). A cause is found when it passes on either side. When some steps spike, each spike
   step and the quiet steps are fitted again on their own (`lpf.rl.cause_steps`).
3. Allocation, per token: |d| shared in proportion to |c_processed|, |c_stale| and each side's |e|,
   and a side's part in proportion to its model's sigmas (floor, unexplained, batch[g], position[b]):
   the convention the simulator's ground truth uses with its true components. A spike step's floor is
   capped at what a quiet step carries.

`Explanation.shares` is [n_tokens, len(CAUSES)] (rows sum to 1 where |d| > 0), `tests` the evidence
of each cause, `model` the fitted variance model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lpf.rl import cause_tests as ct
from lpf.rl import nucleus
from lpf.rl.cause_inputs import ExplainInputs
from lpf.rl.cause_residual import SIDE_CAUSES, fit_side
from lpf.rl.cause_steps import cap_floor_at_spikes, local_fits, local_tests, side_floors

CAUSES = ("processed_logprobs", "stale_weights", "batch_shape", "position_growth", "dtype_floor", "unexplained")
NAMED_MIN = 0.01  # a cause that passes its test but carries less than this share is reported, not named


@dataclass
class Explanation:
    shares: np.ndarray
    tests: dict
    model: dict = field(default_factory=dict)


def _exact(inp: ExplainInputs, d: np.ndarray) -> tuple[dict, dict]:
    """(tests, {cause: per-token component (0 where not applied)})."""
    tests, comps = {}, {}
    lk = inp.log_kept
    inferred = None
    _, step_code = np.unique(inp.steps, return_inverse=True)
    tok_step = step_code[inp.tok_resp]
    n_steps = int(step_code.max()) + 1 if step_code.size else 0
    if lk is None and inp.top_cum is not None:  # the rollout's settings unknown: read them off d
        grid = inp.kept_grid[0] if inp.kept_grid else ()
        inferred = nucleus.infer(d, inp.top_cum, tok_step, n_steps, grid)
        steps_of = np.unique(inp.steps)
        inferred["steps"] = [int(steps_of[c]) for c in inferred["steps"]]
        inferred["per_step"] = {int(steps_of[c]): v for c, v in inferred["per_step"].items()}
        if inferred["setting"] is None:
            tests["processed_logprobs"] = {
                "status": "failed",
                "inferred": inferred,
                "reason": "no step's d matches the log of a head of the reference's distribution (no top-p "
                "or top-k the rollout could have filtered with)",
            }
        else:
            lk = nucleus.log_kept(inp.top_cum, inferred["top_p"], inferred["top_k"], inp.kept_grid)
            inferred["tokens_unknown"] = int(np.count_nonzero(~np.isfinite(lk)))
    if lk is not None and np.nanmax(np.abs(lk)) < 1e-9:
        tests["processed_logprobs"] = {
            "status": "not applicable",
            "reason": "the rollout sampled unfiltered (top-p 1, top-k off): processed and raw logprobs coincide",
        }
        lk = None
    lags = sorted(inp.stale_scores)

    def fit_with(lk_, stale):
        return _fit_for(d, lk_, stale, inp.tok_resp)

    cand = [(None, fit_with(lk, None))] + [(k, fit_with(lk, inp.stale_base - inp.stale_scores[k])) for k in lags]
    best_lag, best = cand[0]
    for k, fit in cand[1:]:
        z = (fit.get("stale_weights") or {}).get("z") or 0.0
        if ct.exact_passes(fit.get("stale_weights")) and z > ((best.get("stale_weights") or {}).get("z") or 0.0):
            best_lag, best = k, fit
    stale_ok = best_lag is not None
    if stale_ok and best_lag in inp.log_kept_lag and inp.log_kept_lag[best_lag] is not None and lk is not None:
        lk = inp.log_kept_lag[best_lag]  # the kept mass of the policy that generated the rollouts
        best = fit_with(lk, inp.stale_base - inp.stale_scores[best_lag])
    if lk is not None:
        f = best.get("processed_logprobs")
        stale_c = inp.stale_base - inp.stale_scores[best_lag] if stale_ok else None
        at, per_step = _steps_applied(d, lk, stale_c, tok_step, n_steps, inp.tok_resp, ct.exact_passes(f))
        steps_of = np.unique(inp.steps)
        ok = bool(at.any())
        tests["processed_logprobs"] = {
            "status": "passed" if ok else "failed",
            "fit": f,
            "test": "d = log kept mass per token: least-absolute-deviations slope within "
            f"{ct.BETA_TOL:g} (+ 2 standard errors) of 1 and {ct.Z_MIN:g} "
            f"standard errors from 0, over the dump and step by step (a step whose own slope is far from 1 "
            f"does not carry it)",
            "sampling": inp.sampling,
            "inferred": inferred,
            "steps": [int(steps_of[c]) for c in np.flatnonzero(at)],
            "n_steps": n_steps,
            "step_fits": {int(steps_of[c]): v for c, v in per_step.items()},
        }
        if ok:
            comps["processed_logprobs"] = np.where(at[tok_step], np.nan_to_num(lk), 0.0)
    if lags:
        if stale_ok:
            c = np.nan_to_num(inp.stale_base - inp.stale_scores[best_lag])
            rest = d - comps.get("processed_logprobs", 0.0)
            n = inp.steps.size
            before = np.bincount(inp.tok_resp, weights=np.abs(rest), minlength=n)
            after = np.bincount(inp.tok_resp, weights=np.abs(rest - c), minlength=n)
            applied = after < before
            comps["stale_weights"] = np.where(applied[inp.tok_resp], c, 0.0)
            f = best["stale_weights"]
        else:
            f = max(
                (fit.get("stale_weights") for _, fit in cand[1:] if fit.get("stale_weights")),
                key=lambda x: x.get("z") or 0.0,
                default=None,
            )
            applied = np.zeros(inp.steps.size, dtype=bool)
        tests["stale_weights"] = {
            "status": "passed" if stale_ok else "failed",
            "fit": f,
            "lag": best_lag,
            "source": inp.stale_source,
            "lags_tested": lags,
            "responses_applied": int(applied.sum()),
            "test": "d = score now - score of the policy LAG steps back: slope within "
            f"{ct.BETA_TOL:g} (+ 2 standard errors) of 1, {ct.Z_MIN:g} standard "
            f"errors from 0",
        }
    return tests, comps


MIN_STEP_TOKENS = 16


def _steps_applied(d, lk, stale, tok_step, n_steps, resp, pooled_ok):
    """(per step: carries the exact cause, {step code: its own fit}). Each step is fitted on its own:
    a cause at a few steps is found there whatever the clean majority does to the pooled slope. With
    the pooled fit passing, a step carries it unless its own slope clearly is not 1 (noisier small
    steps stay with the pool); with it failing, the steps whose own fit passes."""
    at = np.zeros(n_steps, dtype=bool)
    fits = {}
    for s in range(n_steps):
        m = np.flatnonzero(tok_step == s)
        if m.size < MIN_STEP_TOKENS or not np.isfinite(lk[m]).any():
            at[s] = pooled_ok
            continue
        comps = {"processed_logprobs": lk[m]}
        if stale is not None:
            comps["stale_weights"] = stale[m]
        f = ct.exact_fit(d[m], comps, resp[m]).get("processed_logprobs")
        if not f or f["beta"] is None:
            at[s] = pooled_ok
            continue
        fits[s] = {k: f[k] for k in ("beta", "se", "z", "n")}
        rejected = abs(f["beta"] - 1.0) > ct.BETA_TOL + 2 * f["se"]
        at[s] = ct.exact_passes(f) or (pooled_ok and not rejected)
    return at, fits


def _fit_for(d, lk, stale, resp):
    comps = {}
    if lk is not None:
        comps["processed_logprobs"] = lk
    if stale is not None:
        comps["stale_weights"] = stale
    return ct.exact_fit(d, comps, resp) if comps else {}


def explain(inp: ExplainInputs, seed: int = 0) -> Explanation:
    rng = np.random.default_rng(seed)
    d = inp.t - inp.r
    n_tok = d.size
    tests, comps = _exact(inp, d)
    for cause, why in inp.missing.items():
        tests.setdefault(cause, {"status": "untested", "missing": why})
    e = d - sum(comps.values()) if comps else d.copy()
    idx = np.arange(n_tok)
    if n_tok > ct.MAX_TOKENS_TESTED:
        idx = np.sort(rng.choice(n_tok, ct.MAX_TOKENS_TESTED, replace=False))
    if inp.reference is not None:
        e_t = inp.t - inp.reference
        residuals = {"rollout": e - e_t, "trainer": e_t}
    else:
        residuals = {"rollout and trainer": e}
    mode = {"rollout": "none", "trainer": "all", "rollout and trainer": "within steps"}
    overrides = side_floors(inp, residuals)
    sides = {
        name: fit_side(inp, res, inp.floors.get(name), rng, idx, batch_mode=mode[name], floor_override=overrides[name])
        for name, res in residuals.items()
    }
    local = local_fits(inp, residuals, sides, overrides, rng)
    col = {c: i for i, c in enumerate(CAUSES)}
    parts = np.zeros((n_tok, len(CAUSES)))
    for c, comp in comps.items():
        parts[:, col[c]] = np.abs(comp)
    for name, side in sides.items():
        mag = np.abs(residuals[name])
        weights = {c: side.weights[c].copy() for c in SIDE_CAUSES}
        for tok, fit in local.get(name, []):
            for c in SIDE_CAUSES:
                weights[c][tok] = fit.weights[c][tok]
        for c in SIDE_CAUSES:
            parts[:, col[c]] += mag * weights[c]
    denom = parts.sum(axis=1)
    ok = (denom > 0) & (np.abs(d) > 0)
    shares = np.divide(parts, denom[:, None], out=np.zeros_like(parts), where=ok[:, None])
    capped = cap_floor_at_spikes(inp, d, shares, col)
    for c in ("position_growth", "batch_shape", "dtype_floor", "unexplained"):
        per = {name: side.tests[c] for name, side in sides.items() if c in side.tests}
        if not per:  # batch shape without batch features: untested, with what inputs_of said is missing
            tests.setdefault(c, {"status": "untested", "missing": "the dump records no micro-batches"})
            continue
        tests[c] = _combine(c, per, tests.get(c), inp)
    local_tests(tests, local, inp)
    if capped:
        tests["dtype_floor"]["capped_at_spike_steps"] = capped
    outliers = np.zeros(inp.steps.size, dtype=bool)
    for side in sides.values():
        outliers |= side.outliers
    for fits in local.values():
        for tok, fit in fits:
            outliers[np.unique(inp.tok_resp[tok])] |= fit.outliers[np.unique(inp.tok_resp[tok])]
    # an outlier whose excess the exact causes took is no unexplained response
    a = np.abs(d)
    n_resp = inp.steps.size
    unexpl = np.bincount(inp.tok_resp, weights=a * shares[:, col["unexplained"]], minlength=n_resp)
    outliers &= unexpl > 0.05 * np.bincount(inp.tok_resp, weights=a, minlength=n_resp)
    tests["unexplained"]["outlier_responses"] = [inp.request_ids[i] for i in np.flatnonzero(outliers)[:50]]
    tests["unexplained"]["n_outlier_responses"] = int(outliers.sum())
    return Explanation(shares, tests, {name: side.model for name, side in sides.items()})


_TEXT = {
    "position_growth": f"|e| / sensitivity rises with position (Spearman, positions shuffled within responses, "
    f"p <= {ct.P_MAX:g}) and the two latest position buckets' variance >= {ct.EFFECT_MIN:g}x the "
    f"first position's (never below the dtype floor)",
    "batch_shape": f"|e| / sensitivity differs across the dump's micro-batch groups beyond the position profile "
    f"(feature shuffled across responses, within steps without a reference, p <= {ct.P_MAX:g}) by >= "
    f"{ct.EFFECT_MIN:g}x in variance over the cleanest group (never below the dtype floor)",
    "dtype_floor": "the residual's base level within 2x the floor table's for the side's dtype pair",
}


def _combine(cause: str, per: dict, prior: dict | None, inp: ExplainInputs) -> dict:
    """One test entry from the sides' (the first passing side's numbers at the top, every side under
    `sides`); an untested batch test stays untested."""
    if cause == "unexplained":
        return {"sigma_systematic": max((t.get("sigma_systematic") or 0.0) for t in per.values()), "sides": per}
    if cause == "dtype_floor":
        exceeded = [n for n, t in per.items() if t["status"] == "exceeded"]
        unjudged = [n for n, t in per.items() if t["status"] == "cannot judge"]
        first = per[exceeded[0]] if exceeded else per[unjudged[0]] if unjudged else next(iter(per.values()))
        return {
            **first,
            "status": "exceeded" if exceeded else "cannot judge" if unjudged else "inside",
            "side": exceeded[0] if exceeded else None,
            "sides": per,
            "test": _TEXT[cause],
        }
    passed = [n for n, t in per.items() if t["status"] == "passed"]
    name = passed[0] if passed else max(per, key=lambda n: per[n].get("variance_ratio", 1.0))
    out = {**per[name], "side": name, "sides": per, "test": _TEXT[cause]}
    if cause == "position_growth":
        out["layers"] = inp.layers
    return out
