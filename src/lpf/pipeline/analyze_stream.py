"""The streamed analyze stage: a run's parts -> the in-memory analysis' summary and findings, in bounded memory.

Contract: `analyze_streamed(run, requests, th, greedy, ...) -> (summary, findings)`, the same as
`lpf.analysis.findings.analyze` over `run.read(...)` of the same run (byte for byte once written:
`tests/test_analyze_stream.py`), holding at most ~CHUNK_ROWS tokens of the tokens and reference
tables at once in chunks (`stream_parts.chunk_rows()` each, one per thread scoring them) and the
next part being read ahead, plus the logprob columns (16 bytes a scored token, read back a piece at
a time for the metric summary: kept in memory by the one pass up to `stream_memory.KEEP_TOKENS`,
else spilled) and, without an expected floor, |d| (read back whole for the run's own calibration),
spilled to a temporary folder in the run directory (`.tmp-analyze-*`, removed afterwards; a killed
analysis leaves it, and the next one removes it), and the rows the steps after scoring gathered
(`stream_memory.Pieces`: in memory up to KEEP_ROWS a step, else in that folder). The pure steps are
`lpf.analysis.stream`;
reading parts and chunks is `lpf.pipeline.stream_parts`, keeping columns `lpf.pipeline.stream_memory`
(whose `heap()` regime, jemalloc for Arrow and no cyclic GC, the stage runs under).

One pass when it can: with an expected floor the thresholds need no token, and when the parts line
up row for row the run-level test's arrival order comes from the requests' output lengths, checked
chunk by chunk against the rows scored; any check that fails starts over with two passes (the
first finds the request starts, and |d| when the run calibrates on itself; the second scores).
The one pass reads row groups with each row's request as an integer (`stream_parts.CodedRows`):
its checks and cuts compare integers, never a request id string per row.
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
output text (`lpf.pipeline.run_reads.light_requests`; what else the stage reads outside the pass is
there too): the analysis reads only how long each prompt and output is.
Between the passes, memory the Arrow pool holds free goes back to the system (`release_unused`).
"""

from __future__ import annotations

import shutil
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import stream
from lpf.analysis.columns import Codes
from lpf.analysis.stream import StreamedAnalysis
from lpf.analysis.thresholds import Thresholds
from lpf.pipeline import stream_memory, stream_parts
from lpf.pipeline.stream_memory import Kept, Pieces, Spill
from lpf.pipeline.callbacks import OnStart, Tick, no_start, no_tick
from lpf.pipeline.stream_parts import (
    REFERENCE_COLUMNS,
    TOKEN_COLUMNS,
    CodedRows,
    Ranges,
    Tally,
    ordered_map,
    read_ahead,
    zip_chunks,
    zip_sizes,
)
from lpf.pipeline.run_reads import (
    chunk_budget,
    light_requests,
    lse_complete,
    prompt_tables,
    scored_token_count,
    token_ids,
)
from lpf.run.store import RunDir


def analyze_streamed(
    run: RunDir,
    requests: pa.Table | None,
    th: Thresholds,
    greedy: bool,
    *,
    trace: pa.Table | None = None,
    engine_info: dict | None = None,
    temperature: float = 0.0,
    floor_table: dict | None = None,
    run_info: dict | None = None,
    progress: tuple[OnStart, Tick] = (no_start, no_tick),
    tally: Tally | None = None,
    on_summary=None,
    ran=None,
) -> tuple[pa.Table, dict]:
    """`findings.analyze(requests, tokens, reference, th, greedy, ...)` over the run's parts, streamed
    (no calibration run: the caller routes those to the in-memory path). `requests`: `light_requests`
    of the run, or None to read it here (beside the first parts, when one pass will do). `progress`: (on_start,
    tick) over twice the tokens parts' rows (the two passes). Chunks are scored on
    `stream_parts.WORKERS` threads (the findings are the same for any number). `tally`: counts
    the tokens parts as the passes read them (`Tally.counts()`). `on_summary(summary)`: called
    once the summary is final, before the findings are concluded (the caller may start writing it).
    `ran`: a `steps.Ran` the analysis records its steps on."""
    for old in run.path.glob(".tmp-analyze-*"):
        shutil.rmtree(old, ignore_errors=True)  # a killed analysis' leftovers
    spill = Path(tempfile.mkdtemp(prefix=".tmp-analyze-", dir=run.path))
    try:
        with stream_memory.heap():
            return _analyze(
                run,
                requests,
                th,
                greedy,
                spill,
                trace=trace,
                engine_info=engine_info,
                temperature=temperature,
                floor_table=floor_table,
                run_info=run_info or {},
                progress=progress,
                workers=stream_parts.WORKERS,
                tally=tally,
                on_summary=on_summary,
                ran=ran,
            )
    finally:
        shutil.rmtree(spill, ignore_errors=True)


