"""The streamed analyze stage: a run's parts -> the in-memory analysis' summary and findings, in bounded memory.

Contract: `analyze_streamed(run, requests, th, greedy, ...) -> (summary, findings)`, the same as
`lpf.analysis.findings.analyze` over `run.read(...)` of the same run (byte for byte once written:
`tests/test_analyze_stream.py`), holding at most a chunk of ~CHUNK_ROWS tokens of the tokens and
reference tables at once, plus 8 bytes a scored token (|d|, for the calibration; spilled to disk
during the scoring pass) and, while the percentiles are taken, one such column at a time. The pure
steps are `lpf.analysis.stream`; this module reads parts, makes the chunks and spills columns to a
temporary folder in the run directory (`.tmp-analyze-*`, removed afterwards; a killed analysis
leaves it, and the next one removes it).

Chunks follow the whole run's join order (see `lpf.analysis.stream`):
- zip: when the tokens and reference parts line up row for row (as they do when the reference
  was scored in the tokens' order), slices of ~CHUNK_ROWS rows cut at request boundaries, read
  part by part. Checked on the way (the in-memory rule: same keys row for row, every request's
  rows contiguous, every request once); the first mismatch falls back to:
- ranges: requests cut into ranges of ~CHUNK_ROWS tokens in request-id order; one pass over the
  parts buckets every row into its range's Arrow file, each range is then sorted by (request_id,
  position): the order the in-memory join-and-sort gives. Costs a copy of both tables on disk
  (lz4-compressed Arrow files: ~1.7x the parts).
`requests` is the run's requests table with its token-id lists reduced to their lengths and no
output text (`light_requests`): the analysis reads only how long each prompt and output is.
Between the passes, memory the Arrow pool holds free goes back to the system (`release_unused`).
"""

from __future__ import annotations

import queue
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import stream
from lpf.analysis.columns import Lookup
from lpf.analysis.metrics import zipped_starts
from lpf.analysis.stream import StreamedAnalysis
from lpf.analysis.thresholds import Thresholds
from lpf.pipeline.callbacks import OnStart, Tick, no_start, no_tick
from lpf.run import schema
from lpf.run.store import RunDir

CHUNK_ROWS = 1 << 20
_COMPRESSED = pa.ipc.IpcWriteOptions(compression="lz4")  # the range files: half the disk for ~10% more time
TOKEN_COLUMNS = ["request_id", "position", "token_id", "engine_logprob", "engine_topk_ids", "engine_topk_logprobs"]
REFERENCE_COLUMNS = ["request_id", "position", "ref_logprob", "ref_rank", "ref_top1_id",
                     "ref_top1_logprob", "ref_topk_ids", "ref_topk_logprobs"]  # ref_entropy: no analysis reads it
_FIRST_PASS = (["request_id", "position", "engine_logprob"], ["request_id", "position", "ref_logprob"])  # zip: |d| only


