"""The run-level test's tokens of a streamed run: taken from each chunk as it is scored, put in arrival order at the end.

Contract (pure: numpy arrays and Arrow columns in, numpy arrays out):
- `kept_rows(starts, n, first, step) -> (rows, index)`: of a chunk of n rows grouped by request
  (`starts`), with `first[i]` the arrival index of request i's first token, the rows whose arrival
  index (first + rank in the request) is a multiple of `step`, in row order, and those indices:
  the rows `run_test.run_level_test` reads of the whole run, found per request without a
  per-row modulo.
- `take(joined, tokens, reference, rows, index, codes) -> piece`: at those rows, the columns
  `token_evidence.evidence_columns` reads: numpy for the scalar ones, Arrow lists for the top-k
  ones, and `no_logprob` (`absent.mask`) when a kept row came back without a logprob; `tokens` and
  `reference` lie row for row with `joined` (a zipped chunk); `codes`: each row's request as an integer
  (`columns.Codes`).
- `gather(pieces) -> (cols, codes)`: the pieces of every chunk (in token order) as
  `evidence_columns(keys, tokens, reference, requests)` gives them over the same rows (`cols`,
  "order" included), and each row's request code in that order. Exactly those arrays when the
  rows' requests have distinct `seq` (their arrival order is then the arrival index's order, which
  the caller checks): the top-k matrices by the same `list_rows` over the same lists, the scalar
  columns the same values in the same dtypes.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lpf.analysis import absent
from lpf.analysis.token_evidence import _widths, list_rows

SCALARS = ("token_id", "engine_logprob", "ref_logprob", "ref_top1_id", "ref_top1_logprob")
REFERENCE_LISTS = ("ref_topk_ids", "ref_topk_logprobs")
ENGINE_LISTS = ("engine_topk_ids", "engine_topk_logprobs")


def kept_rows(starts: np.ndarray, n: int, first: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.diff(np.r_[starts, n]).astype(np.int64)
    lead = (-first) % step  # the rank of each request's first kept token
    m = np.maximum(0, (counts - lead + step - 1) // step)
    at = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(np.cumsum(m) - m, m)
    return np.repeat(starts + lead, m) + step * at, np.repeat(first + lead, m) + step * at


def take(
    joined: pa.Table, tokens: pa.Table, reference: pa.Table, rows: np.ndarray, index: np.ndarray, codes: np.ndarray
) -> dict:
    piece = {"index": index, "codes": codes[rows]}
    for name in SCALARS:
        piece[name] = _scalars(joined.column(name), rows)
    no_lp = absent.mask(joined.column("engine_logprob"), rows) if len(rows) else None
    if no_lp is not None:
        piece["no_logprob"] = no_lp
    for name in REFERENCE_LISTS:
        piece[name] = _lists(reference.column(name), rows)
    for name in ENGINE_LISTS:
        if name in tokens.column_names:
            piece[name] = _lists(tokens.column(name), rows)
    return piece


def _scalars(col: pa.ChunkedArray, rows: np.ndarray):
    """numpy where no value is null (the values themselves); else Arrow, so that `gather` turns a
    null into a float NaN only where a kept row holds one, as `evidence_columns` does."""
    if col.null_count == 0:
        return col.to_numpy()[rows]
    return col.take(pa.array(rows)).combine_chunks()


def _lists(col: pa.ChunkedArray, rows: np.ndarray):
    """(values [m, k], the list type) where every list of `col` is k long with no null in or of it:
    `list_rows`' own view of such lists, taken at `rows`; else the lists at `rows`, in Arrow."""
    mats, base = [], 0
    for c in col.chunks:
        offsets = c.offsets.to_numpy()
        width = np.diff(offsets)
        k = int(width[0]) if width.size else 0
        if c.null_count or c.values.null_count or not width.size or not (width.min() == k == width.max()):
            return col.take(pa.array(rows)).combine_chunks()
        hit = rows[(rows >= base) & (rows < base + len(c))] - base
        values = c.values.to_numpy()
        mats.append((k, values[offsets[0] : offsets[0] + len(c) * k].reshape(len(c), k)[hit]))
        base += len(c)
    if len({k for k, _ in mats}) > 1:
        return col.take(pa.array(rows)).combine_chunks()
    if not mats:
        return col.take(pa.array(rows)).combine_chunks()
    return (np.concatenate([m for _, m in mats]) if len(mats) > 1 else mats[0][1], col.type)


