"""analysis/stats.py against exact sums (fractions, brute force) and scipy on the values the analysis uses:
tails far below a float64's range in log space, large n, k = 0, k = n, below the mean."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats as sst

from lpf.analysis import stats


def _log_binomial_tail(k: int, n: int, d: int) -> float:
    """log P(X >= k), X ~ Binomial(n, 1/d), exactly: the terms C(n, i) (d - 1)^(n - i) / d^n summed in integers."""
    whole = sum(math.comb(n, i) * (d - 1) ** (n - i) for i in range(k, n + 1))
    shift = max(whole.bit_length() - 60, 0)
    return shift * math.log(2) + math.log(whole >> shift) - n * math.log(d)


def test_binomial_tail_is_exact_and_stays_finite_far_below_float_range():
    for k, n, d in ((3, 25, 100), (40, 1000, 100), (12, 50, 10), (200, 200, 100), (7, 1000, 200), (3, 1000, 100)):
        assert stats.binom_log_tail(k, n, 1 / d) == pytest.approx(_log_binomial_tail(k, n, d), rel=1e-12)
    # P far below 1e-308 (the run-level test over many tokens): still the exact sum's log
    log_exact = _log_binomial_tail(300, 1000, 100)
    assert log_exact < -700 and stats.binom_log_tail(300, 1000, 0.01) == pytest.approx(log_exact, rel=1e-12)
    assert stats.binom_log_tail(10**6, 10**6, 0.01) == pytest.approx(10**6 * math.log(0.01), rel=1e-12)  # k = n
    assert stats.binom_log_tail(0, 10, 0.01) == 0.0 and stats.binom_log_tail(11, 10, 0.01) == -math.inf
    # large n, moderate tail: scipy's own survival function (P(X > k - 1))
    for k, n, p in ((200_444, 20_000_000, 0.01), (10_049, 20_000_000, 0.0005), (21_413, 20_000_000, 0.001)):
        assert stats.binom_log_tail(k, n, p) == pytest.approx(math.log(sst.binom.sf(k - 1, n, p)), rel=1e-12)
    # elementwise over arrays (the localized test's requests), the same numbers as one at a time
    k, n = np.array([0, 5, 40, 400, 20]), np.array([10, 1000, 1000, 3000, 10])
    assert np.array_equal(stats.binom_log_tail(k, n, 0.01), [stats.binom_log_tail(a, b, 0.01) for a, b in zip(k, n)])


def test_poisson_tail_and_upper_bound():
    for k, lam in [(1, 0.01), (3, 0.01), (2, 5.0), (10, 5.0), (4, 0.75), (1, 3.0), (30, 2.5)]:
        brute = 1.0 - math.fsum(math.exp(-lam) * lam**j / math.factorial(j) for j in range(k))
        if brute > 1e-6:  # where 1 - sum keeps its digits
            assert math.exp(stats.poisson_log_tail(k, lam)) == pytest.approx(brute, rel=1e-9)
        terms = math.fsum(math.exp(-lam + j * math.log(lam) - math.lgamma(j + 1)) for j in range(k, k + 200))
        assert stats.poisson_log_tail(k, lam) == pytest.approx(math.log(terms), rel=1e-12)
    # below 1e-308: the terms' sum in log space
    log_terms = [-10.0 + j * math.log(10.0) - math.lgamma(j + 1) for j in range(2000, 2200)]
    top = max(log_terms)
    expected = top + math.log(math.fsum(math.exp(v - top) for v in log_terms))
    assert expected < -8000 and stats.poisson_log_tail(2000, 10.0) == pytest.approx(expected, rel=1e-12)
    assert stats.poisson_log_tail(0, 3.0) == 0.0 and stats.poisson_log_tail(1, 0.0) == -math.inf
    # after 0 events the 95% bound is -ln(0.05); after k, the mean at which P(X <= k) = 5%
    assert stats.poisson_upper(0, 0.95) == pytest.approx(-math.log(0.05), rel=1e-12)
    for k in (1, 4, 30):
        up = stats.poisson_upper(k, 0.95)
        assert sst.poisson.cdf(k, up) == pytest.approx(0.05, rel=1e-9)


def test_hypergeometric_tail_is_fishers_exact_test():
    # 2x2 table [[3, 0], [0, 3]]: one-sided p = 1 / C(6, 3)
    assert stats.hypergeom_tail(3, 6, 3, 3) == pytest.approx(1 / 20, rel=1e-12)
    assert stats.hypergeom_tail(0, 6, 3, 3) == pytest.approx(1.0, rel=1e-12) and stats.hypergeom_tail(4, 6, 3, 3) == 0.0
    for a, total, succ, draws in ((7, 400, 9, 12), (2, 240, 60, 3), (30, 1000, 40, 50), (1, 50, 1, 1)):
        exact = Fraction(
            sum(math.comb(succ, i) * math.comb(total - succ, draws - i) for i in range(a, min(succ, draws) + 1)),
            math.comb(total, draws),
        )
        assert stats.hypergeom_tail(a, total, succ, draws) == pytest.approx(float(exact), rel=1e-10)
        # scipy's one-sided fisher_exact on the same table agrees
        table = [[a, succ - a], [draws - a, total - succ - draws + a]]
        assert stats.hypergeom_tail(a, total, succ, draws) == pytest.approx(
            sst.fisher_exact(table, alternative="greater").pvalue, rel=1e-10
        )
    # against scipy's hypergeom.sf across table sizes (boost's three pdf methods: up to 170, up to 104,729,
    # beyond), tails down to 1e-250, and tables of 1e5 terms each in more than one chunk; the log-factorial
    # table's entries reach 4e6 at 3e5 items, whose last bits (4e-10) bound the agreement there
    rng = np.random.default_rng(5)
    for total, draws in ((150, 40), (31_250, 150), (31_250, 5_000), (312_500, 1_500), (300_000, 150_000)):
        succ = rng.integers(1, total, 24)
        a = np.minimum(succ, rng.integers(0, draws + 1, 24))
        want = sst.hypergeom.sf(a - 1, total, succ, draws)
        got = stats.hypergeom_tail(a, total, succ, draws)
        keep = want > 1e-250
        assert keep.sum() > 3 and np.allclose(got[keep], want[keep], rtol=2e-9, atol=0)
    out = stats.hypergeom_tail(np.array([3, 0, 2]), 6, np.array([3, 3, 3]), 3)
    assert out.shape == (3,) and out[0] == pytest.approx(1 / 20) and out[1] == pytest.approx(1.0)


def test_sign_test_is_exact():
    for k, n in ((0, 0), (0, 5), (5, 5), (130, 200), (700, 1000), (3, 10)):
        exact = Fraction(sum(math.comb(n, i) for i in range(k, n + 1)), 2**n) if n else Fraction(1)
        assert stats.sign_test(k, n) == pytest.approx(float(exact), rel=1e-12)
    # the normal approximation bf16_paired used was off by 10x out there; the exact tail is not
    assert stats.sign_test(700, 1000) < 1e-37


def test_fisher_combination():
    out = stats.fisher_combine([[0.3], [0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 0.5]])
    assert out[0] == pytest.approx(0.3, rel=1e-12)
    # two p-values of 0.1: P(chi2_4 >= -2 ln 0.01) = 0.01 (1 - ln 0.01)
    assert out[1] == pytest.approx(0.01 * (1 + math.log(100)), rel=1e-12)
    assert out[2] == pytest.approx(1.0)
    assert 0 < out[3] < 1e-290  # a p-value of 0 counts as 1e-300: finite evidence, no NaN
    ps = [0.02, 0.4, 1e-7, 0.9]
    assert stats.fisher_combine([ps])[0] == pytest.approx(sst.combine_pvalues(ps, method="fisher").pvalue, rel=1e-12)
    assert stats.fisher_combine([]).size == 0


def test_two_proportions_is_fishers_exact_test():
    assert stats.two_proportions(20, 200, 20, 200) == 1.0 and stats.two_proportions(20, 200, 1, 200) < 1e-4
    assert stats.two_proportions(0, 0, 3, 10) == 1.0

    # 17/240 against 1/240, two-sided: the tables at most as likely as the one seen, summed exactly
    def pmf(a):
        return Fraction(math.comb(240, a) * math.comb(240, 18 - a), math.comb(480, 18))

    seen = pmf(17)
    exact = sum(pmf(a) for a in range(19) if pmf(a) <= seen * (1 + Fraction(1, 10**7)))
    assert stats.two_proportions(17, 240, 1, 240) == pytest.approx(float(exact), rel=1e-9)
