"""Per-token evidence for the run-level test (`run_test`), from the run's tables.

Contract (pure: Arrow tables and numpy arrays in, numpy arrays and dicts out):
  evidence_columns(joined, tokens, reference, requests) -> the arrays `run_test.token_evidence`
      reads, one row per scored token in arrival order (request seq, then position), top-k lists as
      [n, k] matrices (`list_matrix`; ids -1 and logprobs -inf where a list is short), `order` the
      permutation from `joined`'s rows.
  sensitivity(...)   s per token: sqrt((1 - p_t)^2 + sum_{j != t} p_j^2) over the reference's top-k,
                     how far one nat of logit error moves the token's logprob.
  topk_spread(...)   per position, over the ids both top-k lists share: the spread w of engine -
                     reference logprob (every position shows a logit error, even a settled one),
                     and with `details` KL on that support and the error of the reference's top-2
                     margin at contested positions (its second choice p >= MARGIN_P).
  engine_floor(cols), calibration_floor(cols, joined, calibration) -> `floors.floor_stats` of the
      engine, or of a calibration run (the reference at the engine's dtype), against the reference.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.floors import floor_stats

MARGIN_P = 0.01  # a position is contested when the reference's second choice has at least this probability
CHUNK = 1 << 18


def list_matrix(col, fill) -> np.ndarray:
    """A list column as an [n, k] matrix (k its longest list; short or null lists padded with `fill`)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    n = len(arr)
    if n == 0:
        return np.zeros((0, 0))
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    width = np.diff(offsets)
    if arr.null_count:
        width = np.where(arr.is_valid().to_numpy(zero_copy_only=False), width, 0)
    k = int(width.max()) if n else 0
    if k == 0 or values.size == 0:
        return np.full((n, 0), fill, dtype=values.dtype if values.size else np.float64)
    if int(width.min()) == k and not arr.null_count:
        return values[offsets[0]:offsets[0] + n * k].reshape(n, k)
    idx = offsets[:-1, None] + np.arange(k)
    return np.where(np.arange(k) < width[:, None], values[np.minimum(idx, values.size - 1)], fill)


def _row_index(table: pa.Table, keys: pa.Table) -> np.ndarray:
    """The row of `table` holding each (request_id, position) of `keys` (all present)."""
    if table.num_rows == keys.num_rows and table.column("position").equals(keys.column("position")) and \
            table.column("request_id").equals(keys.column("request_id")):
        return np.arange(keys.num_rows)
    left = keys.select(["request_id", "position"]).append_column("_k", pa.array(np.arange(keys.num_rows)))
    right = table.select(["request_id", "position"]).append_column("_t", pa.array(np.arange(table.num_rows)))
    j = left.join(right, keys=["request_id", "position"], join_type="inner").sort_by("_k")
    return j.column("_t").to_numpy()


def evidence_columns(joined: pa.Table, tokens: pa.Table, reference: pa.Table, requests: pa.Table) -> dict:
    """The `token_evidence` inputs for every row of `joined`, in arrival order (request `seq`, then
    position). Top-k lists come from `tokens` / `reference` by key (Arrow joins carry no lists)."""
    order = _arrival_order(joined, requests)
    pick = (lambda a: a) if order is None else (lambda a: a[order])  # noqa: E731  (None: already in order)
    cols = {name: pick(joined.column(name).to_numpy())
            for name in ("token_id", "engine_logprob", "ref_logprob", "ref_top1_id", "ref_top1_logprob")}
    r = pick(_row_index(reference, joined))
    cols["ref_topk_ids"] = _rows(list_matrix(reference.column("ref_topk_ids"), -1), r)
    cols["ref_topk_logprobs"] = _rows(list_matrix(reference.column("ref_topk_logprobs"), -np.inf), r)
    if "engine_topk_ids" in tokens.column_names:
        ids = list_matrix(tokens.column("engine_topk_ids"), -1)
        if ids.shape[1]:
            t = pick(_row_index(tokens, joined))
            cols["engine_topk_ids"] = _rows(ids, t)
            cols["engine_topk_logprobs"] = _rows(list_matrix(tokens.column("engine_topk_logprobs"), -np.inf), t)
    cols["order"] = np.arange(joined.num_rows) if order is None else order
    return cols


