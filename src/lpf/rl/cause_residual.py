"""The statistical causes on one residual: what is left of d once the exact causes are taken out. Pure numpy.

`fit_side(inp, e, floor, rng, idx) -> Side`. `e` is one residual per scored token: with a reference,
`lpf.rl.causes` fits the rollout side (reference - rollout) and the trainer side (trainer -
reference) apart, since a batch-shape effect lives in the trainer and a state path in the engine;
without one, the whole residual. On u = e / max(sensitivity, S_MIN):
- batch shape: of the dump's batch features (the trainer's micro-batches: tested on the trainer side,
  or on the whole residual without a reference), the one whose groups separate most (after the
  position profile is divided out), by permutation (`lpf.rl.cause_tests`): across every response on
  the trainer side, within steps on the whole residual (where the rollout's own level may follow the
  prompt the layout follows too);
- position growth: Spearman of |u| against position, positions shuffled within responses;
- the variance model v[g, b] = phi + beta[g] + pi[b] with the factors that passed;
- the dtype floor: phi within KAPPA^2 sigma_F^2 (sigma_F from the floor row of this side's dtype
  pair) is floor, the rest unexplained; responses whose level is an outlier against the model
  (robust z >= 6 and 10x) put their excess in unexplained.
`Side.weights` are per-token fractions of |e| for dtype_floor, unexplained, batch_shape and
position_growth (each row sums to 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lpf.analysis.departure import S_MIN
from lpf.rl import cause_tests as ct
from lpf.rl.spikes import robust_z

KAPPA = 2.0  # floors.KAPPA: an honest pair stays within twice the table's level
OUTLIER_Z = 6.0
OUTLIER_RATIO = 10.0
MAX_GROUPS = 6  # batch groups: more values are cut at their quantiles (cells need tokens at every position)
SIDE_CAUSES = ("dtype_floor", "unexplained", "batch_shape", "position_growth")
BLIND = 1e-6  # |rollout logprob| below this: the rollout reported certainty


@dataclass
class Side:
    tests: dict
    weights: dict
    model: dict = field(default_factory=dict)
    outliers: np.ndarray | None = None


def floor_sigma(floor: dict | None) -> float | None:
    """sigma of u for an honest pair at these dtypes (nats of logit error), from a floor-table row."""
    if not floor:
        return None
    tok, settled = floor.get("token") or {}, floor.get("settled") or {}
    return max(
        (tok.get("median") or 0.0) / 0.6745,
        (tok.get("q99") or 0.0) / 2.576,
        (settled.get("q99") or 0.0) / S_MIN / 2.576,
        1e-12,
    )


def _groups(x: np.ndarray) -> np.ndarray:
    vals = np.unique(x)
    if vals.size <= MAX_GROUPS:
        return np.searchsorted(vals, x)
    edges = np.unique(np.quantile(x, np.linspace(0, 1, MAX_GROUPS + 1)[1:-1]))
    return np.searchsorted(edges, x, side="right")


def _position_test(inp, u, rng, idx):
    """(Spearman of |u| against position, its p-value with positions shuffled within responses). A
    position's rank is a function of its value, so a shuffle permutes the ranks: no sort per shuffle."""
    if idx.size < 3:
        return 0.0, 1.0
    rx, ry = ct.average_ranks(inp.tok_pos[idx]), ct.average_ranks(np.abs(u[idx]))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    if den == 0:
        return 0.0, 1.0
    blocks = inp.tok_resp[idx]
    by_block = np.argsort(blocks, kind="stable")
    obs = float((rx * ry).sum() / den)
    shuffled = [
        float((rx[ct.within_permutation(blocks, rng, by_block)] * ry).sum() / den) for _ in range(ct.N_SHUFFLES)
    ]
    return obs, ct.permutation_p(obs, shuffled)


