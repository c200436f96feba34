"""The rollout's top-p / top-k read off its own logprobs, when the dump does not record them. Pure numpy.

Under processed logprobs (vLLM `logprobs_mode=processed_logprobs`) a reported logprob is the raw one
minus log(kept mass), so d = trainer - rollout = log kept mass, token by token. The kept set is a head
of the reference's distribution sorted by probability: under top-p P the shortest head whose
cumulative mass reaches P (vLLM keeps a token while the mass strictly before it is < P), under top-k K
the first K tokens. With the reference's cumulative top probabilities `cum` ([tokens, N], descending;
`lpf.rl.row_stats`), a token whose d matches log cum[k] within `tol` was filtered to the first k + 1
tokens, which says P lies in (cum[k-1], cum[k]] (or K = k + 1).

`infer(d, cum, step_code, n_steps)` matches every token with d < -tol, then per step takes the top-p
covered by the most tokens' intervals (and the top-k most tokens agree on); a step shows the filter
when at least MIN_COVER of its informative tokens agree and there are at least MIN_TOKENS of them.
The setting that the most agreeing tokens of those steps share wins (top-p or top-k), with the
interval of P that every one of them allows (reported as the round setting inside it, when one is:
`round_p`). `log_kept(cum, top_p, top_k, grid)` is the kept mass under a setting per token; where the kept
head is longer than N, the exact value `lpf rl rescore` stored for the top-p values of its grid, else NaN
(the reference's N tokens do not say: `lpf rl rescore --top-p P` gives it).
Not inferred: top-p and top-k together, min-p, a temperature other than the one `cum` was taken at.
"""

from __future__ import annotations

import numpy as np

MIN_COVER = 0.5
MIN_TOKENS = 8
MAX_PER_STEP = 4000  # informative tokens per step the interval sweep looks at


def tolerance(d: np.ndarray) -> np.ndarray:
    """How close d must come to a log cumulative mass: float32 logprobs on both sides and float32 sums."""
    return 2e-3 + 1e-2 * np.abs(d)


def _match(d: np.ndarray, cum: np.ndarray):
    """(matched mask, k per token) for tokens with d < -tol: k = the head length - 1 whose log mass is nearest d."""
    tol = tolerance(d)
    with np.errstate(divide="ignore", invalid="ignore"):
        lc = np.log(np.where(np.isfinite(cum) & (cum > 0), np.minimum(cum, 1.0), np.nan))
    dist = np.abs(lc - d[:, None])
    dist = np.where(np.isfinite(dist), dist, np.inf)
    k = np.argmin(dist, axis=1)
    best = dist[np.arange(d.size), k]
    # a kept mass beyond the stored head's total says nothing about which head it was: not counted
    last = np.nanmax(np.where(np.isfinite(lc), lc, -np.inf), axis=1)
    informative = (d < -tol) & np.isfinite(d) & (d <= last + tol)
    return informative, informative & (best <= tol), k


def _best_p(lo: np.ndarray, hi: np.ndarray) -> tuple[int, float, float]:
    """(tokens covered, lowest and highest P) of the point covered by the most intervals (lo, hi]."""
    if lo.size == 0:
        return 0, np.nan, np.nan
    best, at = 0, 0.0
    for p in np.unique(hi):
        n = int(np.count_nonzero((lo < p) & (p <= hi)))
        if n > best:
            best, at = n, float(p)
    cover = (lo < at) & (at <= hi)
    return best, float(lo[cover].max()), float(hi[cover].min())


def infer(d: np.ndarray, cum: np.ndarray, step_code: np.ndarray, n_steps: int, grid: tuple = ()) -> dict:
    """{setting, top_p, top_p_interval, top_k, steps (codes that show it), per_step {code: {...}}}; setting
    None when no step shows a filter."""
    informative, matched, k = _match(d, cum)
    prev = np.where(k > 0, cum[np.arange(d.size), np.maximum(k - 1, 0)], 0.0)
    here = cum[np.arange(d.size), k]
    per_step, shown = {}, []
    for s in range(n_steps):
        inf_s = np.flatnonzero(informative & (step_code == s))
        if inf_s.size < MIN_TOKENS:
            continue
        m = inf_s[matched[inf_s]][:MAX_PER_STEP]
        n_p, p_lo, p_hi = _best_p(prev[m], here[m])
        ks, kc = np.unique(k[m] + 1, return_counts=True) if m.size else (np.array([0]), np.array([0]))
        n_k, top_k = int(kc.max()), int(ks[np.argmax(kc)])
        cover = max(n_p, n_k) / inf_s.size
        per_step[s] = {
            "informative": int(inf_s.size),
            "top_p": p_hi if n_p >= n_k else None,
            "top_p_interval": [p_lo, p_hi] if n_p >= n_k else None,
            "top_k": top_k if n_k > n_p else None,
            "agree": cover,
        }
        if cover >= MIN_COVER:
            shown.append(s)
    out = {"setting": None, "top_p": None, "top_p_interval": None, "top_k": None, "steps": shown, "per_step": per_step}
    if not shown:
        return out
    m = np.flatnonzero(matched & np.isin(step_code, shown))[: MAX_PER_STEP * 4]
    n_p, p_lo, p_hi = _best_p(prev[m], here[m])
    ks, kc = np.unique(k[m] + 1, return_counts=True)
    if kc.max() > n_p:
        out.update(setting="top_k", top_k=int(ks[np.argmax(kc)]))
    else:
        out.update(setting="top_p", top_p=round_p(p_lo, p_hi, grid), top_p_interval=[p_lo, p_hi])
    return out


def round_p(lo: float, hi: float, grid: tuple) -> float:
    """The top-p to report for the interval (lo, hi]: the setting people write (a grid value) when one lies
    in it, else hi."""
    inside = [p for p in grid if lo < p <= hi + 1e-6]
    return float(min(inside, key=lambda p: abs(p - 0.5 * (lo + hi)))) if inside else float(hi)


def log_kept(
    cum: np.ndarray, top_p: float | None = None, top_k: int | None = None, grid: tuple | None = None
) -> np.ndarray:
    """Per token log of the mass a top-p (or top-k) filter keeps of the reference's distribution; `grid`
    (top-p values, [tokens, len] log kept mass) fills the tokens whose kept head is longer than `cum`."""
    n, width = cum.shape
    if top_k:
        return np.log(cum[:, top_k - 1]) if top_k <= width else np.full(n, np.nan)
    c = np.where(np.isfinite(cum), cum, -np.inf)
    reach = c >= top_p * (1 - 1e-7)
    k = np.argmax(reach, axis=1)
    ok = reach.any(axis=1)
    out = np.where(ok, np.log(np.maximum(cum[np.arange(n), k], 1e-300)), np.nan)
    if grid is not None and grid[1] is not None:
        at = [j for j, p in enumerate(grid[0]) if abs(p - top_p) < 1e-6]
        if at:
            out = np.where(ok, out, grid[1][:, at[0]].astype(np.float64))
    return out
