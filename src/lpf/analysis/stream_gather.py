"""The rows the steps after scoring read, gathered by the streamed analysis as its chunks go by.

Contract (pure: Arrow tables in, Arrow tables and plain data out; where the rows are kept is the
caller's `store`, with `add(name, table)` and `pieces(name)` -> the tables added, in order):
- `Gatherer(requests, trace, sampling, greedy, th, reference_columns, n_rows, lse_complete)` decides
  which rows each step needs (`steps.STEPS`' "gathered" ones) and `chunk(joined, starts, heads,
  tokens, reference, zipped)` takes them from one chunk (whole requests; `joined`: the chunk's
  `metrics.join_grouped`, `tokens`/`reference` its rows, lying row for row with joined when `zipped`):
    spec_decisions       the tokens' and reference's rows at the (request, position) of every decision
                         the trace says the rejection sampler made (`speculative_decisions.decision_keys`)
    penalty              greedy runs with a log-sum-exp: the tokens' and reference's rows of the
                         requests `penalty_evidence.request_stride` keeps (every request while the stride is
                         not known before the pass: `lse_complete` False), and the count of scored rows
                         with a log-sum-exp (the stride's input)
    logprob_temperature  the tokens whose logprob departs from the raw one by more than the clean
                         threshold, in token order, and their reference top-k
  It returns {name: table} and {name: count}.
- `Gathered(gatherer, store, counts, token_ids)`: `conclusion.Inputs` over what was gathered, giving
  `findings.analyze`'s results on the whole tables: each step's function called on exactly the rows
  it reads of them (`token_ids(keep)`: the requests table with the token-id lists of the requests at
  `keep` and empty lists elsewhere, the same rows in the same order: the penalty's context; with a
  list of columns, those lists only: the prefix cache's block reads every prompt's ids; `outputs(run, keep)`:
  the flagged requests' output ids, which the collapse signature reads).
  The tempered signature (at the run's or the fitted temperature) counts, per request, tokens that
  depart from the raw logprob: the departing rows are all it reads.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.columns import Lookup, one_array
from lpf.analysis.penalties import fit_penalty
from lpf.analysis.penalty_evidence import request_stride
from lpf.analysis.prefix_cache import prefix_cache_summary
from lpf.analysis.run_test import DEFAULT_ALPHA
from lpf.analysis.signatures import MAX_TEMPERED_TOKENS, crossed_wires, fit_logprob_temperature, tempered_logprobs
from lpf.analysis.speculative_decisions import decision_keys, decision_test

KEYS = ["request_id", "position"]
DECISION_TOKENS = [*KEYS, "token_id", "engine_logprob"]
DECISION_REFERENCE = [*KEYS, "ref_logprob", "ref_topk_ids", "ref_topk_logprobs"]
PENALTY_TOKENS = [*KEYS, "token_id"]
PENALTY_REFERENCE = [*KEYS, "ref_logprob", "ref_logsumexp", "ref_topk_ids", "ref_topk_logprobs"]
DEPARTING = [*KEYS, "engine_logprob", "ref_logprob"]
DEPARTING_REFERENCE = [*KEYS, "ref_topk_logprobs"]


class Gatherer:
    def __init__(self, requests, trace, sampling, greedy, th, reference_columns, n_rows, lse_complete):
        self.requests, self.th = requests, th
        keys = decision_keys(requests, trace, sampling, reference_columns)
        self.keys = keys.group_by(KEYS).aggregate([]) if keys is not None else None  # each once
        self.penalty = greedy and {"ref_logsumexp", "ref_topk_ids"} <= set(reference_columns)
        # the penalty's request sample is known before the pass when every scored row has a log-sum-exp
        self.stride = request_stride(n_rows) if self.penalty and lse_complete else 1
        self.departing = "ref_topk_logprobs" in reference_columns
        self._rows = None

    def wants_strings(self) -> bool:
        """Whether `chunk` reads request ids as strings (a coded chunk's must then be decoded)."""
        return self.keys is not None or self.penalty or self.departing

    def request_rows(self, ids) -> np.ndarray:
        """Each id's row in the requests table, as `pc.index_in` gives it (-1: none)."""
        if self._rows is None:
            ids_all = one_array(self.requests.column("request_id"))
            distinct = len(pc.unique(ids_all)) == len(ids_all)
            self._rows = Lookup(ids_all) if distinct else ids_all
        if isinstance(self._rows, Lookup):
            return self._rows.index(ids)
        return pc.index_in(ids, value_set=self._rows).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)

    def chunk(self, joined, starts, heads, tokens, reference, zipped) -> tuple[dict, dict]:
        out, counts = {}, {}
        if self.keys is not None:
            out["decision_tokens"] = _at_keys(tokens, self.keys, DECISION_TOKENS)
            out["decision_reference"] = _at_keys(reference, self.keys, DECISION_REFERENCE)
        if self.penalty:
            # the fit joins the tokens with the reference rows that have a log-sum-exp: only those rows count
            valid = pc.is_valid(reference.column("ref_logsumexp"))
            ref = reference.select(PENALTY_REFERENCE).filter(valid)
            tok = tokens.select(PENALTY_TOKENS)
            if zipped:  # the same rows on both sides
                tok = tok.filter(valid)
                counts["penalty_rows"] = tok.num_rows
            else:
                left = tok.select(KEYS).append_column("_r", pa.array(np.arange(tok.num_rows)))
                hit = left.join(ref.select(KEYS), KEYS, join_type="inner").column("_r").to_numpy()
                counts["penalty_rows"] = hit.size
                tok = tok.take(pa.array(np.unique(hit)))
            if self.stride > 1:
                if zipped:
                    rows = np.repeat(self.request_rows(heads), np.diff(np.r_[starts, joined.num_rows]))
                    keep = pa.array((rows % self.stride == 0)[_true(valid)])
                    tok, ref = tok.filter(keep), ref.filter(keep)
                else:
                    tok, ref = (self._sampled(t, self.stride) for t in (tok, ref))
            out["penalty_tokens"], out["penalty_reference"] = _strings(tok), _strings(ref)
        if self.departing:
            with np.errstate(invalid="ignore"):
                eng, raw = joined.column("engine_logprob").to_numpy(), joined.column("ref_logprob").to_numpy()
                departs = np.abs(eng - raw) > self.th.clean_abs_diff
            dep = _strings(joined.select(DEPARTING).filter(pa.array(departs)))
            if zipped:
                ref = _strings(reference.select(DEPARTING_REFERENCE).filter(pa.array(departs)))
            else:
                ref = _at_keys(reference, dep.select(KEYS), DEPARTING_REFERENCE)
            out["departing"], out["departing_reference"] = dep, ref
        return out, counts

    def _sampled(self, table: pa.Table, stride: int) -> pa.Table:
        """`table`'s rows of the requests whose row is a multiple of `stride`."""
        return table.filter(pa.array(self.request_rows(table.column("request_id")) % stride == 0))


