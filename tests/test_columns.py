"""The column helpers of the token path give what the plain whole-column expressions give, across
chunk boundaries and block boundaries (`lpf.analysis.columns`)."""

import numpy as np
import pyarrow as pa

from lpf.analysis import columns as c


def test_change_points_across_chunks_and_one_array_without_a_copy():
    ids = ["a", "a", "b", "b", "b", "c", "a", "a"]
    whole = np.flatnonzero(np.array(ids[1:]) != np.array(ids[:-1]))
    for cuts in ([8], [2, 6], [1, 1, 3, 3], [5, 0, 3]):  # chunkings, an empty chunk among them
        chunks, at = [], 0
        for k in cuts:
            chunks.append(pa.array(ids[at : at + k], pa.string()))
            at += k
        col = pa.chunked_array(chunks, pa.string())
        assert np.array_equal(c.change_points(col), whole), cuts
    one = pa.chunked_array([pa.array(ids)])
    assert c.one_array(one).buffers()[2].address == one.chunk(0).buffers()[2].address
    assert c.one_array(pa.chunked_array([pa.array(ids[:3]), pa.array(ids[3:])])).to_pylist() == ids


def test_falls_within_and_same_rows(monkeypatch):
    rng = np.random.default_rng(0)
    pos = rng.integers(0, 5, 10_001)
    monkeypatch.setattr(c, "BLOCK", 333)
    assert np.array_equal(c.falls(pos), np.flatnonzero(pos[1:] <= pos[:-1]))
    assert c.falls(np.zeros(1)).size == 0 and c.falls(np.zeros(0)).size == 0
    assert c.within(np.array([2, 5]), np.array([1, 2, 5, 9])) and not c.within(np.array([2, 6]), np.array([1, 2, 5]))
    assert not c.within(np.array([10]), np.array([1, 2])) and c.within(np.zeros(0, int), np.zeros(0, int))
    a = pa.chunked_array([pa.array([1.0, 2.0, 3.0])])
    t = pa.table({"x": a})
    assert c.same_rows(t.column("x"), a) and not c.same_rows(pa.chunked_array([pa.array([1.0, 2.0, 3.0])]), a)
    assert not c.same_rows(a.slice(1), a)


def test_lookup_finds_every_key_and_says_when_one_is_absent():
    ids = pa.array(["b", "a", "c\x00", "c", "dd"])  # two ids numpy's fixed-width text cannot tell apart
    lookup = c.Lookup(ids)
    assert lookup.index(pa.array(["a", "c", "c\x00", "zz", "dd"])).tolist() == [1, 3, 2, -1, 4]
    assert lookup.index(pa.chunked_array([pa.array(["dd"]), pa.array(["b"])])).tolist() == [4, 0]
    assert c.Lookup(pa.array([], pa.string())).index(pa.array(["a"])).tolist() == [-1]
