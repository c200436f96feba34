"""The probability tails the analysis tests with, on `scipy.stats` (one place, checked against it).

Contract (pure; upper tails are P(X >= k), not scipy's P(X > k)):
  `binom_log_tail(k, n, p)`        log P(X >= k), X ~ Binomial(n, p); elementwise over arrays k, n
  `poisson_log_tail(k, lam)`       log P(X >= k), X ~ Poisson(lam)
  `poisson_upper(k, confidence)`   the upper end of the one-sided `confidence` interval of a Poisson mean
                                   after k events (exact: chi2.ppf(confidence, 2k + 2) / 2)
  `hypergeom_tail(a, total, successes, draws)`
                                   P(X >= a), X ~ Hypergeometric; elementwise over a and successes: the
                                   one-sided Fisher's exact test for enrichment (a of `draws` flagged items
                                   carry a feature that `successes` of `total` items carry)
  `sign_test(k, n)`                P(X >= k), X ~ Binomial(n, 1/2): the exact one-sided sign test (1.0 at n = 0)
  `fisher_combine(groups)`         Fisher's combination of each group's p-values (combine_pvalues' "fisher",
                                   vectorised over groups); a p-value of 0 counts as 1e-300
  `two_proportions(k1, n1, k2, n2)` two-sided p-value that k1/n1 and k2/n2 share a rate: Fisher's exact test
                                   (1.0 when either n is 0)
The log tails stay finite where the probability is below a float64's range (run-level tests over
millions of tokens reach log P of -1e5): there scipy's tail underflows, and the log of the sum of the
terms from k on is taken instead, stopping once a geometric bound puts the rest below 1e-18 of the sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

_TINY = 1e-280  # below this a float64 tail has lost digits (subnormals from 2e-308): sum in log space
_REST = math.log(1e-18)


def _scipy():
    """(scipy.stats, scipy.special), imported on first use: scipy.stats takes ~0.5 s to import (several on a
    loaded machine), which a command that never computes a tail should not pay."""
    from scipy import special, stats

    return stats, special


def _terms(first_ratio: float, available: int) -> int:
    """How many terms, from k on, leave a rest below 1e-18 of the sum when the terms' ratios start at
    `first_ratio` and only fall (a geometric bound); all `available` when they do not fall."""
    if not 0.0 < first_ratio < 1.0:
        return available if first_ratio >= 1.0 else 1
    return int(min(available, math.ceil((_REST + math.log1p(-first_ratio)) / math.log(first_ratio)) + 1))


def binom_log_tail(k, n, p: float) -> float | np.ndarray:
    """log P(X >= k), X ~ Binomial(n, p): a float for scalar k and n, else an array of their broadcast shape."""
    st, sp = _scipy()
    shape = np.broadcast(np.asarray(k), np.asarray(n)).shape
    k_, n_ = (np.broadcast_to(np.asarray(x, dtype=np.int64), shape).ravel() for x in (k, n))
    out = np.zeros(k_.shape)
    out[k_ > n_] = -math.inf
    mid = np.flatnonzero((k_ > 0) & (k_ <= n_))
    if mid.size:
        tail = st.binom.sf(k_[mid] - 1, n_[mid], p)
        with np.errstate(divide="ignore"):
            out[mid] = np.log(tail)
        odds = p / (1.0 - p) if p < 1.0 else math.inf
        for j in mid[tail < _TINY]:
            kj, nj = int(k_[j]), int(n_[j])
            i = np.arange(kj, kj + _terms((nj - kj) / (kj + 1.0) * odds, nj - kj + 1))
            out[j] = min(0.0, float(sp.logsumexp(st.binom.logpmf(i, nj, p))))
    return float(out[0]) if not shape else out.reshape(shape)


def poisson_log_tail(k: int, lam: float) -> float:
    """log P(X >= k), X ~ Poisson(lam)."""
    st, sp = _scipy()
    k = int(k)
    if k <= 0:
        return 0.0
    if lam <= 0:
        return -math.inf
    tail = float(st.poisson.sf(k - 1, lam))
    if tail >= _TINY:
        return math.log(tail)
    i = np.arange(k, k + _terms(lam / (k + 1.0), 1 << 40))
    return min(0.0, float(sp.logsumexp(st.poisson.logpmf(i, lam))))


def poisson_upper(k: int, confidence: float) -> float:
    """The largest Poisson mean under which k or fewer events still have probability 1 - confidence."""
    st = _scipy()[0]
    # P(X <= k | lam) = P(chi2(2k + 2) > 2 lam): the lam where it falls to 1 - confidence
    return float(st.chi2.ppf(confidence, 2 * (int(k) + 1)) / 2.0)


def hypergeom_tail(a, total: int, successes, draws: int) -> float | np.ndarray:
    """P(X >= a), X ~ Hypergeometric(total, successes, draws): a float for scalars, else an array.

    Every term from a to the support's top, in log space from one table of log factorials
    (scipy.special.gammaln), summed: scipy.stats.hypergeom.sf agrees (tests/test_stats.py) but costs
    ~0.5 ms a table where 170 < total <= 104,729 (boost's pdf factorises into primes there), +0.1 s to
    the analysis of a 31k-request run's 256 best-split tables; this is ~20 ns a term."""
    sp = _scipy()[1]
    shape = np.broadcast(np.asarray(a), np.asarray(successes)).shape
    a_, s_ = (np.broadcast_to(np.asarray(x, dtype=np.int64), shape).ravel() for x in (a, successes))
    total, draws = int(total), int(draws)
    hi = np.minimum(s_, draws)
    lo = np.maximum(a_, np.maximum(0, draws + s_ - total))
    count = np.maximum(hi - lo + 1, 0)
    out = np.where(a_ > hi, 0.0, 1.0)
    lf = sp.gammaln(np.arange(total + 1, dtype=np.float64) + 1.0)
    log_all = lf[total] - lf[draws] - lf[total - draws]
    todo = np.flatnonzero(count)
    # in chunks of about 2M terms: a run with most requests flagged has tables of ~1e5 terms each
    chunk = (np.cumsum(count[todo]) - 1) // 2_000_000
    for part in np.split(todo, np.flatnonzero(np.diff(chunk)) + 1) if todo.size else []:
        c = count[part]
        starts = np.cumsum(c) - c
        row = np.repeat(np.arange(part.size), c)
        k = lo[part][row] + (np.arange(c.sum()) - starts[row])
        sk = s_[part][row]
        lp = lf[sk] - lf[k] - lf[sk - k] + lf[total - sk] - lf[draws - k] - lf[total - sk - draws + k] - log_all
        top = np.maximum.reduceat(lp, starts)
        out[part] = np.minimum(1.0, np.exp(top) * np.add.reduceat(np.exp(lp - top[row]), starts))
    return float(out[0]) if not shape else out.reshape(shape)


def sign_test(k: int, n: int) -> float:
    """P(X >= k), X ~ Binomial(n, 1/2), exactly."""
    st = _scipy()[0]
    if n == 0:
        return 1.0
    return float(st.binomtest(int(k), int(n), 0.5, alternative="greater").pvalue)


def fisher_combine(groups: Sequence[Sequence[float]]) -> np.ndarray:
    """One combined p-value per group: P(chi2 with 2m dof >= -2 sum ln p) over the group's m p-values."""
    st = _scipy()[0]
    if not len(groups):
        return np.zeros(0)
    stat = np.array([-2.0 * np.log(np.maximum(np.asarray(g, dtype=np.float64), 1e-300)).sum() for g in groups])
    dof = np.array([2 * len(g) for g in groups])
    return np.minimum(st.chi2.sf(stat, dof), 1.0)


def two_proportions(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided Fisher's exact test of k1/n1 against k2/n2."""
    st = _scipy()[0]
    if not n1 or not n2:
        return 1.0
    return float(st.fisher_exact([[k1, n1 - k1], [k2, n2 - k2]]).pvalue)
