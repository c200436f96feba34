"""One window of live traffic judged: per-request verdicts, the run-level test, and where the change began.

Contract (pure: tables in, plain data out; no I/O): `judge_window(requests, tokens, reference, context, info)`
takes the window's rows of the run tables (`requests` with `seq`), the rows of the requests judged just
before it (`context`: (requests, tokens, reference) of the previous window, or None), and `info`
(temperature (None: mixed), engine_dtype, reference_dtype, model, floor_table, alpha). It returns:
  n_requests, n_tokens, first_seq, last_seq, verdicts ({verdict: count}), flagged (request ids),
  run_test ({result, p_value, test, statistic, n_tokens}: `lpf.analysis.run_test` with logprobs, the
  tokens-only test of `lpf.analysis.token_test` without), tokens_only, flagged_rate and expected_rate
  (the share of tokens beyond the floor against the null rate), alarm (the run-level test rejects, or a
  request is divergent or corrupt), hypotheses (the analysis's three best: feature, sentence, p-value;
  timing and load ones from the requests' timestamps), and when it alarms `change` ({seq, request_id,
  how}): the first request of the change. The change point is the maximum-likelihood split of the token exceedances
  (one Bernoulli rate before, a higher one after) over request boundaries of the previous window and
  this one; without token evidence, the first flagged request.
Verdicts and the run-level test are `lpf.analysis.findings.analyze` (or `analyze_tokens_only`) on the
window alone, against the shipped expected floor: the same judgement `lpf analyze` makes of a run.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import metrics as m
from lpf.analysis.findings import analyze
from lpf.analysis.floors import expected_floor
from lpf.analysis.run_test import NULL_RATE, token_evidence
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.token_evidence import evidence_columns
from lpf.analysis.tokens_only import analyze_tokens_only

FLAGGED = ("divergent", "corrupt")
MIXED_TEMPERATURE = 2.0  # a window of mixed temperatures: only the temperature-free logprob test applies


def _no_logprobs(tokens: pa.Table) -> bool:
    return tokens.num_rows > 0 and tokens.column("engine_logprob").null_count == tokens.num_rows


def judge_window(requests: pa.Table, tokens: pa.Table, reference: pa.Table, context, info: dict) -> dict:
    temperature = info.get("temperature")
    t = MIXED_TEMPERATURE if temperature is None else float(temperature)
    sampling = {"temperature": t, "top_k": 0, "top_p": 1.0}
    run_info = {
        "engine_dtype": info.get("engine_dtype"),
        "reference_dtype": info.get("reference_dtype"),
        "model": info.get("model"),
        "sampling": sampling,
    }
    tokens_only = _no_logprobs(tokens)
    judge = analyze_tokens_only if tokens_only else analyze
    summary, findings = judge(
        requests,
        tokens,
        reference,
        Thresholds(),
        greedy=t == 0,
        temperature=t,
        floor_table=info.get("floor_table"),
        run_info=run_info,
    )
    counts = {k: int(v) for k, v in (findings.get("counts") or {}).items() if v}
    flagged_tab = summary.filter(pc.is_in(summary.column("verdict"), value_set=pa.array(FLAGGED)))
    flagged = sorted(zip(flagged_tab.column("seq").to_pylist(), flagged_tab.column("request_id").to_pylist()))
    test = findings.get("run_test") or {}
    out = {
        "n_requests": requests.num_rows,
        "n_tokens": tokens.num_rows,
        "first_seq": int(pc.min(requests.column("seq")).as_py()),
        "last_seq": int(pc.max(requests.column("seq")).as_py()),
        "verdicts": counts,
        "flagged": [rid for _, rid in flagged],
        "tokens_only": tokens_only,
        "run_test": {k: test.get(k) for k in ("result", "p_value", "test", "statistic", "n_tokens", "sentence")},
        "temperature": temperature,
    }
    rates = _exceedances(requests, tokens, reference, run_info, info, tokens_only)
    out["flagged_rate"] = float(rates[0].sum() / max(rates[1].sum(), 1)) if rates is not None else None
    out["expected_rate"] = NULL_RATE if rates is not None else None
    out["alarm"] = test.get("result") == "different" or bool(flagged)
    # what sets the window's flagged requests apart (timing and load from the requests' own timestamps)
    out["hypotheses"] = [
        {k: h.get(k) for k in ("feature", "sentence", "p_value")} for h in (findings.get("hypotheses") or [])[:3]
    ]
    if out["alarm"]:
        out["change"] = change_point(requests, tokens, reference, context, run_info, info, tokens_only, flagged)
    return out


def _exceedances(requests, tokens, reference, run_info, info, tokens_only):
    """(k, n) per request in seq order: tokens beyond the floor and tokens scored; None without a floor
    or without logprobs."""
    if tokens_only or info.get("floor_table") is None or tokens.num_rows == 0:
        return None
    floor = expected_floor(
        info["floor_table"], run_info["engine_dtype"], run_info["reference_dtype"], run_info["model"]
    )
    if not floor:
        return None
    joined, _ = m.join_grouped(tokens, reference)
    if joined.num_rows == 0:
        return None
    cols = evidence_columns(joined, tokens, reference, requests)
    ev = token_evidence(cols, floor, run_info["sampling"])
    hits = np.asarray(ev["logprob"], dtype=bool)
    # rows are in arrival order (seq, position): each request's rows are contiguous
    ids = joined.column("request_id").take(pa.array(cols["order"])).to_pylist()
    seqs = dict(zip(requests.column("request_id").to_pylist(), requests.column("seq").to_pylist()))
    order = sorted(set(ids), key=lambda r: seqs[r])
    index = {r: i for i, r in enumerate(order)}
    at = np.array([index[r] for r in ids], dtype=np.int64)
    k = np.bincount(at, weights=hits, minlength=len(order))
    n = np.bincount(at, minlength=len(order)).astype(float)
    return k, n, order


def change_point(requests, tokens, reference, context, run_info, info, tokens_only, flagged) -> dict:
    if context is not None:
        requests = pa.concat_tables([context[0], requests])
        tokens = pa.concat_tables([context[1], tokens])
        reference = pa.concat_tables([context[2], reference])
    rates = _exceedances(requests, tokens, reference, run_info, info, tokens_only)
    seqs = dict(zip(requests.column("request_id").to_pylist(), requests.column("seq").to_pylist()))
    if rates is not None and rates[0].sum() > 0:
        k, n, order = rates
        b = _split(k, n)
        if b is not None:
            return {"request_id": order[b], "seq": int(seqs[order[b]]), "how": "exceedance rate split"}
    if flagged:
        seq, rid = flagged[0]
        return {"request_id": rid, "seq": int(seq), "how": "first flagged request"}
    first = int(pc.min(requests.column("seq")).as_py())
    rid = next(r for r, s in seqs.items() if s == first)
    return {"request_id": rid, "seq": first, "how": "window start"}


def _split(k: np.ndarray, n: np.ndarray) -> int | None:
    """The request index b maximizing the likelihood of rate p1 over requests < b and p2 > p1 from b on."""
    K, N = np.cumsum(k), np.cumsum(n)
    kt, nt = K[-1], N[-1]
    best, at = -math.inf, None
    for b in range(len(k)):
        k1, n1 = (K[b - 1], N[b - 1]) if b else (0.0, 0.0)
        k2, n2 = kt - k1, nt - n1
        if n2 <= 0:
            continue
        p1, p2 = (k1 / n1 if n1 else 0.0), k2 / n2
        if p2 <= p1:
            continue
        ll = _ll(k1, n1, p1) + _ll(k2, n2, p2)
        if ll > best:
            best, at = ll, b
    return at


def _ll(k: float, n: float, p: float) -> float:
    out = 0.0
    if k > 0:
        out += k * math.log(p)
    if n - k > 0:
        out += (n - k) * math.log1p(-p)
    return out
