"""The departure from an expected floor: how many times the floor's 99th percentile an engine's own 99th
percentile is, per component, and how far it must go to be a different model.

Contract:
  departure_units(floor) -> {token, settled, topk, honest, same_arithmetic}: the floor's (`floors.expected_floor`)
      99th percentiles a departure is measured in, and its honest departures.
  departure(d, s, w, units, absent=None) -> {token, settled, topk}: how many times the floor's 99th percentile the
      engine's own 99th percentile is (tokens without a logprob, `absent`, left out; a NaN value counts as
      infinite; leaving out at least its largest value, so one token alone never
      makes a short window's departure), per component (None where no token has it): the effect size the
      run-level test weighs beside its p-value.
  departure_needed(units): per component, what a departure must reach to be a different model and not other
      honest arithmetic: HONEST_MARGIN x the largest honest departure measured, and at least MIN_DEPARTURE
      where the floor is a float32 engine against a float32 reference (measured on the reference's own
      kernels), HONEST_MARGIN where it is a pair of dtypes (measured over several honest implementations:
      their envelope already).
Pure: numpy arrays and plain dicts in and out.
"""

from __future__ import annotations

import numpy as np

S_MIN = 1e-2  # tokens at least this sensitive give `token`; the others are `settled`
# a departure this many times the floor's 99th percentile, and HONEST_MARGIN times the largest an honest
# implementation showed, separates another model from other honest kernels (bench/detection.py's ROC:
# substitutions measured at >= 30x, honest engines at <= 2x a row that includes them)
MIN_DEPARTURE = 3.0
HONEST_MARGIN = 2.0
COMPONENTS = ("token", "settled", "topk")
MIN_UNIT = 2.0 * float(np.finfo(np.float32).eps)


def departure_units(floor: dict) -> dict:
    """The floor's 99th percentiles a departure is measured in, and its honest departures."""
    dtypes, _, configured = str(floor.get("pair") or "/").partition(" ")
    pair = dtypes.split("/")
    return {
        "token": floor["token"]["q99"],
        "settled": floor["settled"]["q99"],
        "topk": (floor.get("topk") or {}).get("q99"),
        "honest": dict(floor.get("honest") or {}),
        # a floor between two dtypes was measured over several honest implementations (the built-in engine,
        # vLLM, the reference itself at the engine's dtype): their envelope already. A float32 engine's
        # floor against a float32 reference was measured where both mostly ran the same torch kernels, and an
        # engine's against a server reference on one engine's kernels; a configured KV cache (` kv=`) is a
        # pair of arithmetics.
        "same_arithmetic": len(pair) == 2 and pair[0] == pair[1] and not configured.startswith("kv="),
    }


def departure(d: np.ndarray, s: np.ndarray, w: np.ndarray | None, units: dict, absent=None) -> dict:
    """Per component, the engine's 99th percentile over the floor's (`departure_units`). `absent`:
    the tokens that came back without a logprob (`lpf.analysis.absent`), left out."""
    d = np.where(np.isfinite(d), np.abs(d), np.inf)  # a NaN logprob is never within any floor
    if absent is not None:
        keep = ~np.asarray(absent, dtype=bool)
        d, s = d[keep], s[keep]
    informative = s >= S_MIN
    with np.errstate(divide="ignore", invalid="ignore"):
        u = d[informative] / s[informative]
    seen = {"token": _q99(u), "settled": _q99(d[~informative])}
    seen["topk"] = _q99(w) if w is not None and w.size else None
    return {c: _over(seen[c], units.get(c)) for c in COMPONENTS}


def _q99(x: np.ndarray) -> float | None:
    """The 99th percentile, leaving out at least the largest value: under 100 values a 99th percentile
    is the maximum, and one token would carry a short window past the gate (llama-server with flash
    attention: one position's top-k spread 4x its run's 99th percentile put 12% of honest 100-token
    windows past it; a lie in one token is the per-request verdicts' to call). From 100 values on it is
    the same order statistic, or the one below, as np.quantile(x, 0.99, method="higher")."""
    x = x[~np.isnan(x)]
    if not x.size:
        return None
    k = max(1, x.size // 100)  # the values above the 99th percentile, at least one
    return float(np.partition(x, x.size - 1 - k)[x.size - 1 - k]) if x.size > k else float(x.max())


def departure_needed(units: dict) -> dict:
    honest = units.get("honest") or {}
    least = MIN_DEPARTURE if units.get("same_arithmetic", True) else HONEST_MARGIN
    return {c: max(least, HONEST_MARGIN * float(honest.get(c) or 1.0)) for c in COMPONENTS}


def _over(seen: float | None, unit: float | None) -> float | None:
    if seen is None or unit is None:
        return None
    # a floor measured where both sides ran the same arithmetic can be 0: float32 cannot promise less
    # than a couple of ulps of 1.0, so that is the smallest unit a departure is counted in
    return float(seen / max(unit, MIN_UNIT))