def _analyze(
    run,
    requests,
    th,
    greedy,
    spill,
    *,
    trace,
    engine_info,
    temperature,
    floor_table,
    run_info,
    progress,
    workers,
    tally,
    on_summary,
    ran,
):
    from lpf.analysis.floors import infers_dtype, run_floor

    # the expected floor needs nothing of the tokens: with one, the thresholds are known before any
    # an engine dtype the table lacks (unknown, `auto`): the floor is the pair its errors fit (`floors.infer_pair`),
    # as in memory: a first pass reads them
    infer = floor_table is not None and infers_dtype(floor_table, run_info)
    expected = run_floor(floor_table, run_info) if floor_table is not None and not infer else None
    kw = dict(
        trace=trace,
        engine_info=engine_info,
        temperature=temperature,
        expected=expected,
        sampling=run_info.get("sampling"),
        reference_columns=REFERENCE_COLUMNS,
        lse_complete=lse_complete(run),
        token_ids=partial(token_ids, run),
        ran=ran,
        prompt=prompt_tables(run),
        chunk_budget=chunk_budget(run.manifest),
    )
    how = {"workers": workers, "tally": tally, "on_summary": on_summary}
    how["infer"] = (floor_table, run_info) if infer else None
    if expected:  # the one pass's readers start first: the requests are read beside their first parts
        pieces = tally.pieces if tally is not None else iter
        how["readers"] = (
            read_ahead(pieces(run.iter_pieces("tokens", TOKEN_COLUMNS))),
            read_ahead(run.iter_pieces("reference", REFERENCE_COLUMNS)),
        )
    if requests is None:
        requests = light_requests(run)
    if expected:
        done = _one_pass(run, requests, th, greedy, spill, kw, progress, how)
        if done is not None:
            return done
        for old in spill.iterdir():  # a check failed part way: nothing of it is kept
            old.unlink()
    return _two_passes(run, requests, th, greedy, spill, kw, progress, how)


def _one_pass(run, requests, th, greedy, spill, kw, progress, how):
    """With an expected floor (thresholds known) and parts that line up, the analysis in one pass
    over the parts: the counts that place every token in arrival order for the run-level test are
    the requests' output lengths, checked chunk by chunk against the rows scored (and, at the end,
    every request with an output seen once). None when a check fails: the caller starts over.
    The parts are read a row group at a time with each row's request as an integer (`CodedRows`:
    no request id string per row is built or compared); chunks are scored on `how["workers"]`
    threads, checked and kept in order; the logprob columns stay in memory up to KEEP_TOKENS."""
    tokens, reference = how.pop("readers")  # started by the caller: the first parts read meanwhile
    n_out = pc.list_value_length(requests.column("output_token_ids")).fill_null(0).to_numpy(zero_copy_only=False)
    has = n_out > 0
    ids, counts = requests.column("request_id").filter(pa.array(has)).combine_chunks(), n_out[has].astype(np.int64)
    if len(pc.unique(ids)) != len(ids):
        tokens.close(), reference.close()
        return None  # a request id twice: the in-memory analysis joins and sorts
    th, calib = stream.thresholds(None, None, th, kw["expected"])
    acc = StreamedAnalysis(
        requests, th, calib, greedy, ids, counts, rows=np.flatnonzero(has), store=Pieces(spill), **kw
    )
    progress[0](scored_token_count(run), 0)
    cols = Kept() if acc.n <= stream_memory.KEEP_TOKENS else Spill(spill)
    tok, ref = CodedRows(tokens, Codes(ids)), CodedRows(reference, Codes(ids))
    broken = []

    def chunks():
        while True:
            n = tok.request_cut(stream_parts.chunk_rows())
            if n == 0:
                if ref.left(0):
                    broken.append("reference rows no token has")  # the in-memory analysis would join
                return
            (t, tc), r = tok.take(n), ref.take(n)
            if r is None or r[0].num_rows != n:
                broken.append("the sides' rows differ")
                return
            yield t, r[0], (tc, r[1])

    seen, once = 0, np.zeros(len(ids), bool)
    scored = ordered_map(acc.score_chunk, chunks(), how["workers"])
    try:
        for chunk in scored:
            if not chunk["zipped"]:
                return None  # the sides do not line up
            at = chunk["at"]
            if once[at].any() or not np.array_equal(counts[at], chunk["counts"]):
                return None  # a request in two places, or a request's rows are not its output
            once[at] = True
            cols.add(acc.add(chunk))
            seen += chunk["rows"]
            progress[1](chunk["rows"])
    finally:
        scored.close()  # a check failed: the chunks in flight finish, their results dropped
    if broken or seen != acc.n or not once.all():
        return None  # a request with an output never scored
    tok = ref = None
    pa.default_memory_pool().release_unused()
    return acc.finish(cols.rows, how["on_summary"])