def _rows(matrix: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """matrix[rows], without the copy when `rows` is 0..n-1."""
    if len(rows) == len(matrix) and (len(rows) == 0 or (rows[0] == 0 and rows[-1] == len(rows) - 1
                                                         and bool(np.all(np.diff(rows) == 1)))):
        return matrix
    return matrix[rows]


def _arrival_order(joined: pa.Table, requests: pa.Table) -> np.ndarray | None:
    """The permutation of `joined` into (request seq, position) order; None when it is in order."""
    seq_of = pc.index_in(joined.column("request_id"), value_set=requests.column("request_id").combine_chunks())
    seq = requests.column("seq").to_numpy()[seq_of.fill_null(0).to_numpy(zero_copy_only=False)]
    pos = joined.column("position").to_numpy()
    if len(seq) < 2:
        return None
    ds = np.diff(seq)
    if bool(np.all((ds > 0) | ((ds == 0) & (np.diff(pos) > 0)))):
        return None
    return np.lexsort((pos, seq))


def engine_floor(cols: dict) -> dict:
    """`floors.floor_stats` of the engine against the reference (`evidence_columns`' arrays)."""
    s = sensitivity(cols["ref_logprob"], cols["token_id"], cols["ref_topk_ids"], cols["ref_topk_logprobs"])
    topk = topk_spread(cols["engine_topk_ids"], cols["engine_topk_logprobs"], cols["ref_topk_ids"],
                       cols["ref_topk_logprobs"]) if "engine_topk_ids" in cols else None
    return floor_stats(cols["engine_logprob"] - cols["ref_logprob"], s, topk)


def calibration_floor(cols: dict, joined: pa.Table, calibration: pa.Table) -> dict | None:
    """`floors.floor_stats` of a calibration run (the reference again at the engine's dtype) against
    the reference, on the engine's tokens: what an honest implementation at that dtype departs by.
    None when the two share no token."""
    keys = joined.select(["request_id", "position"]).take(pa.array(cols["order"]))
    if keys.num_rows == calibration.num_rows:
        pos, r = np.arange(keys.num_rows), _row_index(calibration, keys) if calibration.num_rows else None
    else:  # a partial calibration run: the tokens it scored
        both = keys.append_column("_k", pa.array(np.arange(keys.num_rows))).join(
            calibration.select(["request_id", "position"]).append_column("_c", pa.array(np.arange(calibration.num_rows))),
            keys=["request_id", "position"], join_type="inner").sort_by("_k")
        pos, r = both.column("_k").to_numpy(), both.column("_c").to_numpy()
    if r is None or not len(pos):
        return None
    ref_ids, ref_lp = cols["ref_topk_ids"][pos], cols["ref_topk_logprobs"][pos]
    s = sensitivity(cols["ref_logprob"][pos], cols["token_id"][pos], ref_ids, ref_lp)
    topk = topk_spread(list_matrix(calibration.column("ref_topk_ids"), -1)[r],
                       list_matrix(calibration.column("ref_topk_logprobs"), -np.inf)[r], ref_ids, ref_lp)
    return floor_stats(calibration.column("ref_logprob").to_numpy()[r] - cols["ref_logprob"][pos], s, topk)


def sensitivity(ref_logprob: np.ndarray, token: np.ndarray, ref_ids: np.ndarray, ref_lp: np.ndarray) -> np.ndarray:
    """s per token: how far one nat of logit error moves the token's logprob (see the module doc)."""
    one_minus = -np.expm1(np.minimum(ref_logprob, 0.0))
    # p_j^2 = exp(2 lp_j), in float32: s needs no more precision than the top-k lists have
    # (a short list's padding is -inf: exp gives 0); the token's own entry is masked out
    sq = np.exp(2 * ref_lp.astype(np.float32))
    sq *= ref_ids != token[:, None]
    return np.sqrt(one_minus**2 + sq @ np.ones(sq.shape[1], dtype=np.float32))


def _aligned_topk(eng_ids, eng_lp, ref_ids) -> np.ndarray:
    """[n, k_ref] float32: the engine's logprob of each of the reference's top-k ids (NaN where the
    engine's top-k lacks it). Rows whose two lists hold the same ids in the same order (most rows:
    small errors rarely reorder a top-k) are taken as they are; only the others are matched id by id."""
    n, kr = ref_ids.shape
    valid = ref_ids >= 0
    if eng_ids.shape[1] == kr:
        same = ((eng_ids == ref_ids) | ~valid).all(axis=1)
        out = np.where(valid, eng_lp, np.nan).astype(np.float32)
        rest = np.flatnonzero(~same)
    else:
        out = np.full((n, kr), np.nan, dtype=np.float32)
        rest = np.arange(n)
    for lo in range(0, rest.size, CHUNK):
        rows = rest[lo:lo + CHUNK]
        ei, el, ri = eng_ids[rows], eng_lp[rows].astype(np.float32), ref_ids[rows]
        match = (ri[:, :, None] == ei[:, None, :]) & (ri[:, :, None] >= 0)
        at = np.take_along_axis(el, match.argmax(axis=2), axis=1)
        out[rows] = np.where(match.any(axis=2), at, np.nan)
    return out


def topk_spread(eng_ids, eng_lp, ref_ids, ref_lp, details: bool = True) -> dict:
    """Per position, over the ids both top-k lists hold: `w`, the sample standard deviation of engine
    - reference logprob over them (NaN below 2 shared), and `shared`, their count; with `details`
    also `kl`, KL(reference || engine) on that support renormalised (NaN below 2), and `margin`, how
    far the engine moved the reference's top-2 margin (NaN unless both of the reference's top two
    are shared and the second has p >= MARGIN_P: a contested position, where a greedy flip can
    happen). Float32 throughout: the top-k lists are float32."""
    e = _aligned_topk(eng_ids, eng_lp, ref_ids)
    rl = ref_lp.astype(np.float32)
    x = e - rl  # NaN where the engine lacks the id (or the reference's list is short)
    has = ~np.isnan(x)
    np.copyto(x, 0.0, where=~has)
    ones = np.ones(x.shape[1], dtype=np.float32)  # row sums as a matrix-vector product: numpy's
    m = (has.astype(np.float32) @ ones).astype(np.int64)  # reductions over a short axis are slow
    ok = m >= 2
    mean = (x @ ones) / np.maximum(m, 1)
    x -= mean[:, None]  # centred: the same spread and KL, no overflow
    np.copyto(x, 0.0, where=~has)
    w = np.sqrt(((x * x) @ ones) / np.maximum(m - 1, 1))
    out = {"w": np.where(ok, w, np.nan), "shared": m}
    if not details:
        return out
    # KL(p_S || q_S) = log sum p_S e^x - sum p_S x, with p_S the reference renormalised over S
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        rs = np.where(has, rl, -np.inf)
        p = np.exp(rs - rs.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        div = np.log((p * np.exp(x)).sum(axis=1)) - (p * x).sum(axis=1)
    out["kl"] = np.where(ok, np.maximum(div, 0.0), np.nan)
    out["margin"] = np.full(len(e), np.nan)
    if e.shape[1] >= 2:  # the error of the engine's margin between the reference's first and second choices
        both = has[:, 0] & has[:, 1] & (rl[:, 1] >= math.log(MARGIN_P))
        with np.errstate(invalid="ignore"):
            out["margin"] = np.where(both, np.abs((e[:, 0] - e[:, 1]) - (rl[:, 0] - rl[:, 1])), np.nan)
    return out
