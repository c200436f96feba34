"""Per-token evidence for the run-level test (`run_test`), from the run's tables.

Contract (pure: Arrow tables and numpy arrays in, numpy arrays and dicts out):
  evidence_columns(joined, tokens, reference, requests, every=1, starts=None) -> the arrays
      `run_test.token_evidence` reads, one row per scored token in arrival order (request seq, then
      position), top-k lists as [n, k] matrices (`list_matrix`; ids -1 and logprobs -inf where a
      list is short), `order` the row of `joined` each comes from. `every`: only every k-th token
      in arrival order (what the run-level test reads of a huge run), the others never gathered;
      `starts`: `joined`'s request starts when the caller has them (`metrics.join_grouped`'s: each
      request one segment). `no_logprob` (only when one of
      those tokens came back without a logprob: `absent.mask`) tells such a token from a NaN value.
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

from lpf.analysis import absent
from lpf.analysis.columns import falls, one_array, same_rows, within
from lpf.analysis.floors import floor_stats
from lpf.analysis.verdicts import segment_starts

MARGIN_P = 0.01  # a position is contested when the reference's second choice has at least this probability
CHUNK = 1 << 18


def list_rows(col, rows, fill, widths: tuple[int, bool] | None = None) -> np.ndarray:
    """`list_matrix(col, fill)[rows]` (`rows`: None for all, a slice or row indices), building only
    those rows: k is still the column's longest list. `widths`: the column's `_widths`, when known."""
    arr = one_array(col)
    n = len(arr)
    if rows is None or n == 0:
        return list_matrix(arr, fill, widths)
    k, fixed = widths or _widths(arr)
    values = arr.values.to_numpy(zero_copy_only=False)
    offsets = arr.offsets.to_numpy()
    if k and fixed:  # fixed width: a view, then the rows
        return np.ascontiguousarray(values[offsets[0] : offsets[0] + n * k].reshape(n, k)[rows])
    if isinstance(rows, slice):
        rows = _indices(rows, n)
    width = np.diff(offsets)
    if arr.null_count:
        width = np.where(arr.is_valid().to_numpy(zero_copy_only=False), width, 0)
    if k == 0 or values.size == 0:
        return np.full((len(rows), 0), fill, dtype=values.dtype if values.size else np.float64)
    idx = offsets[rows][:, None] + np.arange(k)
    return np.where(np.arange(k) < width[rows][:, None], values[np.minimum(idx, values.size - 1)], fill)


def _widths(arr: pa.Array) -> tuple[int, bool]:
    """(its longest list, whether every list is that long and none null), in Arrow's kernels."""
    lengths = pc.list_value_length(arr)
    mm = pc.min_max(lengths.fill_null(0) if arr.null_count else lengths).as_py()
    k = int(mm["max"] or 0)
    return k, not arr.null_count and int(mm["min"] or 0) == k


def list_matrix(col, fill, widths: tuple[int, bool] | None = None) -> np.ndarray:
    """A list column as an [n, k] matrix (k its longest list; short or null lists padded with `fill`)."""
    arr = one_array(col)
    n = len(arr)
    if n == 0:
        return np.zeros((0, 0))
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    k, fixed = widths or _widths(arr)
    if fixed and k and values.size:
        return values[offsets[0] : offsets[0] + n * k].reshape(n, k)
    width = np.diff(offsets)
    if arr.null_count:
        width = np.where(arr.is_valid().to_numpy(zero_copy_only=False), width, 0)
    k = int(width.max()) if n else 0
    if k == 0 or values.size == 0:
        return np.full((n, 0), fill, dtype=values.dtype if values.size else np.float64)
    if int(width.min()) == k and not arr.null_count:
        return values[offsets[0] : offsets[0] + n * k].reshape(n, k)
    idx = offsets[:-1, None] + np.arange(k)
    return np.where(np.arange(k) < width[:, None], values[np.minimum(idx, values.size - 1)], fill)


def _same_keys(table: pa.Table, keys: pa.Table) -> bool:
    return (
        table.num_rows == keys.num_rows
        and table.column("position").equals(keys.column("position"))
        and table.column("request_id").equals(keys.column("request_id"))
    )


