"""The statistics behind `lpf.rl.causes`: one test per named cause of rollout/trainer mismatch. Pure numpy.

Per scored token, d = trainer - rollout logprob.

Exact causes (a per-token prediction of d exists):
  `exact_fit(d, comps, resp)` least absolute deviations d ~ sum_j beta_j c_j over the tokens where
  every c_j is known, standard errors by resampling responses. A cause passes (`exact_passes`) when its beta is
  within BETA_TOL of 1 (the offset IS the prediction, not a correlate of it) with beta / se >= Z_MIN:
  processed logprobs (c = log kept mass, which a processed logprob subtracts exactly) and stale
  weights (c = the trainer's, or the reference's, score now minus its score at the generating step).
  The tolerance widens by two standard errors: another cause's noise (a large state error is also
  biased: tokens are sampled where the rollout overrates them) makes the slope uncertain, not wrong.

Statistical causes, on the residual e (d minus the exact causes that passed), normalised by the
token's sensitivity s (`u = e / max(s, S_MIN)`: one nat of logit noise moves a logprob by s):
  `cell_variances` the robust variance of u (median |u| / 0.6745, squared) in each cell of
  (batch group, position bucket); buckets are 0, 1, 2-3, 4-7, ... (log2 of the position).
  `fit_variance(cells, use_groups, use_positions)` independent error sources add in variance:
  v[g, b] = phi + beta[g] + pi[b], beta >= 0 with its smallest group at 0, pi >= 0 with bucket 0 at 0
  (backfitting, weighted by the cells' token counts).
  `permutation_p(stat, shuffles)` the share of shuffled statistics at least the observed one:
  position growth shuffles positions within each response (keeps every response's own level),
  batch shape shuffles the batch feature across responses within each step (keeps step levels),
  its statistic a stratified Kruskal-Wallis: the responses' median u^2 ranked within their step,
  the groups' mean ranks against 1/2 (`rank_spread`).
  A statistical cause passes with p <= P_MAX and an effect of at least EFFECT_MIN in variance (the
  late positions' / the worst group's sigma at least twice the baseline's).
"""

from __future__ import annotations

import numpy as np

BETA_TOL = 0.2
Z_MIN = 10.0
P_MAX = 0.01
EFFECT_MIN = 4.0  # variance ratio (sigma ratio 2)
MIN_CELL = 8  # tokens for a cell's robust variance
N_SHUFFLES = 199
N_BOOT = 40  # response resamples for the exact fit's standard error
MAX_TOKENS_TESTED = 50_000  # the statistical tests and the variance fit subsample beyond this (shares: every token)
MAX_TOKENS_FIT = 200_000  # the exact fit subsamples beyond this


def _lad(C: np.ndarray, y: np.ndarray, w0: np.ndarray | None = None, iters: int = 60) -> np.ndarray:
    """Least absolute deviations by iteratively reweighted least squares (`w0`: token multiplicities)."""
    w0 = np.ones(y.size) if w0 is None else w0
    scale = max(float(np.median(np.abs(y))), 1e-12)
    beta = np.linalg.lstsq(C * np.sqrt(w0)[:, None], y * np.sqrt(w0), rcond=None)[0]
    for _ in range(iters):
        w = w0 / np.maximum(np.abs(y - C @ beta), 1e-6 * scale)
        sw = np.sqrt(w)
        new = np.linalg.lstsq(C * sw[:, None], y * sw, rcond=None)[0]
        if np.allclose(new, beta, rtol=1e-9, atol=1e-12):
            return new
        beta = new
    return beta