def scored_token_count(run: RunDir) -> int:
    """Rows of the tokens parts, from their footers (what chooses the streamed path)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in run.parts("tokens"))


def light_requests(run: RunDir) -> pa.Table:
    """The requests table, part by part, as the analysis reads it: each prompt's and output's token
    ids reduced to their count (a list of nulls, no values) and the output text dropped (null)."""
    out = []
    for part in run.iter_parts("requests", schema.REQUESTS.names):
        for name in ("prompt_token_ids", "output_token_ids"):
            lists = part.column(name).combine_chunks()
            offsets = lists.offsets
            lengths = pa.ListArray.from_arrays(pc.subtract(offsets, offsets[0]), pa.nulls(len(lists.values)),
                                               mask=lists.is_null())
            part = part.set_column(part.schema.get_field_index(name), pa.field(name, lengths.type), lengths)
        part = part.set_column(part.schema.get_field_index("output_text"), "output_text",
                               pa.nulls(part.num_rows, pa.string()))
        out.append(part)
    return pa.concat_tables(out) if out else schema.REQUESTS.empty_table()


class _Rows:
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


def _ahead(parts, depth: int = 1):
    """`parts` (an iterator of tables) read in a background thread, `depth` parts ahead of the
    consumer: Parquet decoding releases the GIL, so reading the next part overlaps analysing the
    chunk before it. Memory: `depth` parts more. An error reading a part is raised here, in order."""
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
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # let it see the stop: drain what it may be putting
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass


def _zip_sizes(run: RunDir, chunk_pass, keys_only: bool = False):
    """First pass over the parts as they lie, in request-aligned chunks of ~CHUNK_ROWS rows:
    `chunk_pass(tokens, reference)` per chunk (`keys_only`: request_id and position alone); the
    chunk sizes, or None at the first chunk whose sides do not line up (the in-memory analysis
    would join and sort)."""
    want = [c[:2] for c in _FIRST_PASS] if keys_only else _FIRST_PASS
    tok = _Rows(_ahead(run.iter_parts("tokens", want[0])))
    ref = _Rows(_ahead(run.iter_parts("reference", want[1])))
    sizes = []
    while True:
        n = tok.request_cut(CHUNK_ROWS)
        if n == 0:
            return sizes if ref.left(0) == 0 else None
        t, r = tok.take(n), ref.take(n)
        if r is None or zipped_starts(t, r) is None:
            return None
        chunk_pass(t, r)
        sizes.append(n)


def _zip_chunks(run: RunDir, sizes: list[int]):
    """The chunks of `_zip_sizes` again, with every column the analysis reads."""
    tok = _Rows(_ahead(run.iter_parts("tokens", TOKEN_COLUMNS)))
    ref = _Rows(_ahead(run.iter_parts("reference", REFERENCE_COLUMNS)))
    for n in sizes:
        yield tok.take(n), ref.take(n)


class _Ranges:
    """Requests in request-id ranges of ~CHUNK_ROWS tokens, bucketed to Arrow files and sorted."""

    def __init__(self, run: RunDir, requests: pa.Table, spill: Path):
        self.spill = spill
        ids = requests.column("request_id").combine_chunks()
        order = pc.sort_indices(ids).to_numpy()
        self.sorted_ids = ids.take(pa.array(order))
        n_out = pc.list_value_length(requests.column("output_token_ids")).fill_null(0).to_numpy(zero_copy_only=False)
        total = np.cumsum(n_out[order])
        self.cuts = np.r_[0, np.flatnonzero(np.diff(total // CHUNK_ROWS)) + 1] if total.size else np.zeros(1, np.int64)
        for table, columns in (("tokens", TOKEN_COLUMNS), ("reference", REFERENCE_COLUMNS)):
            self._bucket(run, table, columns)

    def _path(self, table: str, i: int) -> Path:
        return self.spill / f"{table}-{i:05d}.arrow"

    def _bucket(self, run: RunDir, table: str, columns: list[str]) -> None:
        want = pa.schema([schema.TABLES[table].field(c) for c in columns])
        writers = [pa.ipc.new_file(self._path(table, i), want, options=_COMPRESSED) for i in range(len(self.cuts))]
        try:
            for part in run.iter_parts(table, columns):
                at = pc.index_in(part.column("request_id"), value_set=self.sorted_ids)
                known = at.is_valid()
                part = part.filter(known)  # rows of no committed request join no token
                rng = np.searchsorted(self.cuts, at.drop_null().to_numpy(), side="right") - 1
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


def _sorted(t: pa.Table) -> pa.Table:
    return t.sort_by([("request_id", "ascending"), ("position", "ascending")])


class _Spill:
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


def analyze_streamed(run: RunDir, requests: pa.Table, th: Thresholds, greedy: bool, *,
                     trace: pa.Table | None = None, engine_info: dict | None = None, temperature: float = 0.0,
                     floor_table: dict | None = None, run_info: dict | None = None,
                     progress: tuple[OnStart, Tick] = (no_start, no_tick)) -> tuple[pa.Table, dict]:
    """`findings.analyze(requests, tokens, reference, th, greedy, ...)` over the run's parts, streamed
    (no calibration run: the caller routes those to the in-memory path). `progress`: (on_start,
    tick) over twice the tokens parts' rows (the two passes)."""
    for old in run.path.glob(".tmp-analyze-*"):
        shutil.rmtree(old, ignore_errors=True)  # a killed analysis' leftovers
    spill = Path(tempfile.mkdtemp(prefix=".tmp-analyze-", dir=run.path))
    try:
        return _analyze(run, requests, th, greedy, spill, trace=trace, engine_info=engine_info, temperature=temperature,
                        floor_table=floor_table, run_info=run_info or {}, progress=progress)
    finally:
        shutil.rmtree(spill, ignore_errors=True)


def _analyze(run, requests, th, greedy, spill, *, trace, engine_info, temperature, floor_table, run_info, progress):
    from lpf.analysis.floors import expected_floor

    # the expected floor needs nothing of the tokens: with one, the thresholds are known before any
    expected = expected_floor(floor_table, run_info.get("engine_dtype"), run_info.get("reference_dtype"),
                              run_info.get("model"), None) if floor_table is not None else None
    kw = dict(trace=trace, engine_info=engine_info, temperature=temperature, expected=expected,
              sampling=run_info.get("sampling"), reference_columns=REFERENCE_COLUMNS)
    if expected:
        done = _one_pass(run, requests, th, greedy, spill, kw, progress)
        if done is not None:
            return done
        for old in spill.iterdir():  # a check failed part way: nothing of it is kept
            old.unlink()
    return _two_passes(run, requests, th, greedy, spill, kw, progress)


