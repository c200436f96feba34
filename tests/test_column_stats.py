"""`column_stats` gives what the whole column gives, bit for bit: numpy's own sum (the pairwise
recursion it reproduces over `leaves`) and `metrics.percentiles` (exact order statistics), for
columns fed piece by piece; and says None, never a wrong number, when one pass cannot be exact."""

import numpy as np
import pytest

from lpf.analysis import column_stats as cs
from lpf.analysis.metrics import percentiles


def _feed(columns: dict[str, np.ndarray]) -> cs.ColumnStats:
    n = len(next(iter(columns.values())))
    rows = cs.sample_rows(n)
    stats = cs.ColumnStats(n, {k: v[rows] for k, v in columns.items()})
    for lo, hi in stats.leaves():
        stats.add({k: v[lo:hi] for k, v in columns.items()})
    return stats


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 127, 128, 129, 1000, 8193, 65536, 65537, 300_001, 2_000_003])
def test_leaves_reproduce_numpys_sum(n):
    rng = np.random.default_rng(n)
    a = np.abs(rng.standard_cauchy(n)) * rng.random(n)  # heavy tails: every rounding shows
    got = cs.leaves(n)
    assert [lo for lo, _ in got] == [0] + [hi for _, hi in got[:-1]] and (not got or got[-1][1] == n)
    assert cs.tree_sum([np.add.reduce(a[lo:hi]) for lo, hi in got], n) == np.add.reduce(a)
    small = cs.leaves(n, 1000)
    assert cs.tree_sum([np.add.reduce(a[lo:hi]) for lo, hi in small], n, 1000) == np.add.reduce(a)


@pytest.mark.parametrize("n", [0, 5, 1000, 300_001, 1_500_000])
def test_percentiles_and_sums_match_the_whole_column(n):
    rng = np.random.default_rng(1)
    cols = {
        "noise": np.abs(rng.normal(0, 1e-6, n)),
        "spiky": np.where(rng.random(n) < 0.003, rng.uniform(5, 20, n), np.abs(rng.normal(0, 1e-3, n))),
        "ties": np.round(rng.exponential(1.0, n), 1),  # many equal values around every rank
        "sorted": np.sort(rng.random(n)),
    }  # a strided sample of a sorted column is still a fair one
    stats = _feed(cols)
    for name, values in cols.items():
        assert stats.result(name) == percentiles(values), name
        assert stats.sum(name) == np.add.reduce(values)


def test_not_finite_or_a_missed_bracket_is_none_never_wrong():
    rng = np.random.default_rng(2)
    n = 400_000
    a = rng.random(n)
    b = a.copy()
    b[123] = np.nan
    stats = _feed({"a": a, "b": b})
    assert stats.result("a") == percentiles(a) and stats.result("b") is None and stats.sum("b") is None
    # a sample that says nothing about the column: its brackets miss, and it says so
    lying = cs.ColumnStats(n, {"a": np.zeros(cs.m.BRACKET_SAMPLE)})
    for lo, hi in lying.leaves():
        lying.add({"a": a[lo:hi]})
    assert lying.result("a") is None and lying.sum("a") == np.add.reduce(a)