def exact_fit(
    d: np.ndarray, comps: dict[str, np.ndarray], resp: np.ndarray | None = None, rng: np.random.Generator | None = None
) -> dict[str, dict]:
    """{name: {beta, se, z, n, ols_beta}}: the joint least-absolute-deviations fit of d on the
    components (tokens where every one is known), its standard error by resampling whole responses
    (`resp`, N_BOOT times; by token without it). LAD, not least squares: another cause's error is
    skewed (a state error is biased: tokens are sampled where the rollout overrates them, so it
    correlates with the kept mass), and the median token still obeys d = c exactly."""
    names = [k for k, c in comps.items() if c is not None]
    if not names:
        return {}
    C = np.stack([comps[k] for k in names], axis=1)
    ok = np.isfinite(C).all(axis=1) & np.isfinite(d)
    C, y = C[ok], d[ok]
    if not ok.any() or not np.any(C):
        return {k: {"beta": None, "se": None, "z": 0.0, "n": int(ok.sum())} for k in names}
    rng = rng or np.random.default_rng(0)
    if y.size > MAX_TOKENS_FIT:
        keep = np.sort(rng.choice(y.size, MAX_TOKENS_FIT, replace=False))
        C, y = C[keep], y[keep]
        groups = resp[ok][keep] if resp is not None else np.arange(y.size)
    else:
        groups = resp[ok] if resp is not None else np.arange(y.size)
    beta = _lad(C, y)
    ols = np.linalg.lstsq(C, y, rcond=None)[0]
    _, g = np.unique(groups, return_inverse=True)
    n_g = int(g.max()) + 1
    boots = []
    for _ in range(N_BOOT):
        w = np.bincount(rng.integers(0, n_g, n_g), minlength=n_g)[g].astype(np.float64)
        if w.sum() and np.any(C[w > 0]):
            boots.append(_lad(C, y, w, iters=30))
    se = np.std(np.asarray(boots), axis=0, ddof=1) if len(boots) > 1 else np.full(len(names), np.inf)
    out = {}
    for j, k in enumerate(names):
        b, s = float(beta[j]), float(se[j])
        out[k] = {
            "beta": b,
            "se": s,
            "z": float(abs(b) / s) if s > 0 else (np.inf if b else 0.0),
            "n": int(y.size),
            "ols_beta": float(ols[j]),
        }
    return out


def exact_passes(fit: dict | None) -> bool:
    return bool(
        fit and fit["beta"] is not None and abs(fit["beta"] - 1.0) <= BETA_TOL + 2 * fit["se"] and fit["z"] >= Z_MIN
    )


def position_bucket(pos: np.ndarray) -> np.ndarray:
    """0 for position 0, else 1 + floor(log2(position)): 0 | 1 | 2-3 | 4-7 | 8-15 | ..."""
    p = np.asarray(pos, dtype=np.int64)
    out = np.zeros(p.shape, dtype=np.int64)
    nz = p > 0
    out[nz] = 1 + np.floor(np.log2(p[nz])).astype(np.int64)
    return out


def bucket_label(b: int) -> str:
    if b == 0:
        return "0"
    lo, hi = 2 ** (b - 1), 2**b - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


def cell_variances(u: np.ndarray, group: np.ndarray, bucket: np.ndarray, n_groups: int, n_buckets: int):
    """(v [G, B] robust variance or NaN, n [G, B] tokens)."""
    v = np.full((n_groups, n_buckets), np.nan)
    n = np.zeros((n_groups, n_buckets), dtype=np.int64)
    key = group * n_buckets + bucket
    order = np.argsort(key, kind="stable")
    ks, starts = np.unique(key[order], return_index=True)
    ends = np.append(starts[1:], order.size)
    au = np.abs(u[order])
    for k, a, b in zip(ks, starts, ends):
        g, bb = divmod(int(k), n_buckets)
        n[g, bb] = b - a
        if b - a >= MIN_CELL:
            v[g, bb] = (np.median(au[a:b]) / 0.6745) ** 2
    return v, n


