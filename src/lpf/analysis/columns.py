"""Arrow column helpers for the token path, each avoiding a whole-column copy.

Contract (pure): `one_array(col)` -> the column as one Array (a ChunkedArray's only chunk as it is:
`combine_chunks` copies even one chunk, a fresh 340 MB for the request ids of a 20M-token run);
`change_points(ids)` -> the rows i where ids[i] != ids[i + 1] (int64, ascending), chunk by chunk
(a multi-chunk column is never combined); `same_rows(a, b)` -> whether two columns are the same
buffers at the same offsets (a table's column handed on as another's, e.g. `metrics.join_grouped`'s
zip: then row i of one is row i of the other); `falls(pos)` -> the rows i where pos[i + 1] <= pos[i],
in blocks (a whole-run boolean temporary is a fresh 20 MB at 20M rows); `within(a, b)` -> whether
every value of ascending `a` is in ascending `b`; `Lookup(ids).index(keys)` -> the position of each
key among `ids` (-1 where absent), many times over one set of ids without hashing it again;
`Codes(ids).of(col)` -> the same for every row of a dictionary-encoded column (int32), looking up
only its dictionaries' strings (a row's string is never built).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def one_array(col) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def change_points(ids) -> np.ndarray:
    chunks = [c for c in (ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]) if len(c)]
    out, base, last = [], 0, None
    for c in chunks:
        if last is not None and c[0] != last:
            out.append(np.array([base - 1], np.int64))
        if len(c) > 1:
            out.append(
                pc.indices_nonzero(pc.not_equal(c.slice(0, len(c) - 1), c.slice(1))).to_numpy().astype(np.int64) + base
            )
        last, base = c[len(c) - 1], base + len(c)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def same_rows(a, b) -> bool:
    ca = a.chunks if isinstance(a, pa.ChunkedArray) else [a]
    cb = b.chunks if isinstance(b, pa.ChunkedArray) else [b]
    return len(ca) == len(cb) and all(
        len(x) == len(y)
        and x.offset == y.offset
        and x.buffers()[-1] is not None
        and y.buffers()[-1] is not None
        and x.buffers()[-1].address == y.buffers()[-1].address
        for x, y in zip(ca, cb)
    )


# rows: a block's temporaries stay in the core's cache (1 << 20 took 3x the time to find departing rows)
BLOCK = 1 << 16


def falls(pos: np.ndarray) -> np.ndarray:
    out = []
    for lo in range(0, max(0, len(pos) - 1), BLOCK):
        hi = min(len(pos) - 1, lo + BLOCK)
        out.append(np.flatnonzero(pos[lo + 1 : hi + 1] <= pos[lo:hi]) + lo)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def within(a: np.ndarray, b: np.ndarray) -> bool:
    if not a.size:
        return True
    at = np.searchsorted(b, a)
    return bool(at.max() < b.size) and bool(np.array_equal(b[at], a))


class Lookup:
    """Positions of keys among a fixed set of distinct string ids: sorted once, then a vectorized
    binary search per call (checked against the ids themselves, so never a wrong position)."""

    def __init__(self, ids):
        self.ids = one_array(ids)
        text = self.ids.to_numpy(zero_copy_only=False).astype(str)
        self.order = np.argsort(text, kind="stable")
        self.sorted = text[self.order]

    def index(self, keys) -> np.ndarray:
        keys = one_array(keys)
        if not len(keys) or not len(self.ids):
            return np.full(len(keys), -1, np.int64)
        at = np.searchsorted(self.sorted, keys.to_numpy(zero_copy_only=False).astype(str)).clip(0, len(self.ids) - 1)
        found = self.order[at]
        hit = pc.equal(keys, self.ids.take(pa.array(found))).fill_null(False).to_numpy(zero_copy_only=False)
        if not hit.all():  # a key absent (or one numpy's fixed-width text cannot tell apart): by hash
            slow = pc.index_in(keys, value_set=self.ids).fill_null(-1).to_numpy(zero_copy_only=False)
            return slow.astype(np.int64)
        return found.astype(np.int64)


class Codes:
    """Each row's position among a fixed list of distinct string ids (-1 where absent), for
    dictionary-encoded columns: only a dictionary's strings are looked up, each row is an integer
    gather. A dictionary that is a run of the ids in their order (a part written in the requests'
    order: its first appearances) is found with one comparison after the last one found; any other
    by `Lookup`. Two rows have the same code >= 0 exactly when they hold the same string."""

    def __init__(self, ids):
        self.ids = one_array(ids)
        self.lookup: Lookup | None = None
        self.next = 0  # where the last dictionary found as a run of the ids ended

    def of(self, col) -> np.ndarray:
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        out = [self._chunk(c) for c in chunks]
        return out[0] if len(out) == 1 else np.concatenate(out) if out else np.zeros(0, np.int32)

    def _chunk(self, c: pa.DictionaryArray) -> np.ndarray:
        at = self._dictionary(c.dictionary)
        if c.null_count:
            idx = c.indices.fill_null(0).to_numpy()
            codes = at[idx] if at.size else np.full(len(c), -1, np.int32)
            codes[c.is_null().to_numpy(zero_copy_only=False)] = -1
            return codes
        return at[c.indices.to_numpy()]

    def _dictionary(self, d: pa.Array) -> np.ndarray:
        n = len(d)
        for lo in (self.next - 1, self.next):  # a request that straddles two row groups: in both
            if 0 <= lo and lo + n <= len(self.ids) and n and d.equals(self.ids.slice(lo, n)):
                self.next = lo + n
                return np.arange(lo, lo + n, dtype=np.int32)
        if n and len(self.ids):
            first = pc.index(self.ids, d[0]).as_py()
            if first >= 0 and first + n <= len(self.ids) and d.equals(self.ids.slice(first, n)):
                self.next = first + n
                return np.arange(first, first + n, dtype=np.int32)
        if self.lookup is None:
            self.lookup = Lookup(self.ids)
        return self.lookup.index(d).astype(np.int32)
