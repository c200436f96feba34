"""The run's own noise floor, and thresholds raised to it.

Contract: `calibrate(abs_diff, starts, th) -> (Thresholds, noise_floor dict)`. `abs_diff` is the
per-token |engine - reference| logprob of the scored tokens, grouped by request (`starts` are the
row indices where each request begins). The floor is measured with robust statistics over
tokens and requests: the median and MAD of the per-token |d| (the typical token's error; on at most
SAMPLE evenly spaced tokens) and the
median and high quantiles of each request's max |d|. Medians and MADs are what a handful of lying
requests cannot move (breakdown point 50%: lying tokens are far fewer than half of all tokens even
when many requests lie, since most of a lying request's tokens still agree), and capped thresholds
keep a run where most requests lie from calibrating the lie away.

With t = median + 3 MAD of the per-token |d| (the typical token's error, and then some):
  clean_abs_diff      max(default, 10 t), at most CLEAN_CAP -- tokens an order of magnitude above
                      the typical token's error are not rounding
  divergent_abs_diff  max(default, 50 t), at most DIVERGENT_CAP (from an expected floor, also at least
                      DIVERGENT_TAIL x its 99th percentile of logit error, within the same cap)
  tie_margin          max(default, 10 t), at most TIE_CAP -- a greedy flip whose margin is within
                      what this run's arithmetic moves a logprob by is a near tie
Per-request max |d| is reported (median, q90, q99) but not used: when most requests lie (a wide
offset wrap) its median is a lie too, while most tokens of most requests still agree.

A float32-vs-float32 run keeps the defaults; a bfloat16 engine against a float32 reference gets
thresholds above its own rounding. Thresholds the user pinned with `--threshold` are kept.
Fewer than MIN_REQUESTS scored requests: defaults, `source: "default"`.

The per-run floor has one blind spot: a run where every request lies the same way (processed
logprobs, a quantized model) measures the lie as its floor. `calibrate_from_run` takes the floor from
a calibration run instead (the reference teacher-forced again at the engine's dtype, `lpf rescore
--calibrate`): |calibration - reference| per token, no engine number involved, `source:
"calibration-run"`. `calibrate_to_floor` takes it from an expected floor (`lpf.analysis.floors`: the
shipped table for the run's dtype pair, `source: "table"`), and `with_expected_tie_margin` raises
the tie margin to the expected floor's, so a near-tie greedy flip the engine's dtype explains is not
`divergent`. The run's own floor (`calibrate`) is the fallback when no expected floor is known.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa

from lpf.analysis.thresholds import Thresholds
from lpf.analysis.verdicts import segment_starts

MIN_REQUESTS = 20
SAMPLE = 1_000_000
CLEAN_CAP = 0.1
DIVERGENT_CAP = 2.0  # a 7x probability ratio on one token is never rounding
# an expected floor raises the divergent threshold to this many times its 99th percentile of logit error:
# a token whose distribution is flat moves by the whole logit error (sensitivity ~1), and an honest
# bfloat16 engine on prose reached 2.0x that percentile once in 19,200 tokens (0.84 nats; 3 of 300
# requests past the 0.5 default: `divergent` with no lie anywhere)
DIVERGENT_TAIL = 4.0
TIE_CAP = 0.25


def noise_floor(abs_diff: np.ndarray, starts: np.ndarray) -> dict:
    n = abs_diff.size
    if n == 0 or starts.size == 0:
        return {"n_requests": 0, "n_tokens": 0}
    finite = np.isfinite(abs_diff)
    mx = np.maximum.reduceat(abs_diff if finite.all() else np.where(finite, abs_diff, -np.inf), starts)
    mx = mx[np.isfinite(mx)]
    # the token statistics on at most SAMPLE evenly spaced tokens: a median and a MAD do not need
    # every token of a 20M-token run, and one fewer pass over them matters there
    step = max(1, n // SAMPLE)
    tok = abs_diff[::step][finite[::step]]
    if tok.size == 0 or mx.size == 0:
        return {"n_requests": int(mx.size), "n_tokens": int(tok.size)}
    med = float(np.median(tok))
    return {
        "n_requests": int(mx.size),
        "n_tokens": int(finite.sum()),
        "token_abs_diff": {"median": med, "mad": float(1.4826 * np.median(np.abs(tok - med)))},
        "request_max_abs_diff": {
            "median": float(np.median(mx)),
            "q90": float(np.quantile(mx, 0.9)),
            "q99": float(np.quantile(mx, 0.99)),
        }
        if mx.size
        else {},
    }


def calibrate(abs_diff: np.ndarray, starts: np.ndarray, th: Thresholds) -> tuple[Thresholds, dict]:
    floor = noise_floor(abs_diff, starts)
    if floor["n_requests"] < MIN_REQUESTS:
        return th, {"source": "default", "noise_floor": floor}
    return _raised(th, floor), {"source": "calibrated", "noise_floor": floor}


def _raised(th: Thresholds, floor: dict) -> Thresholds:
    """`th` raised to `floor` (capped; pinned names kept)."""
    default = Thresholds()
    typical = floor["token_abs_diff"]
    t = typical["median"] + 3 * typical["mad"]  # the typical token's error, and then some
    proposed = {
        "clean_abs_diff": min(CLEAN_CAP, max(default.clean_abs_diff, 10 * t)),
        "divergent_abs_diff": min(DIVERGENT_CAP, max(default.divergent_abs_diff, 50 * t)),
        "tie_margin": min(TIE_CAP, max(default.tie_margin, 10 * t)),
    }
    changes = {k: v for k, v in proposed.items() if k not in th.pinned}
    return replace(th, **changes)


def calibration_abs_diff(reference: pa.Table, calibration: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(|calibration_logprob - ref_logprob| per token, request starts) over the tokens both scored,
    grouped by request. Reads no engine column."""
    ref = reference.select(["request_id", "position", "ref_logprob"])
    cal = calibration.select(["request_id", "position", "ref_logprob"]).rename_columns(
        ["request_id", "position", "cal_logprob"]
    )
    joined = ref.join(cal, keys=["request_id", "position"], join_type="inner")
    joined = joined.sort_by([("request_id", "ascending"), ("position", "ascending")])
    with np.errstate(invalid="ignore"):
        ad = np.abs(joined.column("cal_logprob").to_numpy() - joined.column("ref_logprob").to_numpy())
    return ad, segment_starts(joined.column("request_id"))