def fit_variance(v: np.ndarray, n: np.ndarray, use_groups: bool, use_positions: bool, iters: int = 500) -> dict:
    """phi, beta [G], pi [B] of v[g, b] ~ phi + beta[g] + pi[b] (see the module doc): weighted least
    squares with every term >= 0 and pi[0] = 0, by exact block-coordinate descent (each block's
    constrained minimiser in turn: a convex problem, so it converges to the optimum); then the
    smallest group's beta is moved into phi (the same fit)."""
    ok = np.isfinite(v)
    w = np.where(ok, n, 0).astype(np.float64)
    vv = np.where(ok, v, 0.0)
    G, B = v.shape
    beta, pi = np.zeros(G), np.zeros(B)
    if not w.sum():
        return {"phi": 0.0, "beta": beta, "pi": pi}
    wb, wg, wt = w.sum(axis=0), w.sum(axis=1), w.sum()
    phi = float((vv * w).sum() / wt)
    for _ in range(iters):
        old = (phi, beta.copy(), pi.copy())
        phi = max(float(((vv - beta[:, None] - pi[None, :]) * w).sum() / wt), 0.0)
        if use_positions:
            pi = np.maximum(
                np.where(wb > 0, ((vv - phi - beta[:, None]) * w).sum(axis=0) / np.maximum(wb, 1e-300), 0.0), 0.0
            )
            pi[0] = 0.0
        if use_groups:
            beta = np.maximum(
                np.where(wg > 0, ((vv - phi - pi[None, :]) * w).sum(axis=1) / np.maximum(wg, 1e-300), 0.0), 0.0
            )
        scale = max(phi, float(beta.max()), float(pi.max()), 1e-300)
        if (abs(phi - old[0]) + np.abs(beta - old[1]).max() + np.abs(pi - old[2]).max()) <= 1e-10 * scale:
            break
    if use_groups and (wg > 0).any():
        low = float(np.min(beta[wg > 0]))
        beta, phi = beta - low, phi + low
    return {"phi": phi, "beta": np.maximum(beta, 0.0) * (wg > 0), "pi": pi * (wb > 0)}


def permutation_p(observed: float, shuffled: list[float]) -> float:
    s = np.asarray(shuffled, dtype=np.float64)
    return float((1 + np.count_nonzero(s >= observed)) / (1 + s.size))


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation with average ranks for ties."""
    if x.size < 3:
        return 0.0
    rx, ry = average_ranks(x), average_ranks(y)
    rx -= rx.mean()
    ry -= ry.mean()
    den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / den) if den > 0 else 0.0


def within_permutation(blocks: np.ndarray, rng: np.random.Generator, by_block: np.ndarray | None = None) -> np.ndarray:
    """Indices that permute positions inside each block (same block id) and leave blocks in place:
    `labels[perm]` is `labels` shuffled within blocks. `by_block` (np.argsort(blocks, kind="stable"))
    may be passed in when many permutations are drawn."""
    by_block = np.argsort(blocks, kind="stable") if by_block is None else by_block
    keys = blocks[by_block].astype(np.float64) + rng.random(blocks.size)  # block ids are integers: order kept
    perm = np.empty(blocks.size, dtype=np.int64)
    perm[by_block] = by_block[np.argsort(keys, kind="stable")]
    return perm


def shuffle_within(labels: np.ndarray, blocks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`labels` permuted inside each block (the same block id), blocks untouched."""
    return labels[within_permutation(blocks, rng)]


def average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    r = np.empty(x.size)
    r[order] = np.arange(1, x.size + 1)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(inv, weights=r) / counts)[inv]


def response_levels(u2: np.ndarray, resp: np.ndarray, n_resp: int) -> np.ndarray:
    """Per response: the median of its tokens' u^2 (NaN for a response without tokens)."""
    order = np.argsort(resp, kind="stable")
    cnt = np.bincount(resp, minlength=n_resp)
    starts = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    vals = u2[order]
    out = np.full(n_resp, np.nan)
    for j in np.flatnonzero(cnt):
        out[j] = np.median(vals[starts[j] : starts[j] + cnt[j]])
    return out


def kruskal(levels: np.ndarray, groups: np.ndarray) -> float:
    """Kruskal-Wallis H of the responses' levels across groups (average ranks for ties): how far the
    groups' mean ranks are apart. Rank-based, so a few clean responses in a group of their own
    separate as surely as many do."""
    ok = np.isfinite(levels)
    x, g = levels[ok], groups[ok]
    n = x.size
    if n < 3 or np.unique(g).size < 2:
        return 0.0
    order = np.argsort(x, kind="stable")
    ranks = np.empty(n)
    ranks[order] = np.arange(1, n + 1)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    ranks = (np.bincount(inv, weights=ranks) / counts)[inv]  # average rank of each distinct value
    sums = np.bincount(g, weights=ranks)
    cnt = np.bincount(g).astype(np.float64)
    has = cnt > 0
    return float(12.0 / (n * (n + 1)) * (sums[has] ** 2 / cnt[has]).sum() - 3 * (n + 1))
