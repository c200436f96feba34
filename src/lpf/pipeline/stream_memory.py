"""Where a streamed analysis keeps what it keeps: whole-run logprob columns, and its allocator regime.

Contract (I/O: the spill files; the analysis is `lpf.analysis.stream`):
- `Spill(folder)`: whole-run float64 columns written chunk by chunk, read back whole or a piece at a
  time (`rows`); `Kept()` the same interface over the chunks' own arrays held in memory (no copy,
  no file), what the one pass uses for runs of up to KEEP_TOKENS tokens (16 bytes a token: at 10M
  tokens less than the parts read ahead, and no 160 MB written to and read back from the page cache).
- `Pieces(folder)`: the rows the steps after scoring gathered (`lpf.analysis.stream_gather`), tables
  added under a name chunk by chunk and read back in order (`pieces(name)`): in memory until a name
  holds KEEP_ROWS rows, then each piece in its own Arrow file, memory-mapped when read.
- `heap()`: the memory regime of a streamed analysis (a context manager, restored on exit): Arrow
  allocates from jemalloc where pyarrow has it, and Python's cyclic GC waits.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa

KEEP_TOKENS = 1 << 24  # the one pass keeps the logprob columns in memory up to this many tokens (256 MB)
KEEP_ROWS = 1 << 18  # gathered rows a name keeps in memory before its pieces go to files


class Spill:
    """Whole-run float64 columns written chunk by chunk, read back one at a time (as often as asked)."""

    def __init__(self, folder: Path):
        self.folder, self.files = folder, {}

    def add(self, cols: dict[str, np.ndarray]) -> None:
        for name, values in cols.items():
            if name not in self.files:
                self.files[name] = open(self.folder / f"{name}.f64", "wb")
            np.ascontiguousarray(values, np.float64).tofile(self.files[name])

    def drop(self, name: str) -> None:
        f = self.files.pop(name, None)
        if f is not None:
            f.close()
            (self.folder / f"{name}.f64").unlink()

    def read(self, name: str) -> np.ndarray:
        f = self.files.get(name)
        if f is None:
            return np.zeros(0)
        f.close()
        return np.fromfile(self.folder / f"{name}.f64", np.float64)

    def rows(self, name: str, rows) -> np.ndarray:
        """A column's values at `rows`: a slice (read from its offset) or row indices (gathered
        through a memory map): a piece at a time, never the whole column."""
        f = self.files.get(name)
        if f is None:
            return np.zeros(0)
        if not f.closed:
            f.close()
        path = self.folder / f"{name}.f64"
        if isinstance(rows, slice):
            lo, hi, _ = rows.indices(path.stat().st_size // 8)
            return np.fromfile(path, np.float64, count=hi - lo, offset=8 * lo)
        if not len(rows):
            return np.zeros(0)
        return np.array(np.memmap(path, np.float64, mode="r")[rows])


class Kept:
    """`Spill`'s interface over columns held in memory: the arrays each chunk handed over (views of
    the parts' own buffers where a chunk lies in one), never copied into one."""

    def __init__(self):
        self.files: dict[str, list[np.ndarray]] = {}
        self.bounds: dict[str, np.ndarray] = {}

    def add(self, cols: dict[str, np.ndarray]) -> None:
        for name, values in cols.items():
            self.files.setdefault(name, []).append(values)
            self.bounds.pop(name, None)

    def rows(self, name: str, rows) -> np.ndarray:
        """A column's values at `rows`: a slice (its pieces joined) or row indices (gathered)."""
        parts = self.files.get(name)
        if not parts:
            return np.zeros(0)
        if name not in self.bounds:
            self.bounds[name] = np.cumsum([0] + [len(p) for p in parts])
        bounds = self.bounds[name]
        if isinstance(rows, slice):
            lo, hi, _ = rows.indices(int(bounds[-1]))
            a, b = np.searchsorted(bounds, lo, "right") - 1, np.searchsorted(bounds, hi, "left")
            out = [parts[i][max(lo - bounds[i], 0) : hi - bounds[i]] for i in range(a, b)]
            return np.asarray(out[0], np.float64) if len(out) == 1 else np.concatenate(out).astype(np.float64)
        rows = np.asarray(rows)
        out = np.empty(rows.size)
        at = np.searchsorted(bounds, rows, "right") - 1
        for i in np.unique(at):
            hit = at == i
            out[hit] = parts[i][rows[hit] - bounds[i]]
        return out


class Pieces:
    """Tables added by name, read back in order: in memory up to KEEP_ROWS rows a name, then files."""

    def __init__(self, folder: Path):
        self.folder, self.held, self.files, self.rows = folder, {}, {}, {}

    def add(self, name: str, table: pa.Table) -> None:
        self.rows[name] = self.rows.get(name, 0) + table.num_rows
        if name not in self.files and self.rows[name] <= KEEP_ROWS:
            self.held.setdefault(name, []).append(table)
            return
        files = self.files.setdefault(name, [])
        for piece in self.held.pop(name, []) + [table]:  # what was held goes first, in order
            path = self.folder / f"gathered-{name}-{len(files):05d}.arrow"
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, piece.schema) as writer:
                writer.write_table(piece)
            files.append(path)

    def pieces(self, name: str):
        if name not in self.files:
            yield from self.held.get(name, ())
            return
        for path in self.files[name]:  # the map stays open while the table's buffers live
            yield pa.ipc.open_file(pa.memory_map(str(path))).read_all()


@contextmanager
def heap():
    """Arrow's default pool is jemalloc for the duration (where pyarrow was built with it), then
    what it was, jemalloc's free pages handed back; Python's cyclic GC is off meanwhile.
    Why: the analysis decodes ~1 GB of parts per 10M tokens into buffers that live a part or two.
    mimalloc (pyarrow's default) backs them with transparent huge pages and returns freed ones to
    the system within milliseconds, so each part's buffers are fresh 2 MB pages the kernel zeroes
    whole: on this 2-core VM that zeroing was 40% of the analysis' CPU (perf: clear_page_erms under
    do_huge_pmd_anonymous_page) and the system time 3.0 s against 1.3 s with jemalloc, whose peak
    RSS was lower too (954 vs 1048 MB, 10M tokens, medians of 6). The GC: the analysis makes no
    reference cycles worth collecting, and its generation-2 passes walked every live object."""
    try:
        pool = pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without it: its default stays
        pool = None
    before, collecting = pa.default_memory_pool(), gc.isenabled()
    if pool is not None:
        pa.set_memory_pool(pool)
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        if pool is not None:
            pa.set_memory_pool(before)
            pool.release_unused()
