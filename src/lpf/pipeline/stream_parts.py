"""Reading a run's parts for the streamed analysis: chunks of whole requests, read ahead.

Contract (I/O only; the analysis is `lpf.analysis.stream`, the stage `lpf.pipeline.analyze_stream`):
- `Rows(parts)` hands a table's parts out a number of rows at a time, cut at request boundaries
  (`request_cut`); `read_ahead(parts)` reads them in a background thread one part ahead (Parquet
  decoding releases the GIL: it overlaps the analysis of the chunk before).
- `zip_sizes(run, chunk_pass)` is the first pass over parts that line up row for row: chunks of
  ~CHUNK_ROWS rows, `chunk_pass(tokens, reference)` each, their sizes (None at the first chunk whose
  sides do not line up); `zip_chunks(run, sizes)` the same chunks again with every column.
- `Ranges(run, requests, folder)`: requests cut into request-id ranges of ~CHUNK_ROWS tokens, both
  tables bucketed to lz4 Arrow files (~1.7x the parts on disk), each range sorted by (request_id,
  position) as it is read back: the order the in-memory join-and-sort gives.
- `CodedRows(pieces, codes)`: `Rows` over `RunDir.iter_pieces` (row groups, request ids
  dictionary-encoded), each row's request as an integer (`lpf.analysis.columns.Codes`): cut and
  handed out without a string per row, a chunk never past the end of the row group it starts in
  when a request ends there.
- Chunks are ~`chunk_rows()` rows: CHUNK_ROWS over the WORKERS chunks scored at once.
- `ordered_map(fn, items, workers)`: `fn(*item)` of each item on up to `workers` threads, results in
  the items' order, at most `workers` items in flight (memory: that many chunks); `workers` 1 is a
  plain loop on the calling thread. numpy and Arrow release the GIL, so chunks score on both cores.
- `Tally(run)`: `lpf.analysis.returned.counts` of the tokens parts, counted as a pass reads them
  (`tally.parts(...)` or `tally.pieces(...)` wraps the reader), so what came back needs no read of
  its own.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import returned
from lpf.analysis.metrics import zipped_starts
from lpf.run import schema
from lpf.run.store import RunDir

CHUNK_ROWS = 1 << 20
# chunks scored at once: this machine's two cores (the read-ahead threads share them; more threads
# than cores only hold more chunks in memory)
WORKERS = max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def chunk_rows() -> int:
    """The rows of one chunk: CHUNK_ROWS shared by the WORKERS chunks in flight (the memory of one
    CHUNK_ROWS chunk, however many threads score them)."""
    return max(1, CHUNK_ROWS // WORKERS)


_COMPRESSED = pa.ipc.IpcWriteOptions(compression="lz4")  # the range files: half the disk for ~10% more time
TOKEN_COLUMNS = ["request_id", "position", "token_id", "engine_logprob", "engine_topk_ids", "engine_topk_logprobs"]
REFERENCE_COLUMNS = [
    "request_id",
    "position",
    "ref_logprob",
    "ref_rank",
    "ref_top1_id",
    "ref_top1_logprob",
    "ref_topk_ids",
    "ref_topk_logprobs",
    "ref_logsumexp",
]  # ref_entropy: no analysis reads it
FIRST_PASS = (["request_id", "position", "engine_logprob"], ["request_id", "position", "ref_logprob"])  # zip: |d| only


class Rows:
    """A table's parts in order, handed out a number of rows at a time."""

    def __init__(self, parts):
        self.parts, self.buf = iter(parts), None

    def _more(self) -> bool:
        part = next(self.parts, None)
        if part is None:
            return False
        self.buf = part if self.buf is None else pa.concat_tables([self.buf, part])
        return True

    def left(self, n: int) -> int:
        """How many rows are buffered, reading parts until there are more than `n` (or none are left)."""
        while (self.buf is None or self.buf.num_rows <= n) and self._more():
            pass
        return 0 if self.buf is None else self.buf.num_rows

    def take(self, n: int) -> pa.Table | None:
        """The next `n` rows (fewer at the end; None when the table has no parts)."""
        self.left(n - 1)
        if self.buf is None:
            return None
        head, self.buf = self.buf.slice(0, n), self.buf.slice(n)
        return head

    def request_cut(self, n: int) -> int:
        """The number of rows from here to the first request boundary at or after `n` rows."""
        while self.left(n) > n:
            ids = self.buf.column("request_id")
            last, window = ids[n - 1], 4096
            while n < self.buf.num_rows:  # look a window ahead, then a wider one: requests are short
                ahead = ids.slice(n, window)
                hit = pc.indices_nonzero(pc.not_equal(ahead, last))
                if len(hit):
                    return n + int(hit[0].as_py())
                n, window = n + len(ahead), window * 4
            # the whole buffer is one request's tail: read on
        return self.left(n)