def _true(mask: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(mask.to_numpy(zero_copy_only=False), bool)


def _strings(table: pa.Table) -> pa.Table:
    """`table` with its request_id as plain strings (a coded chunk's is a dictionary)."""
    at = table.schema.get_field_index("request_id")
    if pa.types.is_dictionary(table.schema.field(at).type):
        table = table.set_column(at, "request_id", table.column(at).cast(pa.string()))
    return table


def _at_keys(table: pa.Table, keys: pa.Table, columns: list[str]) -> pa.Table:
    """`table`'s rows (`columns` of them) whose (request_id, position) is among `keys` (each once), in
    table order."""
    table = _strings(table.select(columns))
    if not table.num_rows or not keys.num_rows:
        return table.slice(0, 0)
    left = table.select(KEYS).append_column("_r", pa.array(np.arange(table.num_rows)))
    rows = left.join(keys.select(KEYS), KEYS, join_type="inner").column("_r").to_numpy()
    return table.take(pa.array(np.unique(rows)))


class Gathered:
    """`conclusion.Inputs` from what the chunks gave (module docstring)."""

    def __init__(self, gatherer: Gatherer, store, counts: dict, token_ids, missed: list):
        self.g, self.store, self.counts, self.token_ids, self.missed = gatherer, store, counts, token_ids, missed

    def _table(self, name: str) -> pa.Table | None:
        pieces = list(self.store.pieces(name))
        return pa.concat_tables(pieces) if pieces else None

    def decisions(self, run, slack):
        if self.g.keys is None:
            return None
        tok, ref = self._table("decision_tokens"), self._table("decision_reference")
        if tok is None or ref is None:
            return None  # no chunk: nothing scored, nothing tested
        return decision_test(tok, ref, run.requests, run.trace, run.sampling, slack, DEFAULT_ALPHA)

    def tempered(self, temperature):
        ids = [
            tempered_logprobs(dep, ref, temperature, self.g.th)
            for dep, ref in zip(self.store.pieces("departing"), self.store.pieces("departing_reference"))
        ]
        return pa.chunked_array(ids, pa.string()).combine_chunks()

    def penalty(self, tie, greedy_ids, configured=None):  # (None: the streamed analysis reads no run of mixed settings)
        tok, ref = self._table("penalty_tokens"), self._table("penalty_reference")
        if tok is None or ref is None:
            return None
        n_rows = self.counts.get("penalty_rows", 0)
        stride = request_stride(n_rows)
        if stride != self.g.stride:  # the sample was not known before the pass (rows without a log-sum-exp)
            if self.g.stride != 1:
                raise RuntimeError(f"penalty sample: {n_rows} rows with a log-sum-exp, not the run's scored rows")
            tok, ref = self.g._sampled(tok, stride), self.g._sampled(ref, stride)
        keep = np.zeros(self.g.requests.num_rows, bool)
        rows = self.g.request_rows(pc.unique(tok.column("request_id")))
        keep[rows[rows >= 0]] = True
        requests = self.token_ids(keep) if self.token_ids is not None else self.g.requests
        return fit_penalty(tok, ref, requests, tie, n_rows=n_rows, configured=configured)

    def logprob_temperature(self):
        sizes = [p.num_rows for p in self.store.pieces("departing")]
        n = sum(sizes)
        step = -(-n // MAX_TEMPERED_TOKENS) if n else 1  # the in-memory fit's even sample of the departing tokens
        keys, refs, at = [], [], 0
        for dep, ref in zip(self.store.pieces("departing"), self.store.pieces("departing_reference")):
            take = np.arange((-at) % step, dep.num_rows, step)
            at += dep.num_rows
            if take.size:
                sampled = dep.take(pa.array(take))
                keys.append(sampled)
                refs.append(_at_keys(ref, sampled.select(KEYS), DEPARTING_REFERENCE))
        if not keys:
            return None
        return fit_logprob_temperature(pa.concat_tables(keys), pa.concat_tables(refs), self.g.th)

    def prefix_cache(self, run):
        """The block from the prompts' token ids (the streamed requests hold their lengths only), read
        when the run has a prefix cache."""
        light = prefix_cache_summary(run.requests, run.trace, run.engine_info)
        if light is None or self.token_ids is None:
            return light
        ids = self.token_ids(np.ones(run.requests.num_rows, bool), ["prompt_token_ids"]).column("prompt_token_ids")
        at = run.requests.schema.get_field_index("prompt_token_ids")
        return prefix_cache_summary(run.requests.set_column(at, "prompt_token_ids", ids), run.trace, run.engine_info)

    def outputs(self, run, keep):
        """The requests with the output token ids of those at `keep` (a mask in `summary`'s order: by arrival)."""
        if self.token_ids is None:
            return run.requests
        rows = np.argsort(run.requests.column("seq").to_numpy(), kind="stable")  # arrival i is row rows[i]
        mask = np.zeros(run.requests.num_rows, bool)
        mask[rows[np.asarray(keep, bool)]] = True
        ids = self.token_ids(mask, ["output_token_ids"]).column("output_token_ids")
        at = run.requests.schema.get_field_index("output_token_ids")
        return run.requests.set_column(at, "output_token_ids", ids)

    def crossed(self, run):
        if run.trace is None or not run.trace.num_rows:
            return None
        return crossed_wires(pa.concat_tables(self.missed) if self.missed else _NO_MISS, run.requests, run.trace)


_NO_MISS = pa.table(
    {
        "request_id": pa.array([], pa.string()),
        "position": pa.array([], pa.int32()),
        "token_id": pa.array([], pa.int32()),
        "ref_top1_id": pa.array([], pa.int32()),
    }
)
