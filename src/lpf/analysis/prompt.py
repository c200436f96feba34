"""Prompt (prefill) positions, judged apart from output (decode) positions.

Contract: `prompt_analysis(prompt_tokens, prompt_reference, requests, th, trace=None, chunk_budget=None)`
-> (per-request table, findings block), or (None, None) when the run has no scored prompt position.
Pure: Arrow tables and plain data in and out.

The table has one row per request with scored prompt positions: `request_id`, `prompt_n_scored_tokens`,
`prompt_max_abs_logprob_diff`, `prompt_mean_abs_logprob_diff`, `prompt_first_departure` (first
position with |d| above `clean_abs_diff`: where the prompt stops agreeing to rounding),
`prompt_first_divergence` (first position with |d| above `divergent_abs_diff`) and `prompt_verdict`.
The block (`findings.prompt`): n_requests, n_scored_tokens, counts, verdict, metrics (percentiles of
abs_logprob_diff, prob_diff, k3_kl), flagged (the divergent requests, worst first, at most 50) and
shape.

Verdicts use the run's thresholds (calibrated on its output positions, or on its calibration run: one
noise floor per dtype pair holds for both). The engine did not choose prompt tokens, so greedy flips
and confident gibberish do not apply: a prompt verdict is `clean` (every |d| <= clean_abs_diff),
`noise` or `divergent` (some |d| > divergent_abs_diff; a missing or NaN logprob counts as infinite).

Shape: where the prompt departures start (the first-departure position profile; position 1 is the
first scored one) and whether they sit on the first position computed after a chunk boundary. A chunk
that starts at prompt position c computes rows c, c+1, ...; row c predicts prompt token c + 1, so a
state lost or corrupted when it is handed from one chunk to the next first shows at position c + 1.
Chunk starts come from the trace (the num_computed_tokens of every non-decode row that starts inside
the prompt: extends, and prefix-cache hits) or, without a trace, from max_num_batched_tokens (its
multiples: exact only for a prompt that had each step's whole budget, so labelled an estimate).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import metrics as m
from lpf.analysis.levels import SEVERITY
from lpf.analysis.thresholds import Thresholds

PROMPT_VERDICTS = ("clean", "noise", "divergent")
_BIG = np.iinfo(np.int32).max
MAX_FLAGGED = 50
AT_BOUNDARY_FRACTION = 0.5  # "jumps at a chunk boundary" needs at least half the first departures there


def prompt_analysis(
    prompt_tokens: pa.Table | None,
    prompt_reference: pa.Table | None,
    requests: pa.Table,
    th: Thresholds,
    trace: pa.Table | None = None,
    chunk_budget: int | None = None,
) -> tuple[pa.Table | None, dict | None]:
    if prompt_tokens is None or prompt_reference is None or not prompt_tokens.num_rows or not prompt_reference.num_rows:
        return None, None
    joined, starts = m.join_grouped(prompt_tokens, prompt_reference)
    if not joined.num_rows:
        return None, None
    pos = joined.column("position").to_numpy().astype(np.int64)
    eng, ref = joined.column("engine_logprob").to_numpy(), joined.column("ref_logprob").to_numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        d = eng - ref
        ad = np.abs(d)
        prob = np.abs(np.exp(eng) - np.exp(ref))
        k3 = np.exp(-d) + d - 1.0
    adf = np.where(np.isfinite(ad), ad, np.inf)  # a missing or NaN logprob is never clean
    counts = np.diff(np.r_[starts, len(pos)])
    first_dep = np.minimum.reduceat(np.where(adf > th.clean_abs_diff, pos, _BIG), starts)
    first_div = np.minimum.reduceat(np.where(adf > th.divergent_abs_diff, pos, _BIG), starts)
    worst = np.maximum.reduceat(adf, starts)
    mean = np.add.reduceat(np.where(np.isfinite(ad), ad, 0.0), starts) / counts
    verdict = np.full(len(starts), "clean", dtype=object)
    verdict[worst > th.clean_abs_diff] = "noise"
    verdict[first_div != _BIG] = "divergent"
    ids = joined.column("request_id").take(pa.array(starts)).combine_chunks()
    table = pa.table(
        {
            "request_id": ids,
            "prompt_n_scored_tokens": pa.array(counts.astype(np.int32)),
            "prompt_max_abs_logprob_diff": pa.array(worst),
            "prompt_mean_abs_logprob_diff": pa.array(mean),
            "prompt_first_departure": pa.array(first_dep.astype(np.int32), mask=first_dep == _BIG),
            "prompt_first_divergence": pa.array(first_div.astype(np.int32), mask=first_div == _BIG),
            "prompt_verdict": pa.array(verdict, type=pa.string()),
        }
    )
    tally = {v: int(np.count_nonzero(verdict == v)) for v in PROMPT_VERDICTS}
    block = {
        "n_requests": len(starts),
        "n_scored_tokens": int(len(pos)),
        "counts": tally,
        "verdict": max((v for v in PROMPT_VERDICTS if tally[v]), key=SEVERITY.get),
        "metrics": {
            "abs_logprob_diff": m.percentiles(ad),
            "prob_diff": m.percentiles(prob),
            "k3_kl": m.percentiles(k3),
        },
        "flagged": _flagged(table),
        "shape": prompt_shape(table, requests, trace, chunk_budget),
    }
    return table, block


def _flagged(table: pa.Table) -> list[dict]:
    rows = table.filter(pc.equal(table.column("prompt_verdict"), "divergent")).to_pylist()
    rows.sort(key=lambda r: (-r["prompt_max_abs_logprob_diff"], r["request_id"]))
    return [
        {
            "request_id": r["request_id"],
            "first_departure": r["prompt_first_departure"],
            "first_divergence": r["prompt_first_divergence"],
            "max_abs_logprob_diff": r["prompt_max_abs_logprob_diff"],
        }
        for r in rows[:MAX_FLAGGED]
    ]


def chunk_starts(requests: pa.Table, trace: pa.Table | None, chunk_budget: int | None) -> tuple[dict, str | None]:
    """({request_id: set of prompt positions where a chunk started}, source) from the trace, else
    estimated from the step budget; ({}, None) when neither is known."""
    plen = dict(
        zip(
            requests.column("request_id").to_pylist(),
            pc.list_value_length(requests.column("prompt_token_ids")).to_pylist(),
        )
    )
    if trace is not None and trace.num_rows:
        t = trace.filter(
            pc.and_(
                pc.invert(trace.column("preempted").fill_null(False)),
                pc.not_equal(trace.column("phase").fill_null("decode"), "decode"),
            )
        )
        out: dict[str, set[int]] = {}
        for rid, c in zip(t.column("request_id").to_pylist(), t.column("num_computed_tokens").to_pylist()):
            if c and rid in plen and 0 < c < plen[rid]:
                out.setdefault(rid, set()).add(int(c))
        return out, "trace"
    if chunk_budget:
        return {
            rid: set(range(chunk_budget, p, chunk_budget)) for rid, p in plen.items() if p > chunk_budget
        }, "max_num_batched_tokens (estimated: exact for a prompt that had each step's whole budget)"
    return {}, None


def prompt_shape(table: pa.Table, requests: pa.Table, trace: pa.Table | None, chunk_budget: int | None) -> dict:
    """Where prompt departures start, and whether they jump at chunk boundaries (see the module doc)."""
    verdicts = np.asarray(table.column("prompt_verdict").to_pylist(), dtype=object)
    label = "divergent" if np.any(verdicts == "divergent") else "noise"
    pick = verdicts == label
    ids = np.asarray(table.column("request_id").to_pylist(), dtype=object)[pick]
    first = np.asarray(table.column("prompt_first_departure").fill_null(-1).to_numpy(), dtype=np.int64)[pick]
    shape: dict = {"n_flagged": int(pick.sum()), "label": label}
    if not pick.any():
        shape["sentence"] = "every prompt position agrees with the reference to within the clean threshold"
        return shape
    values, freq = np.unique(first, return_counts=True)
    shape["first_departure"] = {
        "positions": {int(v): int(c) for v, c in zip(values, freq)},
        "median": float(np.median(first)),
        "at_first_fraction": float(np.mean(first == 1)),
    }
    starts, source = chunk_starts(requests, trace, chunk_budget)
    if source is None:
        shape["sentence"] = (
            f"{pick.sum()} {label} prompts first depart from the reference at median position "
            f"{np.median(first):g}; no trace or step budget to place chunk boundaries"
        )
        return shape
    plen = dict(
        zip(
            requests.column("request_id").to_pylist(),
            pc.list_value_length(requests.column("prompt_token_ids")).to_pylist(),
        )
    )
    at = [int(p - 1 in starts.get(rid, ())) for rid, p in zip(ids, first)]
    chance = float(np.mean([len(starts.get(rid, ())) / max(1, plen.get(rid, 2) - 1) for rid in ids]))
    k, n = sum(at), len(at)
    jumps = k >= 1 and k / n >= AT_BOUNDARY_FRACTION and k / n > 2 * chance
    shape["chunk_boundary"] = {
        "source": source,
        "n_at_boundary": k,
        "n": n,
        "fraction": k / n,
        "chance_fraction": chance,
        "jumps_at_chunk_boundary": jumps,
        "requests_chunked": sum(1 for rid in ids if starts.get(rid)),
    }
    where = (
        f"{k}/{n} {label} prompts first depart on the first position computed after a chunk boundary "
        f"(chunk start + 1; {100 * chance:.0f}% expected by chance; boundaries from {source.split(' (')[0]})"
    )
    shape["sentence"] = ("jumps at a chunk boundary: " + where) if jumps else where
    return shape


def merge_summary(summary: pa.Table, prompt_table: pa.Table | None) -> pa.Table:
    """The per-request summary with the `prompt_` columns added (null where a request has none)."""
    if prompt_table is None:
        return summary
    at = pc.index_in(summary.column("request_id"), value_set=prompt_table.column("request_id"))
    for name in prompt_table.column_names[1:]:
        summary = summary.append_column(name, prompt_table.column(name).take(at))
    return summary


def worst_verdict(output_verdict: str, prompt_block: dict | None) -> str:
    """The run verdict: the worst of the output verdicts and the prompt verdicts (a prefill bug that
    only the prompt positions show still fails the run; a clean prompt never hides an unscored run)."""
    if not prompt_block:
        return output_verdict
    pv = prompt_block["verdict"]
    if output_verdict not in SEVERITY:
        return output_verdict if pv == "clean" else pv
    return pv if SEVERITY[pv] > SEVERITY[output_verdict] else output_verdict