def _batch_test(inp, u, bucket, rng, idx, within_steps: bool):
    """(feature, groups per response, statistic, p) of the batch feature that separates most, or None.
    The feature is shuffled across all responses, or only within each step (`within_steps`: when the
    residual also holds the rollout's errors, whose level may follow the prompt that the micro-batch
    layout also follows)."""
    u2, b_idx = (u * u)[idx], bucket[idx]
    # the position profile out first: a feature that tracks response length must not pass for batch shape
    med_b = np.array([np.median(u2[b_idx == b]) if np.any(b_idx == b) else 1.0 for b in range(bucket.max() + 1)])
    levels = ct.response_levels(u2 / np.maximum(med_b[b_idx], 1e-300), inp.tok_resp[idx], inp.steps.size)
    blocks = inp.steps if within_steps else np.zeros(inp.steps.size, dtype=np.int64)
    best = None
    for name, x in inp.batch.items():
        g = _groups(x)
        obs = ct.kruskal(levels, g)
        shuffled = [ct.kruskal(levels, ct.shuffle_within(g, blocks, rng)) for _ in range(ct.N_SHUFFLES)]
        p = ct.permutation_p(obs, shuffled)
        if best is None or (p, -obs) < (best[3], -best[2]):
            best = (name, g, obs, p)
    return best


def quiet_sigma(inp, e: np.ndarray, tokens: np.ndarray) -> float | None:
    """sigma of u over the dump's own quiet tokens (`tokens`: indices), as `floor_sigma` reads a table row:
    the larger of the median's and the 99th percentile's Gaussian sigma. None without enough of them."""
    live = tokens[np.nan_to_num(inp.sensitivity[tokens]) >= S_MIN]  # as fit_side: settled tokens left out
    tokens = live if live.size >= 4 * ct.MIN_CELL else tokens
    if tokens.size < 2 * ct.MIN_CELL:
        return None
    u = np.abs(e[tokens]) / np.maximum(np.nan_to_num(inp.sensitivity[tokens]), S_MIN)
    return max(float(np.median(u)) / 0.6745, float(np.quantile(u, 0.99)) / 2.576, 1e-12)