class CodedRows:
    """`Rows` over pieces (part index, table with dictionary-encoded request ids): each piece's
    request ids become `codes.of(...)` integers as it is buffered, and the table keeps the other
    columns; `take(n)` gives (table, codes) of the next n rows."""

    def __init__(self, pieces, codes):
        self.pieces, self.codes = iter(pieces), codes
        self.buf, self.ids, self.ends = None, np.zeros(0, np.int32), []

    def _more(self) -> bool:
        piece = next(self.pieces, None)
        if piece is None:
            return False
        table = piece[1]
        ids = self.codes.of(table.column("request_id"))
        table = table.drop_columns(["request_id"])
        self.buf = table if self.buf is None else pa.concat_tables([self.buf, table])
        self.ids = ids if not self.ids.size else np.concatenate([self.ids, ids])
        self.ends.append(self.buf.num_rows)  # where a piece ends, in rows from the buffer's start
        return True

    def left(self, n: int) -> int:
        while (self.buf is None or self.buf.num_rows <= n) and self._more():
            pass
        return 0 if self.buf is None else self.buf.num_rows

    def take(self, n: int) -> tuple[pa.Table, np.ndarray] | None:
        self.left(n - 1)
        if self.buf is None:
            return None
        head, ids = self.buf.slice(0, n), self.ids[:n]
        self.buf, self.ids = self.buf.slice(n), self.ids[n:]
        self.ends = [e - n for e in self.ends if e > n]
        return head, ids

    def request_cut(self, n: int) -> int:
        """`Rows.request_cut` by code: the rows to the first change of request at or after `n` rows,
        or at or after the end of the piece the rows start in when that comes first (a chunk then
        lies in one piece, its columns one array each, unless a request straddles two pieces)."""
        self.left(0)
        if self.ends and self.ends[0] < n:
            n = max(self.ends[0], 1)
        while self.left(n) > n:
            hit = np.flatnonzero(self.ids[n:] != self.ids[n - 1])
            if hit.size:
                return n + int(hit[0])
            n = self.buf.num_rows  # the whole buffer is one request's tail: read on
        return self.left(n)


def read_ahead(parts, depth: int = 1):
    """`parts` (an iterator of tables) read in a background thread, `depth` parts ahead of the
    consumer: Parquet decoding releases the GIL, so reading the next part overlaps analysing the
    chunk before it. Memory: `depth` parts more. An error reading a part is raised here, in order.
    The thread starts now, not at the first part asked for: what the caller does first overlaps
    the first read."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def work():
        try:
            for part in parts:
                while not stop.is_set():
                    try:
                        q.put(part, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, raised there)
            q.put(e)

    worker = threading.Thread(target=work, name="lpf-analyze-read-ahead", daemon=True)
    worker.start()
    return _Ahead(q, stop, done, worker)


class _Ahead:
    """`read_ahead`'s iterator: `close()` (or dropping it, read to the end or not) stops the thread."""

    def __init__(self, q: queue.Queue, stop: threading.Event, done, worker: threading.Thread):
        self.q, self.stop, self.done, self.worker, self.over = q, stop, done, worker, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.over:
            raise StopIteration
        item = self.q.get()
        if item is self.done or isinstance(item, BaseException):
            self.close()
            if item is self.done:
                raise StopIteration
            raise item
        return item

    def close(self) -> None:
        self.over = True
        self.stop.set()
        while self.worker.is_alive():  # let it see the stop: drain what it may be putting
            try:
                self.q.get(timeout=0.1)
            except queue.Empty:
                pass

    def __del__(self):
        self.close()


def zip_sizes(run: RunDir, chunk_pass, keys_only: bool = False):
    """First pass over the parts as they lie, in request-aligned chunks of ~CHUNK_ROWS rows:
    `chunk_pass(tokens, reference)` per chunk (`keys_only`: request_id and position alone); the
    chunk sizes, or None at the first chunk whose sides do not line up (the in-memory analysis
    would join and sort)."""
    want = [c[:2] for c in FIRST_PASS] if keys_only else FIRST_PASS
    tok = Rows(read_ahead(run.iter_parts("tokens", want[0])))
    ref = Rows(read_ahead(run.iter_parts("reference", want[1])))
    sizes = []
    while True:
        n = tok.request_cut(chunk_rows())
        if n == 0:
            return sizes if ref.left(0) == 0 else None
        t, r = tok.take(n), ref.take(n)
        if r is None or zipped_starts(t, r) is None:
            return None
        chunk_pass(t, r)
        sizes.append(n)


def zip_chunks(run: RunDir, sizes: list[int], tally: "Tally | None" = None):
    """The chunks of `zip_sizes` again, with every column the analysis reads."""
    tok = Rows(read_ahead(counted(run.iter_parts("tokens", TOKEN_COLUMNS), tally)))
    ref = Rows(read_ahead(run.iter_parts("reference", REFERENCE_COLUMNS)))
    for n in sizes:
        yield tok.take(n), ref.take(n)


