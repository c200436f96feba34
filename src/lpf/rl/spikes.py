"""Spike detection over training steps (robust z-score), periodicity, and localisation of a spike.

Pure numpy. A step's mismatch metric is taken on a log10 scale (mismatch spans decades: float32
rounding ~1e-12 k3_kl, bf16 ~1e-4, a corrupted state ~1) and scored against the run's own noise
floor: z = (y - median(y)) / max(1.4826 * MAD(y), MIN_SCALE). A step spikes when z >= z_threshold
(worse only; an unusually clean step is no alarm) AND the step has a token whose |d| exceeds
ABS_MIN (the clean threshold of `lpf analyze`): an engine that agrees with its trainer bit for bit on
most steps (median 0) must not see a 1e-7 rounding difference as a spike. The floor is robust: a few
spiking steps cannot move the median or MAD. MIN_SCALE keeps a run whose steps are nearly identical
from calling a quarter-decade wobble a spike.

The same z-score is taken per response against the responses' floor (`lpf.rl.analyze` combines
both). Localisation: a token is off when its |d| (trainer - rollout logprob) exceeds the token
threshold max(abs_min, 99.9th percentile of |d| over the quiet tokens: outside outlier responses and
spiking steps); an implicated response's first off position is where its mismatch starts.
"""

from __future__ import annotations

import numpy as np

MIN_SCALE = 0.25  # decades
Z_THRESHOLD = 6.0
ABS_MIN = 1e-3  # the run-level clean threshold of `lpf analyze`: |d| below it is rounding, never a lie
_FLOOR = 1e-15
MAX_GRID = 1_000_000  # steps spanned before per-step series stop being densified


_ONE_IS_PERFECT = {"ess", "rollout_is_eff_sample_size", "rollout_actor_probs_pearson_corr"}  # at most 1
_RATIO = {"token_mult_prob_error", "max_seq_mult_prob_error", "ppl_ratio"}  # 1 = agreement, either side
_SIGNED = {"chi2_token", "chi2_seq", "log_ppl_diff"}  # 0 = agreement, either sign


def log_badness(metric: str, values: np.ndarray) -> np.ndarray:
    """log10 of how far a metric is from perfect agreement (0 for diffs and KL, 1 for ratios, ESS and
    correlation)."""
    v = np.asarray(values, dtype=np.float64)
    if metric in _ONE_IS_PERFECT:
        v = 1.0 - v
    elif metric in _RATIO:
        v = np.abs(v - 1.0)
    elif metric in _SIGNED:
        v = np.abs(v)
    return np.log10(np.maximum(np.where(np.isfinite(v), v, np.nan), _FLOOR))


def robust_z(y: np.ndarray, min_scale: float = MIN_SCALE) -> tuple[np.ndarray, dict]:
    """(z per entry, the floor's statistics). NaN entries get NaN z and do not enter the floor."""
    ok = np.isfinite(y)
    if not ok.any():
        return np.full_like(y, np.nan), {"median": None, "mad": None, "scale": None}
    med = float(np.median(y[ok]))
    mad = float(np.median(np.abs(y[ok] - med)))
    scale = max(1.4826 * mad, min_scale)
    return (y - med) / scale, {"median": med, "mad": mad, "scale": scale}


def token_threshold(abs_d: np.ndarray, quiet: np.ndarray, abs_min: float = ABS_MIN) -> float:
    """|d| above which a token is off: the quiet tokens' 99.9th percentile, never below abs_min."""
    q = abs_d[quiet]
    return float(max(abs_min, np.quantile(q, 0.999))) if q.size else abs_min


def dense_series(steps: np.ndarray, values: np.ndarray, fill: float) -> tuple[np.ndarray, np.ndarray]:
    """(grid of every step from first to last, values on it; missing steps take `fill`)."""
    grid = np.arange(int(steps.min()), int(steps.max()) + 1)
    out = np.full(grid.size, fill, dtype=np.float64)
    out[steps - grid[0]] = values
    return grid, out


def episodes(steps: np.ndarray, spike: np.ndarray, weight: np.ndarray, gap: int = 1) -> list[float]:
    """Centres of the spike episodes, weighted by `weight`: spiking steps at most `gap` steps apart
    belong to one episode (a fault that recurs every K steps may straddle a few steps each time)."""
    out, run = [], []
    for g, w in zip(steps[spike], weight[spike]):
        if run and g - run[-1][0] > gap:
            out.append(_centre(run))
            run = []
        run.append((g, max(float(w), 1e-9)))
    if run:
        out.append(_centre(run))
    return out


def _centre(run: list) -> float:
    g = np.array([r[0] for r in run], dtype=np.float64)
    w = np.array([r[1] for r in run])
    return float((g * w).sum() / w.sum())


def period(steps: np.ndarray, spike: np.ndarray, weight: np.ndarray) -> dict:
    """How often the spikes recur. With >= 3 spike episodes: the mean spacing of their weighted
    centres, with confidence 1 - CV of the spacings (1 = like clockwork). The autocorrelation
    estimate of `lpf.analysis.periodicity.estimate_period` on the 0/1 spike series (missing steps
    quiet) is reported beside it, and used when there are fewer episodes (e.g. one long run)."""
    from lpf.analysis.periodicity import estimate_period

    out = {"period": None, "confidence": 0.0, "episodes": [], "autocorrelation": None}
    if int(spike.sum()) < 3:  # two events make one gap, not a repetition
        return out
    est = {}
    if steps[-1] - steps[0] <= MAX_GRID:  # a dump with step ids 1 and 10**9 has no useful dense series
        _, series = dense_series(steps, spike.astype(np.float64), 0.0)
        est = estimate_period(series)
        out["autocorrelation"] = {k: v for k, v in est.items() if _plain(v)}
    # spikes closer than a quarter of the autocorrelation lag are one episode, not two periods
    lag = est.get("lag") if est.get("confidence", 0) >= 0.3 else None
    centres = episodes(steps, spike, weight, gap=max(1, lag // 4) if lag else 1)
    out["episodes"] = [round(c, 2) for c in centres]
    if len(centres) >= 3:
        gaps = np.diff(centres)
        out["period"] = float(round(gaps.mean(), 2))
        out["confidence"] = float(np.clip(1.0 - gaps.std() / gaps.mean(), 0.0, 1.0))
    elif est.get("period") is not None:
        out["period"], out["confidence"] = float(est["period"]), float(est.get("confidence") or 0.0)
    return out


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))