def fit_side(
    inp,
    e: np.ndarray,
    floor: dict | None,
    rng: np.random.Generator,
    idx: np.ndarray,
    batch_mode: str = "within steps",
    floor_override: tuple | None = None,
    drop_settled: bool = False,
) -> Side:
    """`floor_override` (sigma or None, what it is): the floor when the dump records no dtype, estimated
    from its quiet responses; sigma None = it cannot be judged (the base level is then unexplained, never
    floor). Weights are meant for the tokens of `idx`' responses (a step's own fit: `lpf.rl.causes`).
    `drop_settled`: the tests and fits leave settled tokens out (a step's own fit, where a confident model's
    late tokens would hide a growing error; the pooled fit keeps them, as it was calibrated).
    `batch_mode`: "all" (the trainer side: shuffle the feature across every response), "within steps"
    (the whole residual), or "none" (the rollout side: the dump's micro-batches are the trainer's).
    Where the rollout's logprob is 0 (a lone token kept by top-p/top-k reports 0 under processed
    logprobs, whatever the engine's error) its side holds nothing to measure: such tokens are left
    out of the fits and tests of every side but the trainer's (they are still allocated)."""
    n_resp = inp.steps.size
    if batch_mode != "all":
        idx = idx[np.abs(inp.r[idx]) > BLIND]
    if drop_settled:
        # settled tokens (sensitivity below S_MIN) show rounding, not logit noise: a logit error that grows
        # along the response cannot show on them, and a confident model settles more tokens late than early
        live = idx[np.nan_to_num(inp.sensitivity[idx]) >= S_MIN]
        if live.size >= 4 * ct.MIN_CELL:
            idx = live
    sens = np.maximum(np.nan_to_num(inp.sensitivity), S_MIN)
    u = e / sens
    idx_all = idx
    if drop_settled:
        idx = _reached(inp, idx)
    bucket = ct.position_bucket(inp.tok_pos)
    n_b = int(bucket.max()) + 1
    batch = None
    if inp.batch and batch_mode != "none":
        batch = _batch_test(inp, u, bucket, rng, idx, batch_mode == "within steps")
    group_resp = batch[1] if batch is not None else np.zeros(n_resp, dtype=np.int64)
    n_g = int(group_resp.max()) + 1
    g_tok = group_resp[inp.tok_resp]
    v, cnt = ct.cell_variances(u[idx], g_tok[idx], bucket[idx], n_g, n_b)
    full = ct.fit_variance(v, cnt, use_groups=batch is not None, use_positions=True)
    # a factor is material against the level it adds to (in the cleanest group for batch shape, at
    # the first position for growth), never below the dtype floor: rounding that varies is rounding
    sigma_f = floor_sigma(floor) if floor_override is None else floor_override[0]
    judged = floor_override is None or floor_override[0] is not None
    floor2 = (sigma_f or 0.0) ** 2
    w0, wb = cnt[:, 0].astype(np.float64), cnt.sum(axis=0).astype(np.float64)
    tests = {}
    batch_ok = False
    if batch is not None:
        level_g = full["phi"] + (float((full["pi"] * wb).sum() / wb.sum()) if wb.sum() else 0.0)
        b_effect = (level_g + float(full["beta"].max())) / max(level_g, floor2, 1e-300)
        batch_ok = batch[3] <= ct.P_MAX and b_effect >= ct.EFFECT_MIN
        x = inp.batch[batch[0]]
        levels = {}
        for gi in range(n_g):
            vals = np.unique(x[group_resp == gi])
            if vals.size:
                lab = f"{vals.min():g}" if vals.size == 1 else f"{vals.min():g}-{vals.max():g}"
                levels[lab] = float(np.sqrt(full["phi"] + full["beta"][gi]))
        tests["batch_shape"] = {
            "status": "passed" if batch_ok else "failed",
            "feature": batch[0],
            "p_value": batch[3],
            "variance_ratio": b_effect,
            "features_tested": sorted(inp.batch),
            "levels": levels,
        }
        if not batch_ok:  # groups that are no cause must not soak up the position profile's variance
            full = ct.fit_variance(v, cnt, use_groups=False, use_positions=True)
    level0 = full["phi"] + (float((full["beta"] * w0).sum() / w0.sum()) if w0.sum() else 0.0)
    rho, p_pos = _position_test(inp, u, rng, idx)
    late = [b for b in range(n_b) if wb[b] > 0][-2:]  # the latest positions: growth is where it ends up
    pi_late = float(np.mean(full["pi"][late])) if late else 0.0
    pos_effect = (level0 + pi_late) / max(level0, floor2, 1e-300)
    pos_ok = p_pos <= ct.P_MAX and rho > 0 and pos_effect >= ct.EFFECT_MIN
    tests["position_growth"] = {
        "status": "passed" if pos_ok else "failed",
        "spearman": rho,
        "p_value": p_pos,
        "variance_ratio": pos_effect,
        "profile": {
            ct.bucket_label(b): float(np.sqrt(full["phi"] + full["pi"][b])) for b in range(n_b) if cnt[:, b].sum()
        },
    }

    model = ct.fit_variance(v, cnt, use_groups=batch_ok, use_positions=pos_ok)
    beta = model["beta"] if batch_ok else np.zeros(n_g)
    pi = model["pi"] if pos_ok else np.zeros(n_b)
    phi = model["phi"]
    if not judged:
        v_floor, v_sys = 0.0, phi
    elif sigma_f is None or phi <= (KAPPA * sigma_f) ** 2:
        v_floor, v_sys = phi, 0.0
    else:
        v_floor, v_sys = sigma_f**2, phi - sigma_f**2
    tests["dtype_floor"] = {
        "status": "cannot judge" if not judged else "inside" if v_sys == 0 else "exceeded",
        "sigma_floor": sigma_f,
        "sigma_residual_base": float(np.sqrt(phi)),
        "pair": (floor or {}).get("pair") if floor_override is None else None,
        "detail": (floor or {}).get("detail") if floor_override is None else floor_override[1],
    }

    sB, sP = np.sqrt(beta)[g_tok], np.sqrt(pi)[bucket]
    sF, sS = np.sqrt(v_floor), np.sqrt(v_sys)
    sigma = np.sqrt(v_floor + v_sys + beta[g_tok] + pi[bucket])
    ratio = _response_ratio(u[idx_all], sigma[idx_all], inp.tok_resp[idx_all], n_resp)
    fitted = np.bincount(inp.tok_resp[idx_all], minlength=n_resp) > 0  # the others' ratio 1 is no observation
    z = np.full(n_resp, np.nan)
    if fitted.any():
        z[fitted], _ = robust_z(np.log10(np.maximum(ratio[fitted], 1e-300)))
    outlier = (np.nan_to_num(z, nan=-np.inf) >= OUTLIER_Z) & (ratio >= OUTLIER_RATIO)
    excess = np.where(outlier[inp.tok_resp], 1.0 - 1.0 / np.maximum(ratio[inp.tok_resp], 1.0), 0.0)
    tot = sF + sS + sB + sP
    tot = np.where(tot > 0, tot, 1.0)
    core = 1.0 - excess
    weights = {
        "dtype_floor": core * sF / tot,
        "unexplained": core * sS / tot + excess,
        "batch_shape": core * sB / tot,
        "position_growth": core * sP / tot,
    }
    none = (sF + sS + sB + sP) == 0  # no level at all (an exact side): its rounding is floor
    weights["dtype_floor"] = np.where(none, core, weights["dtype_floor"])
    if not np.isfinite(v).any():
        # too few tokens for any cell: no level was measured, so nothing may be called floor wholesale;
        # each token is judged on its own against the floor's band (beyond it: unexplained)
        band = KAPPA * 2.576 * sigma_f if (judged and sigma_f) else 0.0
        inside = np.abs(u) <= band if judged and sigma_f else np.zeros(u.size, dtype=bool)
        if judged and sigma_f is None:
            inside = np.ones(u.size, dtype=bool)
        weights = {c: np.zeros(u.size) for c in SIDE_CAUSES}
        weights["dtype_floor"], weights["unexplained"] = inside * 1.0, (~inside) * 1.0
        tests["dtype_floor"].update(
            status="exceeded" if (~inside).any() else "inside",
            unmeasured=f"{idx.size} tokens to measure (the rollout reports certainty on the rest): too few for the "
            f"variance model; every token judged on its own against the floor's band ({band:.3g})",
        )
    tests["unexplained"] = {"n_outlier_responses": int(outlier.sum()), "sigma_systematic": sS}
    return Side(
        tests,
        weights,
        {
            "phi": phi,
            "v_floor": v_floor,
            "v_sys": v_sys,
            "batch_feature": batch[0] if batch_ok else None,
            "beta": beta.tolist(),
            "pi": pi.tolist(),
        },
        outlier,
    )