def _join_rows(table: pa.Table, keys: pa.Table) -> np.ndarray:
    """The row of `table` holding each (request_id, position) of `keys` (all present), by a join."""
    left = keys.select(["request_id", "position"]).append_column("_k", pa.array(np.arange(keys.num_rows)))
    right = table.select(["request_id", "position"]).append_column("_t", pa.array(np.arange(table.num_rows)))
    j = left.join(right, keys=["request_id", "position"], join_type="inner").sort_by("_k")
    return j.column("_t").to_numpy()


def _row_index(table: pa.Table, keys: pa.Table) -> np.ndarray:
    """The row of `table` holding each (request_id, position) of `keys` (all present)."""
    return np.arange(keys.num_rows) if _same_keys(table, keys) else _join_rows(table, keys)


def _table_rows(table: pa.Table, joined: pa.Table, rows, column: str):
    """The row of `table` holding each of `joined`'s `rows` (None: all of them; a slice or row
    indices), by key; `rows` itself when `table` lines up with `joined` (its `column` handed on as
    it is, or the same keys row for row)."""
    carried = (
        column in table.column_names
        and column in joined.column_names
        and same_rows(table.column(column), joined.column(column))
    )
    if table.num_rows == joined.num_rows and (carried or _same_keys(table, joined)):
        return rows
    if isinstance(rows, slice):
        rows = _indices(rows, joined.num_rows)
    return _join_rows(table, joined if rows is None else joined.select(["request_id", "position"]).take(pa.array(rows)))


def _pair_widths(table: pa.Table, ids: str, lps: str) -> tuple[tuple[int, bool], tuple[int, bool]]:
    """`_widths` of a table's top-k ids and logprobs lists (the second for free when both columns
    have the same offsets and no nulls, as every writer makes them)."""
    a, b = one_array(table.column(ids)), one_array(table.column(lps))
    wa = _widths(a)
    same = (
        len(a) == len(b)
        and not a.null_count
        and not b.null_count
        and a.offset == b.offset == 0
        and a.buffers()[1].equals(b.buffers()[1])
    )  # the same offsets, byte for byte (one memcmp)
    return wa, wa if same else _widths(b)


def evidence_columns(
    joined: pa.Table,
    tokens: pa.Table,
    reference: pa.Table,
    requests: pa.Table,
    every: int = 1,
    starts: np.ndarray | None = None,
) -> dict:
    """The `token_evidence` inputs for every `every`-th row of `joined` in arrival order (request
    `seq`, then position). Top-k lists come from `tokens` / `reference` by key (Arrow joins carry no lists)."""
    rows = _arrival_rows(joined, requests, every, starts)  # None: all of them, in order; a slice: in order
    cols = {
        name: _take(joined.column(name).to_numpy(), rows)
        for name in ("token_id", "engine_logprob", "ref_logprob", "ref_top1_id", "ref_top1_logprob")
    }
    no_lp = absent.mask(joined.column("engine_logprob"), rows) if joined.num_rows else None
    if no_lp is not None:  # tokens without a logprob: their NaN is no NaN value (`absent`)
        cols["no_logprob"] = no_lp
    r = _table_rows(reference, joined, rows, "ref_logprob")
    wi, wl = _pair_widths(reference, "ref_topk_ids", "ref_topk_logprobs") if reference.num_rows else (None, None)
    cols["ref_topk_ids"] = list_rows(reference.column("ref_topk_ids"), r, -1, wi)
    cols["ref_topk_logprobs"] = list_rows(reference.column("ref_topk_logprobs"), r, -np.inf, wl)
    if "engine_topk_ids" in tokens.column_names and tokens.num_rows:
        wi, wl = _pair_widths(tokens, "engine_topk_ids", "engine_topk_logprobs")
        values = one_array(tokens.column("engine_topk_ids")).values
        if wi[0] and values is not None and len(values):  # what list_matrix gives width > 0
            t = _table_rows(tokens, joined, rows, "token_id")
            cols["engine_topk_ids"] = list_rows(tokens.column("engine_topk_ids"), t, -1, wi)
            cols["engine_topk_logprobs"] = list_rows(tokens.column("engine_topk_logprobs"), t, -np.inf, wl)
    cols["order"] = np.arange(joined.num_rows) if rows is None else _indices(rows, joined.num_rows)
    return cols


def _indices(rows, n: int) -> np.ndarray:
    return np.arange(*rows.indices(n)) if isinstance(rows, slice) else rows


def _take(a: np.ndarray, rows) -> np.ndarray:
    if rows is None:
        return a
    return np.ascontiguousarray(a[rows]) if isinstance(rows, slice) else a[rows]


