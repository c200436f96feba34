"""Streamed analysis: `findings.analyze` chunk by chunk, with the same findings byte for byte.

Contract (pure: Arrow tables and numpy arrays in, plain data out; no I/O. The driver that reads a
run's parts and spills columns is `lpf.pipeline.analyze_stream`):

A *chunk* is the tokens and reference rows of whole requests (a request never straddles two), and
the chunks come in the whole run's join order: `metrics.join_grouped` of each chunk gives its rows
in the order `join_grouped` of the whole run gives them, so the concatenation of the chunks' rows
is the in-memory analysis' token order. (The driver makes chunks either by slicing parts that line
up row for row, the in-memory zip case, or by request-id ranges sorted by (request_id, position),
the in-memory join-and-sort case.)

1. Without an expected floor, a first pass: `chunk_abs_diff(tokens, reference)` -> (|d|, request
   starts, ids at the starts) per chunk; the driver spills |d| and reads it back as one float64
   column for `thresholds(ad, starts, th, None)`, the in-memory calibration. With one, the
   thresholds need no token (`thresholds(None, ...)`), and the first pass, when there is one, only
   finds the request starts (`chunk_starts`).
2. `StreamedAnalysis(requests, th, calib, greedy, ids, counts, ...)` (`ids`/`counts`: each scored
   request and its scored-token count, which place every token in arrival order for the run-level
   test), then `.score(tokens, reference)` per chunk (the same order): `scoring.score_requests`
   (per-request reductions, greedy flips, top-1 agreement), the crossed-wires candidates (tokens that
   missed the reference's top-1, when there is a trace), the rows the steps after scoring read
   (`stream_gather`: the decision test's, the penalty fit's, the departing tokens the logprob
   temperature and the tempered signature read; into `store`, the driver's), and the run-level test's tokens (every k-th in arrival order: exactly the tokens the in-memory
   test reads). It returns the chunk's `SPILLED` logprob columns for the driver to keep, and leaves
   `zipped`, `heads`, `counts` and `at` (each head's index among `ids`) of the chunk for a one-pass
   driver to check. `.score` is `.add(.score_chunk(...))`: `score_chunk` reads the accumulator's
   settings only, so a driver may score several chunks on threads at once and `add` the results
   in token order (the same findings: `add` only appends and sums integers). `.finish(read)`
   summarizes the metric columns from those spilled columns a leaf at a time (`read(name, rows)`,
   `scoring.metric_summary`: numpy's own means, exact percentiles) and returns (summary, findings).

Run-wide inputs and what is kept of them: the calibration reads the |d| column (from disk); the
metric summary the spilled logprob columns, a piece at a time; counts are integers (exact in any
order); per-request reductions are request-local (one row per request); the failure shape,
hypotheses and evidence read the per-request summary and requests table; the run-level test at most
`run_test.MAX_TOKENS` tokens. Means are numpy's pairwise sums over the whole column in token order,
as in memory (`column_stats`), so they are the same floating-point sums.
The steps are `lpf.analysis.steps.STEPS`, run in that order and recorded on `ran`; those after the
run-level test through `conclusion.conclude_run`, as in memory. Not streamed: a calibration run
(`calibrate_from_run` joins it with the whole reference): `lpf.pipeline.analyze` routes such runs to
the in-memory path and refuses `--stream` on them. Read whole: the trace, and the prompt positions'
tables (`prompt()`, when the run has them: `with_prompt` after the output positions).
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import answer_checks, request_sampling
from lpf.analysis import metrics as m
from lpf.analysis.calibration import calibrate, calibrate_to_floor
from lpf.analysis.evidence import apply_inconsistency
from lpf.analysis.columns import Lookup, one_array, same_rows
from lpf.analysis.conclusion import Run, conclude_run
from lpf.analysis.findings import with_prompt
from lpf.analysis import run_test as run_level
from lpf.analysis import stream_evidence
from lpf.analysis.localized import raise_localized
from lpf.analysis.run_test import run_test, token_evidence
from lpf.analysis.steps import Ran, record
from lpf.analysis.stream_gather import Gatherer, Gathered
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.token_evidence import evidence_columns
from lpf.analysis.scoring import metric_summary, score_requests
from lpf.analysis.verdicts import by_arrival, segment_starts, summarize_requests

SPILLED = ("engine_logprob", "ref_logprob")  # what the driver keeps on disk for the metric summary
_EVIDENCE_JOINED = [
    "request_id",
    "position",
    "token_id",
    "engine_logprob",
    "ref_logprob",
    "ref_top1_id",
    "ref_top1_logprob",
]  # what `evidence_columns` reads of the joined rows
_EVIDENCE_TOKENS = ["request_id", "position", "engine_topk_ids", "engine_topk_logprobs"]
_EVIDENCE_REFERENCE = ["request_id", "position", "ref_topk_ids", "ref_topk_logprobs"]


def chunk_abs_diff(tokens: pa.Table, reference: pa.Table, with_ref: bool = False):
    """(|engine - reference| per joined row, request starts, request ids at the starts) of a chunk, and
    with `with_ref` the joined rows' ref_logprob after them (what the floor's dtype inference reads).
    A chunk that lines up row for row needs only request_id, position and the two logprobs."""
    starts = m.zipped_starts(tokens, reference)
    if starts is None:
        tokens, starts = m.join_grouped(tokens, reference)
        reference = tokens
    ref = reference.column("ref_logprob").to_numpy()
    with np.errstate(invalid="ignore"):
        ad = np.subtract(tokens.column("engine_logprob").to_numpy(), ref)
        np.abs(ad, out=ad)
    return (ad, starts, _ids_at(tokens, starts)) + ((ref,) if with_ref else ())


def chunk_starts(tokens: pa.Table, reference: pa.Table) -> tuple[int, np.ndarray, pa.Array]:
    """(joined rows, request starts, request ids at the starts) of a chunk: `chunk_abs_diff`
    without the logprobs (what the first pass needs when the thresholds come from an expected floor)."""
    starts = m.zipped_starts(tokens, reference)
    if starts is None:
        keys = ["request_id", "position"]
        tokens = (
            tokens.select(keys)
            .join(reference.select(keys), keys=keys, join_type="inner")
            .sort_by([("request_id", "ascending"), ("position", "ascending")])
        )
        starts = segment_starts(tokens.column("request_id"))
    return tokens.num_rows, starts, _ids_at(tokens, starts)


def thresholds(ad: np.ndarray, starts: np.ndarray, th: Thresholds, expected: dict | None):
    """(thresholds, the findings' calibration entry): `findings.analyze`'s rule without a calibration run."""
    return calibrate_to_floor(th, expected) if expected else calibrate(ad, starts, th)


def _ids_at(joined: pa.Table, starts: np.ndarray) -> pa.Array:
    return (
        joined.column("request_id").take(pa.array(starts)).combine_chunks()
        if joined.num_rows
        else pa.array([], pa.string())
    )


class StreamedAnalysis:
    """The second pass's accumulator. `ids`/`counts`: the first pass's request ids at the run-wide
    starts and their scored-token counts (in token order), which place every token in arrival
    order for the run-level test."""

    def __init__(
        self,
        requests: pa.Table,
        th: Thresholds,
        calib: dict,
        greedy: bool,
        ids: pa.Array,
        counts: np.ndarray,
        *,
        trace: pa.Table | None = None,
        engine_info: dict | None = None,
        temperature: float = 0.0,
        expected: dict | None = None,
        sampling: dict | None = None,
        reference_columns=(),
        rows: np.ndarray | None = None,
        store=None,
        lse_complete: bool = False,
        token_ids=None,
        ran: Ran | None = None,
        prompt=None,
        chunk_budget: int | None = None,
    ):
        sampling = sampling or {"temperature": temperature}
        own = request_sampling.settings(requests, temperature)
        if own is not None and own.uniform is not None and own.uniform == own.uniform:  # every request alike
            temperature = own.uniform
            greedy, sampling = temperature == 0, {**sampling, "temperature": temperature}
        elif own is not None:  # `lpf.pipeline.analyze` reads such a run in memory
            raise ValueError("the streamed analysis does not judge requests of mixed sampling settings")
        self.requests, self.th, self.calib, self.greedy = requests, th, calib, greedy
        self.trace, self.engine_info, self.temperature = trace, engine_info, temperature
        self.expected, self.sampling = expected, sampling
        self.n = int(counts.sum())
        self.step = -(-self.n // run_level.MAX_TOKENS)  # as run_test.run_level_test samples a huge run
        self.declared = one_array(ids)
        offsets = _arrival_offsets(requests, ids, counts, rows) if expected and self.n else None
        self.arrival = (
            (_Lazy(lambda: Lookup(ids)), offsets[0]) if offsets is not None else None
        )  # request ids (looked up only for chunks that come without codes), the arrival index of
        # each one's first scored token
        self.by_index = offsets is not None and offsets[1]  # arrival order is the arrival index's
        self.reference_columns = tuple(reference_columns)
        self.gatherer = Gatherer(
            requests, trace, self.sampling, greedy, th, reference_columns, self.n, lse_complete
        )  # the rows the steps after scoring read (`stream_gather`)
        self.store, self.gathered_counts = store if store is not None else Listed(), {}
        self.token_ids, self.ran = token_ids, ran
        self.prompt, self.chunk_budget = prompt, chunk_budget  # prompt(): (prompt_tokens, prompt_reference)
        self.zipped, self.heads, self.counts, self.at = False, None, None, None  # of the last chunk added
        self.ids, self.per, self.flips, self.same = [], [], 0, 0
        self.missed, self.evidence, self.answers = [], [], answer_checks.Found()

    def score(self, tokens: pa.Table, reference: pa.Table) -> dict[str, np.ndarray]:
        """Score one chunk; returns its `SPILLED` columns (in token order) for the driver to keep."""
        return self.add(self.score_chunk(tokens, reference))

    def score_chunk(self, tokens: pa.Table, reference: pa.Table, codes=None) -> dict:
        """What one chunk adds, computed without touching the accumulator (so chunks may be scored
        on several threads at once); `add` takes these in token order. `codes`: (tokens', reference's)
        rows' requests as indices among `ids` (`columns.Codes`), the request_id columns dropped: the
        chunk must then line up row for row (`metrics.join_coded`), else only {"rows", "zipped":
        False} comes back."""
        if codes is None:
            joined, starts = m.join_grouped(tokens, reference)
            heads = _ids_at(joined, starts)
            zipped = same_rows(tokens.column("token_id"), joined.column("token_id")) and same_rows(
                reference.column("ref_logprob"), joined.column("ref_logprob")
            )
            # each head's place among the run's scored requests (what a one-pass driver checks, too)
            at = self.arrival[0].get().index(heads) if self.arrival is not None else None
        else:
            lined = m.join_coded(tokens, reference, codes, self.declared)
            if lined is None:
                return {"rows": tokens.num_rows, "zipped": False}
            joined, starts = lined
            at = codes[0][starts].astype(np.int64)
            heads, zipped = self.declared.take(pa.array(at)), True
            joined = joined if self.trace is None else _decoded(joined)
            # the same rows: the joined ids stand for both sides' (what the steps below select by name)
            tokens = tokens.add_column(0, "request_id", joined.column("request_id"))
            reference = reference.add_column(0, "request_id", joined.column("request_id"))
        cols = m.input_arrays(joined)
        cols["position"] = joined.column("position").to_numpy()
        per, flips, same = score_requests(cols, starts, self.greedy, self.th, self.temperature)
        out = {"rows": tokens.num_rows, "ids": heads, "per": per, "flips": flips, "same": same}
        out["answers"] = answer_checks.scan(
            tokens, joined.column("request_id"), cols["position"], cols["engine_logprob"], cols["ref_logprob"],
            self.expected, self.th.divergent_abs_diff,
        )  # fmt: skip
        out["missed"] = None
        if self.trace is not None and self.trace.num_rows:
            miss = pc.not_equal(joined.column("token_id"), joined.column("ref_top1_id"))
            out["missed"] = joined.filter(miss).select(["request_id", "position", "token_id", "ref_top1_id"])
        out["gathered"] = self.gatherer.chunk(joined, starts, heads, tokens, reference, zipped)
        out["zipped"] = zipped
        out["heads"], out["counts"] = heads, np.diff(np.r_[starts, joined.num_rows])
        out["at"] = at if self.arrival is not None or codes is not None else None
        out["evidence"] = None
        if self.arrival is not None and codes is not None and self.by_index:
            rows, index = stream_evidence.kept_rows(starts, joined.num_rows, self.arrival[1][at], self.step)
            out["evidence"] = stream_evidence.take(joined, tokens, reference, rows, index, codes[0])
        elif self.arrival is not None:
            out["evidence"] = self._evidence(joined, starts, out["at"], tokens, reference, out["zipped"])
        out["spilled"] = {name: cols[name] for name in SPILLED}
        return out

    def add(self, chunk: dict) -> dict[str, np.ndarray]:
        """Take one `score_chunk` result (chunks in token order); returns its `SPILLED` columns."""
        self.ids.append(chunk["ids"])
        self.per.append(chunk["per"])
        self.flips += chunk["flips"]
        self.same += chunk["same"]
        self.answers = self.answers.merge(chunk["answers"])
        if chunk["missed"] is not None:
            self.missed.append(chunk["missed"])
        tables, counts = chunk["gathered"]
        for name, table in tables.items():
            self.store.add(name, table)
        for name, n in counts.items():
            self.gathered_counts[name] = self.gathered_counts.get(name, 0) + n
        if chunk["evidence"] is not None:
            self.evidence.append(chunk["evidence"])
        self.zipped, self.heads, self.counts, self.at = chunk["zipped"], chunk["heads"], chunk["counts"], chunk["at"]
        return chunk["spilled"]

    def _evidence(self, joined, starts, at, tokens, reference, zipped):
        """The rows the run-level test reads: arrival index (request offset + rank in request) % step == 0."""
        counts = np.diff(np.r_[starts, joined.num_rows])
        first = np.where(at >= 0, self.arrival[1][at], 0)
        index = np.repeat(first - starts, counts) + np.arange(joined.num_rows)
        keep = pa.array(index % self.step == 0)
        keys = joined.select(_EVIDENCE_JOINED).filter(keep)
        if pa.types.is_dictionary(keys.schema.field("request_id").type):  # a coded chunk's: as strings
            keys = _decoded(keys)
        have = [c for c in _EVIDENCE_TOKENS if c in tokens.column_names]
        if zipped:  # the chunk's rows are the joined rows: no join to find them, and the keys are keys'
            return (
                keys,
                _with_keys(keys, tokens.select(have[2:]), keep),
                _with_keys(keys, reference.select(_EVIDENCE_REFERENCE[2:]), keep),
            )
        return keys, _rows_for(tokens.select(have), keys), _rows_for(reference.select(_EVIDENCE_REFERENCE), keys)

    def finish(self, read, on_summary=None) -> tuple[pa.Table, dict]:
        """(summary, findings) as `findings.analyze` gives them. `read(name, rows)`: a `SPILLED`
        column's values at `rows` (a slice or row indices) of the whole run, in token order (called
        from another thread: the metric summary runs beside the run-level test and the summary).
        `on_summary(summary)`: called with the summary once it is final, before the conclusions."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2, thread_name_prefix="lpf-finish") as pool:
            metrics = pool.submit(metric_summary, read, self.flips, self.same, self.n)
            summary = pool.submit(self._summary)
            return self._finish(metrics.result, summary.result, on_summary or (lambda s: None))

    def _summary(self) -> pa.Table:
        """The per-request summary (before the run-level test raises any request's verdict)."""
        ids = pa.concat_arrays(self.ids) if self.ids else pa.array([], pa.string())
        merged = (
            {k: np.concatenate([p[k] for p in self.per]) for k in self.per[0]}
            if self.per
            else score_requests(
                {n: np.zeros(0) for n in ("position", "engine_logprob", "ref_logprob")},
                np.zeros(0, np.int64),
                self.greedy,
                self.th,
            )[0]
        )
        self.per.clear(), self.ids.clear()
        return apply_inconsistency(summarize_requests(None, self.requests, self.th, per=(ids, merged)), self.requests)

    def _finish(self, metrics, summary, on_summary) -> tuple[pa.Table, dict]:
        """`metrics()`, `summary()`: the metric summary and `_summary`, made beside the run-level test."""
        record(self.ran, "thresholds", "scoring", "verdicts", "answer_checks", "run_test", "localized")
        test = None
        if self.arrival is not None:
            if isinstance(self.evidence[0], dict):  # coded chunks' rows, gathered in arrival order
                cols, codes = stream_evidence.gather(self.evidence)
                exceed_ids = lambda codes=codes: self.declared.take(pa.array(codes))  # noqa: E731 (when asked)
            else:
                keys, toks, refs = (pa.concat_tables(t) for t in zip(*self.evidence))
                cols = evidence_columns(keys, toks, refs, self.requests)
                exceed_ids = keys.column("request_id").take(pa.array(cols["order"]))
                exceed_ids = lambda ids=exceed_ids: ids  # noqa: E731
                del keys, toks, refs
            self.evidence.clear()
            ev = token_evidence(cols, self.expected, self.sampling)
            test = run_test(ev, self.expected)
            test["sampled_every"] = self.step
            exceed = ev["logprob"]
            del cols, ev
        summary, answer_blocks = answer_checks.apply(summary(), self.answers)
        if test is not None and test["result"] == "different":
            summary, test["localized"] = raise_localized(summary, test, exceed, exceed_ids())
        run = Run(
            self.requests,
            self.trace,
            self.engine_info,
            self.th,
            self.calib,
            self.greedy,
            self.temperature,
            self.sampling,
            self.expected,
            self.reference_columns,
        )
        inputs = Gathered(self.gatherer, self.store, self.gathered_counts, self.token_ids, self.missed)
        # with prompt positions the summary gains their columns after the conclusions: the caller writes it then
        early = on_summary if self.prompt is None else None
        summary, findings = conclude_run(run, summary, test, metrics, self.n, inputs, early, self.ran, answer_blocks)
        tables = self.prompt() if self.prompt is not None else (None, None)
        return with_prompt(summary, findings, *tables, self.requests, self.th, self.trace, self.chunk_budget, self.ran)