def _reached(inp, idx) -> np.ndarray:
    """`idx` without the positions fewer than half of its responses reach (by their length, settled tokens
    included): in a step's own fit, one long response's tail is no position profile (a multi-turn sample
    lying in its last turn would read as growth)."""
    ids = np.unique(inp.tok_resp[idx])
    if ids.size < 4:
        return idx
    length = np.zeros(inp.steps.size, dtype=np.int64)
    np.maximum.at(length, inp.tok_resp, inp.tok_pos + 1)
    reach = np.bincount(length[ids], minlength=int(length.max()) + 2)[::-1].cumsum()[::-1]  # responses longer than p
    keep = idx[reach[inp.tok_pos[idx] + 1] * 2 >= ids.size]
    return keep if keep.size >= 4 * ct.MIN_CELL else idx


def _response_ratio(u, sigma, resp, n_resp) -> np.ndarray:
    """Per response: its median |u| over the median the model predicts for its tokens."""
    order = np.argsort(resp, kind="stable")
    cnt = np.bincount(resp, minlength=n_resp)
    starts = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    au, sg = np.abs(u[order]), sigma[order] * 0.6745
    out = np.ones(n_resp)
    for j in np.flatnonzero(cnt):
        s = slice(starts[j], starts[j] + cnt[j])
        pred = np.median(sg[s])
        out[j] = np.median(au[s]) / pred if pred > 0 else 1.0
    return out