def _arrival_rows(joined: pa.Table, requests: pa.Table, every: int, starts: np.ndarray | None):
    """`joined`'s rows in arrival order (request seq, then position), every `every`-th; None for all
    rows and a slice for every k-th when they already are in that order. Per request where it can (each request's rows
    contiguous with positions ascending, each seq once), else per token."""
    n = joined.num_rows
    if n < 2:
        return None if every == 1 or n == 0 else slice(0, n, every)
    ids = joined.column("request_id")
    given, starts = starts is not None, segment_starts(ids) if starts is None else starts
    pos = joined.column("position").to_numpy()
    heads, req_ids = ids.take(pa.array(starts)), requests.column("request_id")
    if given and len(heads) == len(req_ids) and heads.equals(req_ids):
        # `join_grouped`'s requests are each one segment: distinct ids, here the requests' own in their order
        seq_of = np.arange(len(heads))
    else:
        seq_of = pc.index_in(heads, value_set=req_ids.combine_chunks()).fill_null(0).to_numpy(zero_copy_only=False)
    seq = requests.column("seq").to_numpy()[seq_of]
    rising = within(falls(pos), starts[1:] - 1)  # positions rise within each request
    by_value = np.sort(seq)
    if not rising or not bool(np.all(by_value[1:] != by_value[:-1])):
        order = _token_order(joined, requests)  # a request in pieces or a seq twice: token by token
        if order is None:
            return None if every == 1 else slice(0, n, every)
        return order[::every]
    if bool(np.all(seq[1:] > seq[:-1])):
        return None if every == 1 else slice(0, n, every)
    by_seq = np.argsort(seq, kind="stable")
    counts = np.diff(np.r_[starts, n])[by_seq]
    first = np.cumsum(counts) - counts  # arrival index of each request's first row, in seq order
    j = np.arange(0, n, every)
    at = np.searchsorted(first, j, side="right") - 1
    return starts[by_seq[at]] + (j - first[at])


def _token_order(joined: pa.Table, requests: pa.Table) -> np.ndarray | None:
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
    topk = (
        topk_spread(
            cols["engine_topk_ids"], cols["engine_topk_logprobs"], cols["ref_topk_ids"], cols["ref_topk_logprobs"]
        )
        if "engine_topk_ids" in cols
        else None
    )
    return floor_stats(cols["engine_logprob"] - cols["ref_logprob"], s, topk)


def calibration_floor(cols: dict, joined: pa.Table, calibration: pa.Table) -> dict | None:
    """`floors.floor_stats` of a calibration run (the reference again at the engine's dtype) against
    the reference, on the engine's tokens: what an honest implementation at that dtype departs by.
    None when the two share no token."""
    keys = joined.select(["request_id", "position"]).take(pa.array(cols["order"]))
    if keys.num_rows == calibration.num_rows:
        pos, r = np.arange(keys.num_rows), _row_index(calibration, keys) if calibration.num_rows else None
    else:  # a partial calibration run: the tokens it scored
        both = (
            keys.append_column("_k", pa.array(np.arange(keys.num_rows)))
            .join(
                calibration.select(["request_id", "position"]).append_column(
                    "_c", pa.array(np.arange(calibration.num_rows))
                ),
                keys=["request_id", "position"],
                join_type="inner",
            )
            .sort_by("_k")
        )
        pos, r = both.column("_k").to_numpy(), both.column("_c").to_numpy()
    if r is None or not len(pos):
        return None
    ref_ids, ref_lp = cols["ref_topk_ids"][pos], cols["ref_topk_logprobs"][pos]
    s = sensitivity(cols["ref_logprob"][pos], cols["token_id"][pos], ref_ids, ref_lp)
    topk = topk_spread(
        list_matrix(calibration.column("ref_topk_ids"), -1)[r],
        list_matrix(calibration.column("ref_topk_logprobs"), -np.inf)[r],
        ref_ids,
        ref_lp,
    )
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
        rows = rest[lo : lo + CHUNK]
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
    if x.shape[1] == 1:  # one reference id: at most one shared, no spread, KL or margin (the lines below' NaNs)
        out = {"w": np.full(len(e), np.nan), "shared": (~np.isnan(x[:, 0])).astype(np.int64)}
        if details:
            out.update(kl=np.full(len(e), np.nan, np.float32), margin=np.full(len(e), np.nan))
        return out
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