class Ranges:
    """Requests in request-id ranges of ~CHUNK_ROWS tokens, bucketed to Arrow files and sorted."""

    def __init__(self, run: RunDir, requests: pa.Table, spill: Path, tally: "Tally | None" = None):
        self.spill, self.tally = spill, tally
        ids = requests.column("request_id").combine_chunks()
        order = pc.sort_indices(ids).to_numpy()
        self.sorted_ids = ids.take(pa.array(order))
        n_out = pc.list_value_length(requests.column("output_token_ids")).fill_null(0).to_numpy(zero_copy_only=False)
        total = np.cumsum(n_out[order])
        self.cuts = (
            np.r_[0, np.flatnonzero(np.diff(total // chunk_rows())) + 1] if total.size else np.zeros(1, np.int64)
        )
        for table, columns in (("tokens", TOKEN_COLUMNS), ("reference", REFERENCE_COLUMNS)):
            self._bucket(run, table, columns)

    def _path(self, table: str, i: int) -> Path:
        return self.spill / f"{table}-{i:05d}.arrow"

    def _bucket(self, run: RunDir, table: str, columns: list[str]) -> None:
        want = pa.schema([schema.TABLES[table].field(c) for c in columns] + [pa.field(_RANK, pa.int32())])
        writers = [pa.ipc.new_file(self._path(table, i), want, options=_COMPRESSED) for i in range(len(self.cuts))]
        try:
            parts = run.iter_parts(table, columns)
            for part in counted(parts, self.tally) if table == "tokens" else parts:
                at = pc.index_in(part.column("request_id"), value_set=self.sorted_ids)
                known = at.is_valid()
                part = part.filter(known)  # rows of no committed request join no token
                rank = at.drop_null().to_numpy()
                part = part.append_column(_RANK, pa.array(rank.astype(np.int32)))
                rng = np.searchsorted(self.cuts, rank, side="right") - 1
                order = np.argsort(rng, kind="stable")
                part, rng = part.take(pa.array(order)), rng[order]
                bounds = np.searchsorted(rng, np.arange(len(self.cuts) + 1))
                for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                    if hi > lo:
                        writers[i].write_table(part.slice(lo, hi - lo))
        finally:
            for w in writers:
                w.close()

    def chunks(self):
        for i in range(len(self.cuts)):
            yield tuple(_sorted(pa.ipc.open_file(self._path(t, i)).read_all()) for t in ("tokens", "reference"))


_RANK = "_rank"  # a range file's extra column: each row's request id's rank in the sorted ids


def _sorted(t: pa.Table) -> pa.Table:
    """`t.sort_by([("request_id", "ascending"), ("position", "ascending")])` without its `_RANK`
    column, sorted by that rank instead of the id: the ids' order is the rank's (both Arrow's
    string order), both sorts are stable (ties keep their order), and position's nulls go last in
    both (NaN in numpy). Integers sort in a fraction of the time strings take."""
    order = np.lexsort((t.column("position").to_numpy(), t.column(_RANK).to_numpy()))
    return t.drop_columns([_RANK]).take(pa.array(order))


def ordered_map(fn, items, workers: int):
    """`fn(*item)` for each item of `items` (an iterator, consumed on the calling thread), on up to
    `workers` threads, yielded in the items' order; at most `workers` items in flight. Closing the
    generator early waits for the calls in flight (their results are dropped)."""
    if workers <= 1:
        for item in items:
            yield fn(*item)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="lpf-analyze") as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, *item))
                if len(pending) >= workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


class Tally:
    """`returned.counts` of a run's tokens parts, from the parts a pass reads (each part counted
    once, whichever pass read it); `counts()` is None until every part has been read."""

    def __init__(self, run: RunDir):
        self.n_parts, self.by_part = len(run.parts("tokens")), {}

    def parts(self, parts):
        for i, part in enumerate(parts):
            self.by_part[i] = returned.counts([part])
            yield part

    def pieces(self, pieces):
        """`parts` over `RunDir.iter_pieces`: a part counted once all its pieces were read."""
        at, sums = None, None
        for i, piece in pieces:
            if i != at and sums is not None:
                self.by_part[at] = sums
            c = returned.counts([piece])
            sums = c if i != at else {k: max(v, c[k]) if k == "top_k" else v + c[k] for k, v in sums.items()}
            at = i
            yield i, piece
        if sums is not None:
            self.by_part[at] = sums

    def counts(self) -> dict | None:
        if len(self.by_part) != self.n_parts:
            return None
        seen = list(self.by_part.values())
        return {
            "rows": sum(c["rows"] for c in seen),
            "no_logprob": sum(c["no_logprob"] for c in seen),
            "top_k": max((c["top_k"] for c in seen), default=0),
        }


def counted(parts, tally: Tally | None):
    return parts if tally is None else tally.parts(parts)