def _two_passes(run, requests, th, greedy, spill, kw, progress, how):
    """The first pass finds the request starts (and |d| for the run's own calibration when there
    is no expected floor), the second scores; chunks by zip or, when parts do not line up, by
    request range."""
    expected = kw["expected"]
    # |d| (only without an expected floor: the run's own calibration) goes to disk chunk by chunk and
    # comes back as one array: chunks kept in memory would leave the heap holding their pages
    cols = Spill(spill)
    starts, ids, at = [], [], [0]
    total, tick = 2 * scored_token_count(run), progress[1]
    progress[0](total, 0)

    def first_pass(tok, ref):
        if expected:
            n, s, i = stream.chunk_starts(tok, ref)
        elif how["infer"]:
            ad, s, i, lp = stream.chunk_abs_diff(tok, ref, with_ref=True)
            cols.add({"abs_logprob_diff": ad, "ref_logprob": lp})
            n = ad.size
        else:
            ad, s, i = stream.chunk_abs_diff(tok, ref)
            cols.add({"abs_logprob_diff": ad})
            n = ad.size
        starts.append(s + at[0]), ids.append(i)
        at[0] += n
        tick(tok.num_rows)

    sizes = zip_sizes(run, first_pass, keys_only=bool(expected))
    heads = pa.concat_arrays(ids) if ids else pa.array([], pa.string())
    if sizes is not None and len(pc.unique(heads)) != len(heads):
        sizes = None  # a request in two places: the in-memory analysis joins and sorts
    ranges = None
    if sizes is None:
        cols.drop("abs_logprob_diff"), cols.drop("ref_logprob")
        progress[0](total, 0)  # the zip pass stopped part way: the first pass starts again
        starts.clear(), ids.clear()
        at[0] = 0
        ranges = Ranges(run, requests, spill, how["tally"])
        for chunk in ranges.chunks():
            first_pass(*chunk)
        heads = pa.concat_arrays(ids) if ids else pa.array([], pa.string())
    pa.default_memory_pool().release_unused()
    n_scored = at[0]
    starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    counts = np.diff(np.r_[starts, n_scored]).astype(np.int64)
    if how["infer"] and n_scored:
        from lpf.analysis.floors import observed_logit_error, run_floor

        table, info = how["infer"]
        observed = observed_logit_error(cols.read("abs_logprob_diff"), cols.read("ref_logprob"))
        cols.drop("ref_logprob")
        expected = run_floor(table, info, observed=observed)
    expected = expected if n_scored else None
    if expected:
        th, calib = stream.thresholds(None, starts, th, expected)
        cols.drop("abs_logprob_diff")
    else:
        ad = cols.read("abs_logprob_diff")
        th, calib = stream.thresholds(ad, starts, th, None)
        del ad
        cols.drop("abs_logprob_diff")
    acc = StreamedAnalysis(
        requests, th, calib, greedy, heads, counts, store=Pieces(spill), **{**kw, "expected": expected}
    )
    second = ranges.chunks() if ranges is not None else zip_chunks(run, sizes, how["tally"])
    scored = ordered_map(acc.score_chunk, second, how["workers"])
    for chunk in scored:
        cols.add(acc.add(chunk))
        tick(chunk["rows"])
    chunk = second = scored = None  # the last chunk
    pa.default_memory_pool().release_unused()
    return acc.finish(cols.rows, how["on_summary"])
