"""Period of a series over steps: `estimate_period(values) -> {"period", "confidence", ...}`.

Contract: `values` is a 1-D array indexed by step (an event count, a spike flag or a metric per
step; NaN means "no data at this step" and is treated as the series mean). The estimate is the
smallest lag whose autocorrelation is within 10% of the best autocorrelation peak among lags
2..n/2 (so a period of 12 is not reported as 24 or 36), refined to a float by averaging the
spacing of the series' repeated peaks when it is a sparse spike train. `confidence` is that
lag's autocorrelation in [0, 1]: ~0 for noise or a constant series, ~1 for a clean periodic
signal. `period` is None when confidence is below `min_confidence` or the series is too short
(fewer than 3 cycles of any candidate). For sparse event series (events at under a quarter of the
steps) the phase concentration of the events (`_phase_concentration`) is tried too and wins when
it is more confident; `method` says which. Pure numpy; used by the run analysis and the RL analysis.
"""

from __future__ import annotations

import numpy as np


def _autocorrelation(x: np.ndarray) -> np.ndarray:
    """Normalised autocorrelation for lags 0..n-1 (biased estimator: long lags are damped, which
    is what keeps a 3-cycle coincidence from beating a true short period)."""
    n = len(x)
    size = 1 << (2 * n - 1).bit_length()
    f = np.fft.rfft(x, size)
    acf = np.fft.irfft(f * np.conj(f), size)[:n]
    return acf / acf[0]


MAX_PHASE_PERIOD = 512  # candidate periods the phase test tries (cost: periods x events)


def estimate_period(values, min_confidence: float = 0.3, min_cycles: int = 3) -> dict:
    x = np.asarray(values, dtype=np.float64).ravel()
    out = {"period": None, "confidence": 0.0, "lag": None, "n": int(x.size), "n_events": None}
    if x.size == 0:
        return out
    finite = np.isfinite(x)
    if not finite.any():
        return out
    x = np.where(finite, x, x[finite].mean())
    if np.all(x == x[0]):
        return out
    spikes = np.count_nonzero(x != np.median(x))
    out["n_events"] = int(spikes)
    max_lag = x.size // min_cycles
    if max_lag < 2:
        return out
    acf = _autocorrelation(x - x.mean())
    lags = np.arange(2, max_lag + 1)
    cand = acf[2 : max_lag + 1]
    # a peak: at least as high as both neighbours (the edge lag counts as a peak if it is rising)
    left = acf[1:max_lag]
    right = np.append(acf[3 : max_lag + 2], -np.inf)[: len(cand)]
    peaks = (cand >= left) & (cand >= right) & (cand > 0)
    if not peaks.any():
        return out
    best = cand[peaks].max()
    lag = int(lags[peaks & (cand >= 0.9 * best)][0])
    conf = float(np.clip(acf[lag], 0.0, 1.0))
    out.update(lag=lag, confidence=conf, method="autocorrelation")
    if spikes < 0.25 * x.size:
        phase = _phase_concentration(x, max_lag)
        if phase is not None and phase[1] > conf:
            lag, conf = phase
            out.update(lag=lag, confidence=conf, method="phase")
    if conf >= min_confidence:
        period = _refine(x, lag)
        # under 2 steps apart is "most steps", not a period (dense events refine to ~1.5)
        out["period"] = period if period >= 2 else None
    return out


def _phase_concentration(x: np.ndarray, max_lag: int) -> tuple[int, float] | None:
    """Sparse events (a few steps out of many): for each candidate period p, how tightly the events'
    phases t mod p cluster (the mean resultant length of exp(2 pi i t / p), weighted by the event
    size; 1 = all events in one phase), less what the best of the candidates reaches by chance.
    Autocorrelation misses a train whose events skip cycles irregularly; this does not."""
    base = np.median(x)
    t = np.flatnonzero(x != base)
    w = np.abs(x[t] - base)
    if t.size < 4:
        return None
    periods = np.arange(2, min(max_lag, MAX_PHASE_PERIOD) + 1)
    if periods.size == 0:
        return None
    ang = 2 * np.pi * t[None, :] / periods[:, None]
    r = np.abs((w[None, :] * np.exp(1j * ang)).sum(1)) / w.sum()
    # the best of K candidate periods reaches ~sqrt(ln K / n) by chance (Rayleigh tail, n events)
    chance = min(0.95, float(np.sqrt(np.log(max(periods.size, 2)) / t.size)))
    adj = np.clip((r - chance) / (1 - chance), 0.0, 1.0)
    if not adj.any():
        return None
    # every divisor of the period clusters as well (events 12 apart are also 6, 4, 3, 2 apart),
    # while multiples do not (alternate events fall half a cycle apart): the largest one wins
    p = int(periods[np.flatnonzero(adj >= 0.9 * adj.max())[-1]])
    return p, float(adj[p - 2])


def _refine(x: np.ndarray, lag: int) -> float:
    """For a sparse spike train, the mean spacing of successive spikes near multiples of `lag`
    (a period of 12.5 shows as lags 12 and 13 alternating); otherwise the integer lag."""
    hi = x > np.median(x)
    idx = np.flatnonzero(hi)
    if idx.size < 3 or idx.size > x.size // 2:
        return float(lag)
    gaps = np.diff(idx)
    near = gaps[np.abs(gaps - lag) <= max(1, lag // 4)]
    if near.size < 2:
        return float(lag)
    return float(round(near.mean(), 2))