def calibrate_from_run(
    reference: pa.Table, calibration: pa.Table, th: Thresholds, info: dict | None = None
) -> tuple[Thresholds, dict]:
    """Thresholds raised to the calibration run's floor: the same statistics and rule as
    `calibrate`, over what the reference deviates from itself at the engine's dtype instead of over
    the engine's errors, so nothing the engine reported can move them. Any number of requests
    counts (no lie to outvote); none scored by both: the defaults. `info` (the manifest's
    calibration entry: dtype, reference_dtype, same_as_reference) joins the floor statistics."""
    floor = noise_floor(*calibration_abs_diff(reference, calibration))
    floor.update({k: v for k, v in (info or {}).items() if k in ("dtype", "reference_dtype", "same_as_reference")})
    if not floor.get("token_abs_diff"):
        return th, {"source": "calibration-run", "noise_floor": floor}
    return _raised(th, floor), {"source": "calibration-run", "noise_floor": floor}


def with_expected_tie_margin(th: Thresholds, floor: dict) -> Thresholds:
    """`th` with its tie margin at least the expected floor's (`floors.tie_margin`), unless pinned."""
    if "tie_margin" in th.pinned or floor.get("tie_margin", 0.0) <= th.tie_margin:
        return th
    return replace(th, tie_margin=float(floor["tie_margin"]))


def calibrate_to_floor(th: Thresholds, floor: dict) -> tuple[Thresholds, dict]:
    """Thresholds raised to an expected floor (`floors.expected_floor`): the per-request rule of
    `calibrate` over the floor's token |d| statistics, the divergent threshold to DIVERGENT_TAIL times
    its 99th percentile of logit error (capped), then its tie margin. Nothing of the run moves them."""
    stats = floor["token_abs_diff"]
    raised = _raised(th, {"token_abs_diff": {"median": stats["median"], "mad": stats["mad"]}})
    tail = (floor.get("token") or {}).get("q99")
    if tail and "divergent_abs_diff" not in th.pinned:
        div = min(DIVERGENT_CAP, max(raised.divergent_abs_diff, DIVERGENT_TAIL * float(tail)))
        raised = replace(raised, divergent_abs_diff=div)
    info = {
        "pair": floor.get("pair"),
        "detail": floor.get("detail"),
        "token_abs_diff": dict(stats),
        "tie_margin": floor.get("tie_margin"),
    }
    return with_expected_tie_margin(raised, floor), {"source": floor["source"], "noise_floor": info}