def gather(pieces: list[dict]) -> tuple[dict, np.ndarray]:
    """(`pieces` at least one: a run with a scored token keeps its first.)"""
    index = np.concatenate([p["index"] for p in pieces])
    codes = np.concatenate([p["codes"] for p in pieces])
    n = index.size
    order = _arrival(index, codes)
    cols = {}
    for name in SCALARS:
        parts = [p[name] for p in pieces]
        if all(isinstance(x, np.ndarray) for x in parts):
            a = np.concatenate(parts)
        else:  # `evidence_columns`' conversion: one for all, nulls as NaN
            a = pa.chunked_array([pa.array(x) if isinstance(x, np.ndarray) else x for x in parts]).to_numpy()
        cols[name] = a if order is None else a[order]
    if any("no_logprob" in p for p in pieces):  # as `evidence_columns`: only when a kept token has none
        a = np.concatenate([p.get("no_logprob", np.zeros(p["index"].size, bool)) for p in pieces])
        cols["no_logprob"] = a if order is None else a[order]
    for name, fill in zip(REFERENCE_LISTS, (-1, -np.inf)):
        cols[name] = _list_rows([p[name] for p in pieces], order, fill)
    if ENGINE_LISTS[0] in pieces[0] and n:
        ids = [p[ENGINE_LISTS[0]] for p in pieces]
        k = _matrix(ids, 0).shape[1] if _matrix(ids, 0) is not None else _widths(_as_lists(ids))[0]
        if k:  # what `evidence_columns` asks of the engine's lists: one not empty (a value in it)
            for name, fill in zip(ENGINE_LISTS, (-1, -np.inf)):
                cols[name] = _list_rows([p[name] for p in pieces], order, fill)
    cols["order"] = np.arange(n) if order is None else order
    return cols, codes if order is None else codes[order]


def _list_rows(parts: list, order: np.ndarray | None, fill) -> np.ndarray:
    """`list_rows` of the pieces' lists concatenated, at `order`: the matrix itself when every
    piece's lists are k > 0 long (what `list_rows` gives of such lists: their values as [n, k])."""
    m = _matrix(parts)
    if m is not None:
        return m if order is None else m[order]
    return list_rows(_as_lists(parts), order, fill)


def _matrix(parts: list, rows: int | None = None) -> np.ndarray | None:
    """(`rows`: 0 to learn only the width, as a [0, k] matrix)"""
    if not all(isinstance(x, tuple) for x in parts) or len({x[0].shape[1] for x in parts}) != 1:
        return None
    if not parts[0][0].shape[1]:
        return None  # empty lists: `list_rows` decides their dtype
    if rows == 0:
        return parts[0][0][:0]
    return np.concatenate([x[0] for x in parts]) if len(parts) > 1 else parts[0][0]


def _as_lists(parts: list) -> pa.Array:
    out = []
    for x in parts:
        if isinstance(x, tuple):
            (m, k), typ = x[0].shape, x[1]
            offsets = pa.array((np.arange(m + 1) * k).astype(np.int32))
            x = pa.ListArray.from_arrays(offsets, pa.array(x[0].ravel()), type=typ)
        out.append(x)
    return pa.concat_arrays(out)


def _arrival(index: np.ndarray, codes: np.ndarray) -> np.ndarray | None:
    """The rows in arrival order: None when they already are; else request by request (each
    request's rows are contiguous and rising, and its arrival indices a range of its own)."""
    n = index.size
    if n < 2 or bool(np.all(index[1:] > index[:-1])):
        return None
    starts = np.r_[0, np.flatnonzero(codes[1:] != codes[:-1]) + 1]
    by = np.argsort(index[starts], kind="stable")
    counts = np.diff(np.r_[starts, n])[by]
    first = np.cumsum(counts) - counts
    return np.repeat(starts[by] - first, counts) + np.arange(n)
