"""The logprob-temperature fit's grid: each temperature's median error exactly, and a screen that proves it
is at least a limit without computing it.

`signatures.fit_logprob_temperature` reports a temperature T only when the grid's least median error
|eng - tempered(T)| is under a limit (a tenth of the raw logprobs' median error), with tempered(T) the
reference's logprob of the token at T, normalised over its top-k plus the token (`signatures._tempered`).
Most runs that reach the grid (corrupt tokens, no tempering server) are nowhere near it, and the grid's cost
is in two places: the log-add-exp of every token outside the reference's top-k (libm's scalar exp and
log1p, per token and temperature) and a median per temperature. The screen needs neither:
  - numpy's logaddexp(a, b) is max(a, b) + log1p(exp(-|a - b|)) (a + log 2 when a == b), an added term in
    [0, min(log 2, exp(-|a - b|))]; bounded above by min(0.7, 2 exp(-|a - b|) + 1e-300) (twice: numpy's
    exp and libm's differ by ulps; 1e-300: either may round an underflow to a subnormal), and rounding is
    monotone, so the computed tempered logprob lies between raw - (max + that) and raw - max, and its error
    |eng - tempered| at least at the nearer end of that interval (0 when it spans eng). A token inside the
    top-k has no log-add-exp: its error is the grid's own.
  - a median is at least the limit when fewer than half of the values are under it (2c < m, m the
    non-NaN values; the bounds are NaN exactly where the errors are), whatever the values above it.
So a temperature the screen passes has an error >= limit bit for bit as the grid would compute it.

Contract (pure: an Arrow list column and numpy arrays in, numpy out):
  `TopK(col)`: the reference's top-k logprob lists, read once for any number of temperatures;
      `.at(T) -> (lse, mn)`: each list's log-sum-exp and least value, of values / T (NaN for an empty list).
  `errors(topk, raw, eng, temps) -> float64 [len(temps)]`: nanmedian |eng - tempered(T)| per T, bit for bit
      the per-temperature form (tests/test_signatures_fit.py), on two threads (numpy releases the GIL).
  `at_least(topk, raw, eng, temps, limit) -> bool [len(temps)]`: True where that error is provably >= limit
      (False proves nothing: the grid decides).
  `nanmedian(x)`: np.nanmedian of a 1-D float64 array, bit for bit, by one partition (no copy of the NaN-free
      array's order, no per-call overhead of the general function).
"""

from __future__ import annotations

import numpy as np

from lpf.analysis.columns import one_array

LOG2_BOUND = 0.7  # > log 2: the most log1p(exp(-|a - b|)) adds


class TopK:
    def __init__(self, col):
        arr = one_array(col)
        offsets = arr.offsets.to_numpy().astype(np.int64)
        o = offsets - offsets[0]
        self.n = len(arr)
        self.v0 = arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]].astype(np.float64)
        self.ne = o[1:] > o[:-1]
        self.st, self.lens = o[:-1][self.ne], (o[1:] - o[:-1])[self.ne]
        self.all = bool(self.ne.all())  # no empty list: whole-array writes, not masked ones
        # one width for every list: np.repeat by a scalar; width one: a list's sum is its one value
        self.width = int(self.lens[0]) if self.all and self.n and (self.lens == self.lens[0]).all() else None
        if self.v0.size:
            self.mx0, self.mn0 = np.maximum.reduceat(self.v0, self.st), np.minimum.reduceat(self.v0, self.st)

    def at(self, temperature: float, lse: np.ndarray | None = None, mn: np.ndarray | None = None):
        """(lse, mn) at `temperature`, into `lse` / `mn` when given (NaN where a list is empty): a list's max
        (min) of values / T is its max (min) / T (correctly rounded division by T > 0 keeps the order)."""
        lse = np.full(self.n, np.nan) if lse is None else lse
        mn = np.full(self.n, np.nan) if mn is None else mn
        if not self.v0.size:
            return lse, mn
        mx = self.mx0 / temperature
        e = np.exp(self.v0 / temperature - (mx if self.width == 1 else np.repeat(mx, self.width or self.lens)))
        total = e if self.width == 1 else np.add.reduceat(e, self.st)
        rows = slice(None) if self.all else self.ne
        lse[rows] = mx + np.log(total)
        mn[rows] = self.mn0 / temperature
        return lse, mn


def nanmedian(x: np.ndarray):
    v = x[~np.isnan(x)]
    if not v.size:
        return np.float64(np.nan)
    k = v.size // 2
    if v.size % 2:
        return np.partition(v, k)[k]
    p = np.partition(v, (k - 1, k))
    return (p[k - 1] + p[k]) / 2  # np.median's mean of the two middle values


def errors(topk: TopK, raw0: np.ndarray, eng: np.ndarray, temps: np.ndarray) -> np.ndarray:
    if temps.size < 2:
        return _errors(topk, raw0, eng, temps)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2, thread_name_prefix="lpf-temperature") as pool:
        return np.concatenate(list(pool.map(lambda t: _errors(topk, raw0, eng, t), np.array_split(temps, 2))))


def _errors(topk: TopK, raw0: np.ndarray, eng: np.ndarray, temps: np.ndarray) -> np.ndarray:
    out = np.empty(temps.size)
    lse, mn = np.full(topk.n, np.nan), np.full(topk.n, np.nan)
    # errstate is per thread (positions without a top-k, NaN, are left out of the median)
    with np.errstate(invalid="ignore"):
        for i, temperature in enumerate(temps):
            topk.at(temperature, lse, mn)
            raw = raw0 / temperature
            outside = np.flatnonzero(~(raw >= mn - 1e-4))  # the top-k is float32: a little slack
            z = lse.copy()
            z[outside] = np.logaddexp(lse[outside], raw[outside])  # the token itself, outside the top-k
            out[i] = nanmedian(np.abs(eng - (raw - z)))
    return out


def at_least(topk: TopK, raw0: np.ndarray, eng: np.ndarray, temps: np.ndarray, limit: float) -> np.ndarray:
    if temps.size < 2:
        return _at_least(topk, raw0, eng, temps, limit)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2, thread_name_prefix="lpf-temperature") as pool:
        parts = pool.map(lambda t: _at_least(topk, raw0, eng, t, limit), np.array_split(temps, 2))
        return np.concatenate(list(parts))


def _at_least(topk: TopK, raw0: np.ndarray, eng: np.ndarray, temps: np.ndarray, limit: float) -> np.ndarray:
    out = np.zeros(temps.size, bool)
    lse, mn = np.full(topk.n, np.nan), np.full(topk.n, np.nan)
    with np.errstate(invalid="ignore", over="ignore"):
        for i, temperature in enumerate(temps):
            topk.at(temperature, lse, mn)
            raw = raw0 / temperature
            outside = ~(raw >= mn - 1e-4)
            # the tempered logprob: raw - lse inside the top-k; outside in [raw - (top + add), raw - top], top
            # logaddexp's max (NaN where lse or raw is; then so is the error)
            top = np.where(outside, np.maximum(lse, raw), lse)
            add = np.minimum(LOG2_BOUND, 2.0 * np.exp(-np.abs(lse - raw)) + 1e-300)
            add *= outside  # 0 inside (a NaN there only where lse is, and top with it)
            hi = raw - top
            lo = raw - (top + add)
            # |eng - tempered| at least the nearer end of eng - [lo, hi] (0 when it spans 0); NaN where the error is
            bound = np.maximum(np.maximum(eng - hi, lo - eng), 0.0)
            m = np.count_nonzero(bound == bound)
            out[i] = 2 * np.count_nonzero(bound < limit) < m
    return out
