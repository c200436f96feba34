"""The logprob-temperature fit's fast paths give what the plain ones give, bit for bit: the grid's errors
against the per-temperature form (`_tempered`), the screen's temperatures against those errors, the whole
fit against the plain grid's, and the zipped reference's rows taken by index against the hash join (a table
whose rows only match by key)."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa

from lpf.analysis import metrics as m
from lpf.analysis.columns import same_rows
from lpf.analysis import temperature_grid as grid
from lpf.analysis.signatures import TEMPERATURE_GRID, _tempered, fit_logprob_temperature
from lpf.analysis.thresholds import Thresholds


def _lists(widths: np.ndarray, values: np.ndarray) -> pa.Array:
    offsets = np.r_[0, np.cumsum(widths)].astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.float32()))


def test_the_grid_errors_are_the_per_temperature_errors_bit_for_bit():
    rng = np.random.default_rng(3)
    for trial in range(12):
        n = int(rng.integers(1, 800))
        widths = rng.integers(0, 25, n) if trial % 2 else np.full(n, int(rng.integers(1, 40)))
        values = -np.abs(rng.normal(1, 3, int(widths.sum()))).astype(np.float32)
        if values.size and trial % 3 == 0:
            values[rng.integers(0, values.size, 3)] = -np.inf
        raw = -np.abs(rng.normal(1, 3, n))
        raw[rng.random(n) < 0.01] = np.nan
        t = pa.table({"ref_logprob": raw, "ref_topk_logprobs": _lists(widths, values)})
        eng = raw + rng.normal(0, 0.5, n)
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = np.array([np.nanmedian(np.abs(eng - _tempered(t, T))) for T in TEMPERATURE_GRID])
            got = grid.errors(grid.TopK(t.column("ref_topk_logprobs")), raw, eng, TEMPERATURE_GRID)
        assert np.array_equal(got, want, equal_nan=True), trial


def _plain_fit(t: pa.Table, eng: np.ndarray):
    """(value, error) of the grid's best temperature as the fit computed it before its screen, or None."""
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        errors = np.array([np.nanmedian(np.abs(eng - _tempered(t, T))) for T in TEMPERATURE_GRID])
        raw_error = float(np.nanmedian(np.abs(eng - t.column("ref_logprob").to_numpy())))
    if not np.isfinite(errors).any():
        return None
    best = int(np.nanargmin(errors))
    value, error = float(TEMPERATURE_GRID[best]), float(errors[best])
    return None if abs(value - 1.0) <= 0.02 or not error < 0.1 * raw_error else (value, error)


def test_the_screen_passes_only_temperatures_whose_error_is_at_least_the_limit():
    """Runs from a tempering server (every token outside or inside a top-k of any width, NaN and -inf among
    them) to corrupt tokens nowhere near a temperature: where the screen passes T, the exact error is at least
    the limit; it passes all of a corrupt run's; and the fit with the screen is the plain fit's, bit for bit."""
    rng = np.random.default_rng(5)
    passed = fitted = 0
    for trial in range(8):
        n = int(rng.integers(20, 300))
        widths = rng.integers(0, 6, n) if trial % 2 else np.full(n, int(rng.integers(1, 6)))
        values = np.sort(-np.abs(rng.normal(1, 2, int(widths.sum()))))[::-1].astype(np.float32)
        if trial % 3 == 0:
            values[rng.integers(0, values.size, 2)] = -np.inf
        raw = -np.abs(rng.normal(1, 3, n))
        raw[rng.random(n) < 0.02] = np.nan
        col = _lists(widths, values)
        t = pa.table({"ref_logprob": raw, "ref_topk_logprobs": col})
        temperature = float(rng.choice(TEMPERATURE_GRID))
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if trial % 4 == 0:  # corrupt tokens: sure engine, improbable reference
                eng = np.full(n, -0.01)
                t = t.set_column(0, "ref_logprob", pa.array(-rng.uniform(7, 20, n)))
            else:  # a server at its own temperature, a little noise
                eng = _tempered(t, temperature) + rng.normal(0, 10.0 ** -rng.integers(1, 6), n)
            raw = t.column("ref_logprob").to_numpy()
            exact = grid.errors(grid.TopK(col), raw, eng, TEMPERATURE_GRID)
            for i, limit in enumerate(
                (0.1 * float(np.nanmedian(np.abs(eng - raw))), *np.nanquantile(exact, [0.0, 0.3, 0.9]))
            ):
                ok = grid.at_least(grid.TopK(col), raw, eng, TEMPERATURE_GRID, limit)
                assert (exact[ok] >= limit).all(), (trial, limit)
                passed += int(ok.sum())
                if i == 0 and trial % 4 == 0:
                    assert ok.all(), trial  # the fit's own limit: a corrupt run's temperatures all pass it
        keys = pa.table(
            {
                "request_id": pa.array([f"r{i}" for i in range(n)]),
                "position": np.zeros(n, np.int32),
                "engine_logprob": eng,
                "ref_logprob": raw,
            }
        )
        reference = keys.select(["request_id", "position", "ref_logprob"]).append_column("ref_topk_logprobs", col)
        fit = fit_logprob_temperature(keys, reference, Thresholds(clean_abs_diff=-1.0))  # every token departs
        scored = ~np.isnan(eng - raw)  # but a NaN: not departing
        want = _plain_fit(t.filter(pa.array(scored)), eng[scored])
        assert (fit and (fit["value"], fit["error"])) == want, trial
        fitted += want is not None
    assert passed and fitted  # neither side of either check is vacuous


def _run(n_req: int = 60, out: int = 12, k: int = 5, temperature: float = 0.7):
    """tokens and reference of a greedy run whose server reports its logprobs at `temperature`."""
    rng = np.random.default_rng(0)
    n = n_req * out
    rid = pa.array([f"r{i:04d}" for i in np.repeat(np.arange(n_req), out)])
    pos = np.tile(np.arange(out, dtype=np.int32), n_req)
    top = np.sort(-np.abs(rng.normal(2, 2, (n, k))), axis=1)[:, ::-1]
    lp = top[:, 0].astype(np.float32).astype(np.float64)  # the engine's token: the reference's top-1
    tempered = lp / temperature - np.logaddexp.reduce(top.astype(np.float32) / temperature, axis=1)
    tokens = pa.table(
        {"request_id": rid, "position": pos, "token_id": np.zeros(n, np.int32), "engine_logprob": tempered}
    )
    reference = pa.table(
        {
            "request_id": rid,
            "position": pos,
            "ref_logprob": lp,
            "ref_rank": np.ones(n, np.int32),
            "ref_top1_id": np.zeros(n, np.int32),
            "ref_top1_logprob": lp,
            "ref_topk_logprobs": _lists(np.full(n, k), top.astype(np.float32).ravel()),
        }
    )
    return tokens, reference


def test_the_zipped_reference_gives_the_join_s_fit():
    tokens, reference = _run()
    zipped, _ = m.join_grouped(tokens, reference)
    keys = ["request_id", "position", "ref_logprob"]
    hashed = tokens.join(reference.select(keys), ["request_id", "position"])  # rows that match only by key
    assert same_rows(zipped.column("ref_logprob"), reference.column("ref_logprob"))  # the by-index path
    assert not same_rows(hashed.column("ref_logprob"), reference.column("ref_logprob"))  # the join
    fit = fit_logprob_temperature(zipped, reference, Thresholds())
    assert fit is not None and abs(fit["value"] - 0.7) <= 0.02, fit
    assert fit == fit_logprob_temperature(hashed, reference, Thresholds())