def _one_pass(run, requests, th, greedy, spill, kw, progress):
    """With an expected floor (thresholds known) and parts that line up, the analysis in one pass
    over the parts: the counts that place every token in arrival order for the run-level test are
    the requests' output lengths, checked chunk by chunk against the rows scored (and, at the end,
    every request with an output seen once). None when a check fails: the caller starts over."""
    n_out = pc.list_value_length(requests.column("output_token_ids")).fill_null(0).to_numpy(zero_copy_only=False)
    has = n_out > 0
    ids, counts = requests.column("request_id").filter(pa.array(has)).combine_chunks(), n_out[has].astype(np.int64)
    declared = Lookup(ids)
    th, calib = stream.thresholds(None, None, th, kw["expected"])
    acc = StreamedAnalysis(requests, th, calib, greedy, ids, counts, **kw)
    progress[0](scored_token_count(run), 0)
    cols = _Spill(spill)
    tok = _Rows(_ahead(run.iter_parts("tokens", TOKEN_COLUMNS)))
    ref = _Rows(_ahead(run.iter_parts("reference", REFERENCE_COLUMNS)))
    seen, heads = 0, []
    while True:
        n = tok.request_cut(CHUNK_ROWS)
        if n == 0:
            if ref.left(0):
                return None  # reference rows no token has: the in-memory analysis would join
            break
        t, r = tok.take(n), ref.take(n)
        if r is None or r.num_rows != n:
            return None
        cols.add(acc.score(t, r))
        at = declared.index(acc.heads)
        if not acc.zipped or (at < 0).any() or not np.array_equal(counts[at], acc.counts):
            return None  # the sides do not line up, or a request's rows are not its output
        heads.append(acc.heads)
        seen += n
        progress[1](n)
    heads = pa.concat_arrays(heads) if heads else pa.array([], pa.string())
    if seen != acc.n or len(heads) != len(ids) or len(pc.unique(heads)) != len(heads):
        return None  # a request in two places, or one with an output never scored
    t = r = tok = ref = None
    pa.default_memory_pool().release_unused()
    return acc.finish(cols.rows)


def _two_passes(run, requests, th, greedy, spill, kw, progress):
    """The first pass finds the request starts (and |d| for the run's own calibration when there
    is no expected floor), the second scores; chunks by zip or, when parts do not line up, by
    request range."""
    expected = kw["expected"]
    # |d| (only without an expected floor: the run's own calibration) goes to disk chunk by chunk and
    # comes back as one array: chunks kept in memory would leave the heap holding their pages
    cols = _Spill(spill)
    starts, ids, at = [], [], [0]
    total, tick = 2 * scored_token_count(run), progress[1]
    progress[0](total, 0)

    def first_pass(tok, ref):
        if expected:
            n, s, i = stream.chunk_starts(tok, ref)
        else:
            ad, s, i = stream.chunk_abs_diff(tok, ref)
            cols.add({"abs_logprob_diff": ad})
            n = ad.size
        starts.append(s + at[0]), ids.append(i)
        at[0] += n
        tick(tok.num_rows)

    sizes = _zip_sizes(run, first_pass, keys_only=bool(expected))
    heads = pa.concat_arrays(ids) if ids else pa.array([], pa.string())
    if sizes is not None and len(pc.unique(heads)) != len(heads):
        sizes = None  # a request in two places: the in-memory analysis joins and sorts
    ranges = None
    if sizes is None:
        cols.drop("abs_logprob_diff")
        progress[0](total, 0)  # the zip pass stopped part way: the first pass starts again
        starts.clear(), ids.clear()
        at[0] = 0
        ranges = _Ranges(run, requests, spill)
        for chunk in ranges.chunks():
            first_pass(*chunk)
        heads = pa.concat_arrays(ids) if ids else pa.array([], pa.string())
    pa.default_memory_pool().release_unused()
    n_scored = at[0]
    starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    counts = np.diff(np.r_[starts, n_scored]).astype(np.int64)
    expected = expected if n_scored else None
    if expected:
        th, calib = stream.thresholds(None, starts, th, expected)
    else:
        ad = cols.read("abs_logprob_diff")
        th, calib = stream.thresholds(ad, starts, th, None)
        del ad
        cols.drop("abs_logprob_diff")
    acc = StreamedAnalysis(requests, th, calib, greedy, heads, counts, **{**kw, "expected": expected})
    second = ranges.chunks() if ranges is not None else _zip_chunks(run, sizes)
    for tok, ref in second:
        cols.add(acc.score(tok, ref))
        tick(tok.num_rows)
    tok = ref = second = None  # the last chunk
    pa.default_memory_pool().release_unused()
    return acc.finish(cols.rows)


def reference_sums(run: RunDir, ids: set[str]) -> dict[str, float]:
    """{request id: sum of its ref_logprob} for `ids`, part by part (the attribution's own scores)."""
    parts = [_of(p, ids) for p in run.iter_parts("reference", ["request_id", "ref_logprob"])]
    return _sums(pa.concat_tables(parts) if parts else schema.REFERENCE.empty_table().select(["request_id", "ref_logprob"]))


def own_sums(reference: pa.Table, ids: set[str]) -> dict[str, float]:
    """`reference_sums` from an in-memory reference table (the same filter, then the same sums)."""
    return _sums(_of(reference, ids))


def _of(table: pa.Table, ids: set[str]) -> pa.Table:
    return table.filter(pc.is_in(table.column("request_id"), value_set=pa.array(sorted(ids), pa.string())))


def _sums(reference: pa.Table) -> dict[str, float]:
    sums = reference.group_by("request_id").aggregate([("ref_logprob", "sum")]).to_pydict()
    return dict(zip(sums["request_id"], sums["ref_logprob_sum"]))