class Listed:
    """The gathered rows' store (`stream_gather`) in memory: each name's tables in the order added."""

    def __init__(self):
        self.tables: dict[str, list[pa.Table]] = {}

    def add(self, name: str, table: pa.Table) -> None:
        self.tables.setdefault(name, []).append(table)

    def pieces(self, name: str):
        return iter(self.tables.get(name, ()))


class _Lazy:
    """A value built on first use (by one thread: the others wait for it)."""

    def __init__(self, build):
        self.build, self.value, self.lock = build, None, threading.Lock()

    def get(self):
        with self.lock:
            if self.value is None:
                self.value = self.build()
            return self.value


def _decoded(table: pa.Table) -> pa.Table:
    """`table` with its dictionary-encoded request_id as plain strings."""
    at = table.schema.get_field_index("request_id")
    return table.set_column(at, "request_id", table.column(at).cast(pa.string()))


def _arrival_offsets(
    requests: pa.Table, ids: pa.Array, counts: np.ndarray, rows: np.ndarray | None = None
) -> tuple[np.ndarray, bool]:
    """(per request in token order: the arrival index (request seq, then position) of its first
    scored token, as `token_evidence.evidence_columns` orders them; whether their seqs are distinct,
    so that order is the arrival index's). `rows`: each id's row in `requests`, when the caller
    knows it (else looked up by id)."""
    if rows is not None:
        seq = requests.column("seq").to_numpy()[rows]
    else:
        req = by_arrival(requests)
        at = (
            pc.index_in(ids, value_set=req.column("request_id").combine_chunks())
            .fill_null(0)
            .to_numpy(zero_copy_only=False)
        )
        seq = req.column("seq").to_numpy()[at]
    order = np.argsort(seq, kind="stable")  # seq is unique per request
    offsets = np.empty(len(ids), np.int64)
    offsets[order] = np.cumsum(counts[order]) - counts[order]
    ranked = seq[order]
    return offsets, bool(np.all(ranked[1:] != ranked[:-1]))


def _with_keys(keys: pa.Table, lists: pa.Table, keep: pa.Array) -> pa.Table:
    """`lists`' rows at `keep` beside `keys`' request_id and position (the same rows: no second
    filter of the request ids)."""
    if not lists.num_columns:
        return keys.select(["request_id", "position"])
    out = lists.filter(keep)
    for i, name in enumerate(("request_id", "position")):
        out = out.add_column(i, name, keys.column(name))
    return out


def _rows_for(table: pa.Table, keys: pa.Table) -> pa.Table:
    """`table`'s rows at the (request_id, position) of `keys`, in keys' order."""
    if (
        table.num_rows == keys.num_rows
        and table.column("request_id").equals(keys.column("request_id"))
        and table.column("position").equals(keys.column("position"))
    ):
        return table
    left = keys.select(["request_id", "position"]).append_column("_k", pa.array(np.arange(keys.num_rows)))
    right = table.select(["request_id", "position"]).append_column("_t", pa.array(np.arange(table.num_rows)))
    rows = left.join(right, keys=["request_id", "position"], join_type="inner").sort_by("_k").column("_t")
    return table.take(rows)
