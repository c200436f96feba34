"""Exact summaries of whole-run columns from one pass over cache-sized pieces, never the whole column.

Contract: `ColumnStats(n, samples).leaves()` cuts 0..n into consecutive ranges; a caller computes (or
reads) each column's values over each range in order and hands them to `ColumnStats.add`; `ColumnStats.result(name)`
is then `metrics.percentiles(whole column)` bit for bit (p50, p90, p99, p99_9, max, mean), or None
where one pass cannot give it exactly (a value that is not finite, which `percentiles` leaves out,
or a bracket its sample got wrong): the caller then builds that column whole and asks `percentiles`.
`sum(name)` is np.add.reduce of the whole column, bit for bit, when every value was finite.

Why the sum is exact: np.add.reduce of a contiguous float64 array is numpy's pairwise summation
over all of it (split at n/2 rounded down to a multiple of 8 until a block has at most 128 values,
which it sums eight ways); the same recursion stopped at nodes of at most LEAF values gives the
same tree, so `leaves` are exactly those nodes, each summed with np.add.reduce, and the node sums
are added back up the tree (`tests/test_column_stats.py` pins this against numpy itself).
Order statistics: a sample (the caller's, e.g. the values at `sample_rows(n)`) brackets each group of
neighbouring ranks as `metrics.order_statistics` does; the pass counts the values below each bracket
and keeps the few inside; the tail groups (p90 and up) are read from the values above the first
tail bracket only. An order statistic is a value, not a computation: any exact selection gives it.
"""

from __future__ import annotations

import numpy as np

from lpf.analysis import metrics as m

LEAF = 1 << 16
BLOCK = 128  # numpy's PW_BLOCKSIZE: below it no split


def leaves(n: int, leaf: int | None = None) -> list[tuple[int, int]]:
    """The nodes of numpy's pairwise-summation recursion over n values that hold at most `leaf`
    (default LEAF) values (or one block), in order: (lo, hi) ranges covering 0..n."""
    leaf = LEAF if leaf is None else leaf
    out: list[tuple[int, int]] = []
    stack = [(0, n)]
    while stack:
        lo, size = stack.pop()
        if size <= leaf or size <= BLOCK:
            out.append((lo, lo + size))
            continue
        half = size // 2
        half -= half % 8
        stack.append((lo + half, size - half))  # the right half after the left one
        stack.append((lo, half))
    return out


def tree_sum(sums: list, n: int, leaf: int | None = None):
    """The sum of the whole column from its `leaves(n, leaf)` sums, added in the recursion's order."""
    leaf = LEAF if leaf is None else leaf
    it = iter(sums)

    def node(size):
        if size <= leaf or size <= BLOCK:
            return next(it)
        half = size // 2
        half -= half % 8
        left = node(half)
        return left + node(size - half)

    return node(n) if n else 0.0


def sample_rows(n: int) -> np.ndarray:
    """Rows whose values bracket the order statistics: BRACKET_SAMPLE of them, evenly spaced."""
    return np.arange(0, n, max(1, n // m.BRACKET_SAMPLE))


def _ranks(n: int) -> tuple[list[float], list[list[int]]]:
    """(h per quantile, groups of neighbouring ranks) as `metrics.linear_quantiles` needs them."""
    h = [(n - 1) * q for q in m.QUANTILES]
    ks = sorted({int(np.floor(x)) for x in h} | {int(np.ceil(x)) for x in h})
    groups: list[list[int]] = []
    for k in ks:
        if groups and k - groups[-1][-1] <= 1:
            groups[-1].append(k)
        else:
            groups.append([k])
    return h, groups


class _Column:
    def __init__(self, n: int, sample: np.ndarray | None):
        self.sums, self.max, self.finite, self.seen = [], -np.inf, True, 0
        self.sum_only = sample is None
        self.small = n <= m.SMALL_SELECT and not self.sum_only  # a short column is kept whole: as fast
        self.parts: list[np.ndarray] = []
        if self.sum_only or self.small:
            return
        self.h, self.groups = _ranks(n)
        s = np.sort(sample)
        self.brackets = [m._bracket(s, g, n) for g in self.groups]
        self.tail_lo = min((b[0] for b in self.brackets[1:]), default=np.inf)
        self.below = [0] * len(self.groups)
        self.inside: list[list[np.ndarray]] = [[] for _ in self.groups]

    def add(self, x: np.ndarray) -> None:
        self.seen += x.size
        self.sums.append(np.add.reduce(x))
        if not x.size or self.sum_only:
            return
        if self.small:
            self.parts.append(x.copy())
            return
        if not np.isfinite(self.sums[-1]):  # a NaN or inf (the sum of finite values is finite): dropped
            self.finite = False  # by `percentiles`, which this pass does not reproduce
            return
        lo, hi = self.brackets[0]
        ge = x >= lo
        self.below[0] += x.size - int(np.count_nonzero(ge))
        self.inside[0].append(x[ge & (x <= hi)])
        tail = x[x >= self.tail_lo] if len(self.groups) > 1 else x
        self.max = max(self.max, np.maximum.reduce(tail) if tail.size else np.maximum.reduce(x))
        if len(self.groups) > 1:
            for g in range(1, len(self.groups)):
                lo, hi = self.brackets[g]
                ge = tail >= lo
                self.below[g] += x.size - int(np.count_nonzero(ge))
                self.inside[g].append(tail[ge & (tail <= hi)])

    def result(self, n: int, leaf: int) -> dict | None:
        if self.seen != n or self.sum_only:
            return None
        if self.small:
            return m.percentiles(np.concatenate(self.parts) if self.parts else np.zeros(0))
        if not self.finite:
            return None
        v = {}
        for g, ranks in enumerate(self.groups):
            inside = np.concatenate(self.inside[g])
            below = self.below[g]
            if not (below <= ranks[0] and ranks[-1] < below + inside.size):
                return None  # the sample missed this bracket: the caller selects from the whole column
            inside.partition([k - below for k in ranks])
            v.update({k: inside[k - below] for k in ranks})
        q = [
            float(v[int(np.floor(x))] + (x - np.floor(x)) * (v[int(np.ceil(x))] - v[int(np.floor(x))])) for x in self.h
        ]
        return {
            "p50": float(q[0]),
            "p90": float(q[1]),
            "p99": float(q[2]),
            "p99_9": float(q[3]),
            "max": float(self.max),
            "mean": float(tree_sum(self.sums, n, leaf) / n),
        }


class ColumnStats:
    """Summaries of named columns of n values each, fed piece by piece over `leaves(n)` in order.
    `samples`: name -> values that bracket that column's order statistics (any values of it), or
    None for a column whose sum alone is wanted."""

    def __init__(self, n: int, samples: dict[str, np.ndarray]):
        self.n, self.leaf = n, LEAF
        self.columns = {name: _Column(n, s) for name, s in samples.items()}

    def leaves(self) -> list[tuple[int, int]]:
        """The ranges to feed, in order."""
        return leaves(self.n, self.leaf)

    def add(self, values: dict[str, np.ndarray]) -> None:
        """Each column's values over the next of `leaves()`."""
        for name, x in values.items():
            self.columns[name].add(x)

    def result(self, name: str) -> dict | None:
        return self.columns[name].result(self.n, self.leaf)

    def sum(self, name: str):
        """np.add.reduce of the whole column, or None when a value was not finite."""
        c = self.columns[name]
        if c.seen != self.n or not all(np.isfinite(s) for s in c.sums):
            return None
        return tree_sum(c.sums, self.n, self.leaf)
