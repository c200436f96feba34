"""Token-level signatures of two mechanisms that leave no mark in the trace's features.

Contract (pure; tables in, an Arrow array of request ids out):
- `crossed_wires(tok, requests, trace)`: requests that, at some engine step, sampled a token the
  reference did not expect, where another request sampled at the same step the token this one's
  reference expected and this one's token was the one that request's reference expected: two
  requests' samples delivered to each other. None without a trace (steps unknown).
- `tempered_logprobs(tok, reference, temperature, th)`: requests whose reported logprobs fit the
  reference's distribution at `temperature` (log-softmax of logits / T, normalised over the
  reference's top-k plus the token) better than its raw logprobs on most of the tokens where the
  two differ: post-processing logprobs reported as raw.
- `fit_logprob_temperature(tok, reference, th)`: the temperature T (0.25..4) whose tempered
  reference logprobs (as above) best match the reported ones, over the tokens whose reported logprob
  departs from the raw one by more than the clean threshold; a dict {value, tokens, error, raw_error,
  sentence} when at least MIN_TEMPERED_TOKENS depart (an even sample of MAX_TEMPERED_TOKENS of them read), T is not within 0.02 of 1 and the fit's median
  error is under a tenth of the raw logprobs' (a server reporting logprobs at a temperature of its own,
  whatever the run asked for), else None.
`tok` is the per-token metrics table (`metrics.token_metrics`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import temperature_grid as grid
from lpf.analysis.columns import BLOCK, one_array, same_rows
from lpf.analysis.thresholds import Thresholds


def sample_steps(trace: pa.Table, requests: pa.Table) -> pa.Table:
    """(request_id, position, step): the engine step that sampled each output position. A speculative
    row (the trace's num_draft_tokens / num_accepted_tokens) samples from the position after its last
    non-draft token, 1 + accepted positions; a rejected draft's position is sampled again later, and the
    first step that sampled a position is the one kept."""
    plen = pa.table(
        {
            "request_id": requests.column("request_id"),
            "plen": pc.list_value_length(requests.column("prompt_token_ids")).cast(pa.int64()),
        }
    )
    spec = [c for c in ("num_draft_tokens", "num_accepted_tokens") if c in trace.column_names]
    t = trace.filter(pc.invert(trace.column("preempted").fill_null(False)))
    t = t.select(["request_id", "step", "num_computed_tokens", "num_scheduled_tokens", *spec]).join(plen, "request_id")
    pos = pc.subtract(
        pc.add(t.column("num_computed_tokens").cast(pa.int64()), t.column("num_scheduled_tokens").cast(pa.int64())),
        t.column("plen"),
    )
    # a trace row of a request the run has no request row for (an attempt its client cancelled mid-prefill)
    # has no prompt length, so no position: it sampled nothing
    known = pc.is_valid(pos)
    t, pos = t.filter(known), pos.filter(known)
    if len(spec) == 2:
        pos = pc.subtract(pos, t.column("num_draft_tokens").cast(pa.int64()).fill_null(0)).to_numpy()
        n = 1 + t.column("num_accepted_tokens").cast(pa.int64()).fill_null(0).to_numpy()
        rows = np.repeat(np.arange(t.num_rows), n)
        offset = np.arange(rows.size) - np.repeat(np.cumsum(n) - n, n)  # 0..n-1 within each row
        t = t.take(pa.array(rows))
        pos = pa.array(np.repeat(pos, n) + offset)
    t = pa.table({"request_id": t.column("request_id"), "position": pos.cast(pa.int32()), "step": t.column("step")})
    t = t.filter(pc.greater_equal(t.column("position"), 0))
    out = t.group_by(["request_id", "position"]).aggregate([("step", "min")])
    return out.rename_columns(["request_id", "position", "step"])


def crossed_wires(tok: pa.Table, requests: pa.Table, trace: pa.Table | None) -> pa.Array | None:
    if trace is None or not trace.num_rows:
        return None
    miss = tok.filter(pc.not_equal(tok.column("token_id"), tok.column("ref_top1_id")))
    miss = miss.select(["request_id", "position", "token_id", "ref_top1_id"])
    if not miss.num_rows:
        return pa.array([], pa.string())
    miss = miss.join(sample_steps(trace, requests), ["request_id", "position"]).to_pydict()
    by_step: dict[int, dict[tuple[int, int], list[str]]] = {}
    for rid, t, top, step in zip(miss["request_id"], miss["token_id"], miss["ref_top1_id"], miss["step"]):
        by_step.setdefault(step, {}).setdefault((t, top), []).append(rid)
    hit = set()
    for pairs in by_step.values():
        for (t, top), rids in pairs.items():
            partners = pairs.get((top, t), [])
            for a in rids:
                if any(b != a for b in partners):
                    hit.add(a)
    return pa.array(sorted(hit), pa.string())


def _lse_over_lists(col, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """(logsumexp of values / T, min value / T) per list; NaN for empty lists."""
    arr = one_array(col)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    o = offsets - offsets[0]
    v = arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]].astype(np.float64) / temperature
    lse, mn = np.full(len(arr), np.nan), np.full(len(arr), np.nan)
    ne = o[1:] > o[:-1]
    if v.size:
        st, lens = o[:-1][ne], (o[1:] - o[:-1])[ne]
        mx = np.maximum.reduceat(v, st)
        lse[ne] = mx + np.log(np.add.reduceat(np.exp(v - np.repeat(mx, lens)), st))
        mn[ne] = np.minimum.reduceat(v, st)
    return lse, mn


def tempered_logprobs(tok: pa.Table, reference: pa.Table, temperature: float, th: Thresholds) -> pa.Array:
    ref = reference.select(["request_id", "position", "ref_topk_logprobs"])
    lse, mn = _lse_over_lists(ref.column("ref_topk_logprobs"), temperature)
    ref = pa.table({"request_id": ref.column("request_id"), "position": ref.column("position"), "lse": lse, "mn": mn})
    t = tok.select(["request_id", "position", "engine_logprob", "ref_logprob"]).join(ref, ["request_id", "position"])
    eng = t.column("engine_logprob").to_numpy()
    raw = t.column("ref_logprob").to_numpy()
    lse, mn = t.column("lse").to_numpy(), t.column("mn").to_numpy()
    outside = ~(raw / temperature >= mn - 1e-4)  # the top-k is float32: a little slack
    z = np.where(outside, np.logaddexp(lse, raw / temperature), lse)  # the token itself, if outside the top-k
    tempered = raw / temperature - z
    with np.errstate(invalid="ignore"):
        differ = np.abs(eng - raw) > th.clean_abs_diff
        better = differ & (np.abs(eng - tempered) < 0.5 * np.abs(eng - raw))
    g = pa.table({"request_id": t.column("request_id"), "differ": differ, "better": better})
    agg = g.group_by("request_id").aggregate([("differ", "sum"), ("better", "sum")])
    d, b = agg.column("differ_sum").to_numpy(), agg.column("better_sum").to_numpy()
    keep = (d > 0) & (b >= 0.5 * d) & (b >= 1)
    return agg.column("request_id").filter(pa.array(keep))


MIN_TEMPERED_TOKENS = 20
MAX_TEMPERED_TOKENS = 20_000
TEMPERATURE_GRID = np.round(np.exp(np.linspace(np.log(0.25), np.log(4.0), 281)), 4)


def _tempered(t: pa.Table, temperature: float) -> np.ndarray:
    """The reference's logprob of each token at `temperature`, normalised over its top-k plus the token."""
    lse, mn = _lse_over_lists(t.column("ref_topk_logprobs"), temperature)
    raw = t.column("ref_logprob").to_numpy() / temperature
    outside = ~(raw >= mn - 1e-4)
    return raw - np.where(outside, np.logaddexp(lse, raw), lse)


def _departing(eng: np.ndarray, raw: np.ndarray, limit: float) -> np.ndarray:
    """The rows where |eng - raw| > limit, a block at a time (whole-run float temporaries are 160 MB each at
    20M rows)."""
    out = []
    with np.errstate(invalid="ignore"):
        for lo in range(0, eng.size, BLOCK):
            out.append(np.flatnonzero(np.abs(eng[lo : lo + BLOCK] - raw[lo : lo + BLOCK]) > limit) + lo)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def fit_logprob_temperature(tok: pa.Table, reference: pa.Table, th: Thresholds) -> dict | None:
    # the streamed analysis hands the departing rows' reference without ref_logprob (its top-k is all it needs)
    ref = reference.select(
        [c for c in ("request_id", "position", "ref_logprob", "ref_topk_logprobs") if c in reference.column_names]
    )
    keys = tok.select(["request_id", "position", "engine_logprob", "ref_logprob"])
    at = _departing(keys.column("engine_logprob").to_numpy(), keys.column("ref_logprob").to_numpy(), th.clean_abs_diff)
    if at.size < MIN_TEMPERED_TOKENS:
        return None
    sample = at[:: -(-at.size // MAX_TEMPERED_TOKENS)]  # an even sample of a big run's
    t = keys.take(pa.array(sample))
    if "ref_logprob" in ref.column_names and same_rows(keys.column("ref_logprob"), ref.column("ref_logprob")):
        # `tok` zips the reference (`metrics.join_grouped`: each key once, row i is reference row i): the
        # join below would find exactly these rows, and hashing a 20M-row reference costs seconds
        t = t.append_column("_row", pa.array(sample.astype(np.int64)))
    else:
        # Arrow joins carry no list columns: the top-k rows by a joined row number
        rows = pa.table(
            {
                "request_id": ref.column("request_id"),
                "position": ref.column("position"),
                "_row": pa.array(np.arange(ref.num_rows, dtype=np.int64)),
            }
        )
        t = t.join(rows, ["request_id", "position"])
    if t.num_rows < MIN_TEMPERED_TOKENS:
        return None
    eng, raw = t.column("engine_logprob").to_numpy(), t.column("ref_logprob").to_numpy()
    raw_error = float(grid.nanmedian(np.abs(eng - raw)))
    topk = grid.TopK(ref.column("ref_topk_logprobs").take(t.column("_row")))
    # only the temperatures whose error can be under the limit are computed (`temperature_grid`: the others'
    # are at least the limit, bit for bit, so neither the best nor a fit can be among them)
    errors = np.full(TEMPERATURE_GRID.size, np.inf)
    # positions without a top-k: NaN, left out (numpy's error state only: this may run on a thread of its own,
    # where the process-wide warning filters are not this function's to change)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        check = np.flatnonzero(~grid.at_least(topk, raw, eng, TEMPERATURE_GRID, 0.1 * raw_error))
        errors[check] = grid.errors(topk, raw, eng, TEMPERATURE_GRID[check])
    if not np.isfinite(errors).any():
        return None
    best = int(np.nanargmin(errors))
    value, error = float(TEMPERATURE_GRID[best]), float(errors[best])
    if abs(value - 1.0) <= 0.02 or not error < 0.1 * raw_error:
        return None
    return {
        "value": value,
        "tokens": int(t.num_rows),
        "error": error,
        "raw_error": raw_error,
        "sentence": (
            f"the server reports logprobs at a temperature of about {value:.3g} ({t.num_rows} tokens whose "
            f"logprob departs from the raw one fit it to a median {error:.2g}, against {raw_error:.2g} raw)"
        ),
    }
