"""One window of live traffic judged: per-request verdicts, the run-level test, and where the change began.

Contract (pure: tables in, plain data out; no I/O): `judge_window(requests, tokens, reference, context, info)`
takes the window's rows of the run tables (`requests` with `seq`), the rows of the requests judged just
before it (`context`: (requests, tokens, reference) of the previous window, or None), and `info`
(temperature (None: mixed), engine_dtype, reference_dtype, model, floor_table, alpha). It returns:
  n_requests, n_tokens, first_seq, last_seq, verdicts ({verdict: count}), flagged (request ids),
  run_test ({result, p_value, test, statistic, n_tokens}: `lpf.analysis.run_test` with logprobs, the
  tokens-only test of `lpf.analysis.token_test` without), tokens_only, flagged_rate and expected_rate
  (the share of tokens beyond the floor against the null rate), requests_test (`requests_test`: the
  window's divergent and corrupt requests against the count an honest engine of its dtype shows over as
  many scored tokens), alarm (the run-level test rejects, or the requests test does: a corrupt request, a
  divergent one far beyond the floor, or more divergent ones than honest arithmetic at the dtype explains),
  hypotheses (the analysis's three best: feature, sentence, p-value;
  timing and load ones from the requests' timestamps), and when it alarms `change` ({seq, request_id,
  how}): the first request of the change. The change point is the maximum-likelihood split of the token exceedances
  (one Bernoulli rate before, a higher one after) over request boundaries of the previous window and
  this one; without token evidence, the first flagged request.
`incident_change(requests, tokens, reference, flagged_ids, info)` is the same change point over an incident's
evidence so far (`lpf.watch.incidents`).
Verdicts and the run-level test are `lpf.analysis.findings.analyze` (or `analyze_tokens_only`) on the
window alone, against the shipped expected floor: the same judgement `lpf analyze` makes of a run.

An honest engine below float32 does produce an occasional divergent request (on prose: one token past
the verdicts' threshold, 0.5 nats before the floor raised it, or a greedy flip in a long loop past the
tie margin), so one divergent request is not an alarm: the window's count of them is tested against Poisson(rate x scored tokens), `rate` the upper 95% bound of what honest engines of the
dtype showed (HONEST_DIVERGENT), at the run-level test's alpha; requests count once per distinct (prompt,
output) pair (the same prompt answered the same twice is one piece of evidence). A `corrupt` request
(confident gibberish: none seen from any honest engine) alarms alone, and so does a divergent one whose
largest token error is FAR_BEYOND times the floor's threshold (effect size, as the run-level test weighs
it: a stale-state imposter, not a near tie).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import metrics as m
from lpf.analysis.findings import analyze
from lpf.analysis.floors import KAPPA, run_floor
from lpf.pipeline.reference_prompt import LIMITATION
from lpf.analysis.run_test import DEFAULT_ALPHA, NULL_RATE, token_evidence
from lpf.analysis.stats import poisson_log_tail, poisson_upper
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.token_evidence import evidence_columns
from lpf.analysis.tokens_only import analyze_tokens_only

FLAGGED = ("divergent", "corrupt")
MIXED_TEMPERATURE = 2.0  # a window of mixed temperatures: only the temperature-free logprob test applies
# Divergent requests honest engines produced, by engine dtype against a float32 reference: (divergent
# requests, scored tokens, where). An engine of another or unknown dtype gets the most lenient rate.
HONEST_DIVERGENT = {  # distinct (prompt, output) pairs, as the window counts them
    "float32": (
        0,
        65_535,
        "greedy prose through `lpf serve` (built-in engine, bench/watch_detection.py seeds 30 and 31: 51,680 "
        "tokens), vLLM CPU on shared-prefix prompts (6,000), llama.cpp with and without flash attention and the "
        "built-in engine on 2 threads on zoo:stress and shared-prefix prompts (7,855)",
    ),
    "bfloat16": (
        7,
        43_952,
        "greedy prose through `lpf serve` (built-in engine, bench/watch_detection.py seeds 30 and 31: 1 in 19,888 "
        "and 5 in 17,664 tokens) and `lpf audit` of the built-in engine on other prose (scripts/measure_floor_prose.py "
        "seed 7: 1 in 6,400); each a single token 0.57-0.81 nats off, within the run-level test's bfloat16 floor "
        "(divergent then by the 0.5-nat default; the bfloat16 floor's threshold is 2.0 nats since: an upper bound)",
    ),
}
# A divergent request whose largest token error is this many times the floor's threshold (tau, the run-level
# test's: KAPPA x the dtype's 99th percentile, scaled by the token's sensitivity) alarms alone: honest engines'
# requests stayed under 2.6x (bfloat16 prose, 3,500 requests; their divergent ones under 1x: a single token
# past the absolute 0.5-nat verdict threshold) and float32's under 1.6x; stale-state imposters are at 1e4-1e5x.
FAR_BEYOND = 10.0
CONFIDENCE = 0.95  # the expected rate is the upper bound of this one-sided confidence interval of the count


def _no_logprobs(tokens: pa.Table) -> bool:
    return tokens.num_rows > 0 and tokens.column("engine_logprob").null_count == tokens.num_rows


def _run_info(info: dict) -> tuple[float, dict]:
    temperature = info.get("temperature")
    t = MIXED_TEMPERATURE if temperature is None else float(temperature)
    return t, {
        "engine_dtype": info.get("engine_dtype"),
        "reference_dtype": info.get("reference_dtype"),
        "reference_kind": info.get("reference_kind"),
        "model": info.get("model"),
        "sampling": {"temperature": t, "top_k": 0, "top_p": 1.0},
    }


def incident_change(requests: pa.Table, tokens: pa.Table, reference: pa.Table, flagged_ids: list, info: dict) -> dict:
    """An incident's change point over all of its evidence so far (`lpf.watch.incidents`): the same estimator
    as one window's, over the window before the incident and the incident's windows."""
    _, run_info = _run_info(info)
    seqs = dict(zip(requests.column("request_id").to_pylist(), requests.column("seq").to_pylist()))
    flagged = sorted((seqs[r], r) for r in flagged_ids if r in seqs)
    return change_point(requests, tokens, reference, None, run_info, info, _no_logprobs(tokens), flagged)


def judge_window(requests: pa.Table, tokens: pa.Table, reference: pa.Table, context, info: dict) -> dict:
    temperature = info.get("temperature")
    t, run_info = _run_info(info)
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
    if info.get("reference_kind") == "self":  # the engine compared with itself agrees whatever model it runs
        test = {"result": "not applicable", "sentence": f"not applicable: {LIMITATION}"}
    out = {
        "n_requests": requests.num_rows,
        "n_tokens": tokens.num_rows,
        "first_seq": int(pc.min(requests.column("seq")).as_py()),
        "last_seq": int(pc.max(requests.column("seq")).as_py()),
        "verdicts": counts,
        "flagged": [rid for _, rid in flagged],
        "tokens_only": tokens_only,
        "run_test": {k: test.get(k) for k in ("result", "p_value", "test", "statistic", "n_tokens", "sentence")},
        # the pair whose floor judged the window (`floors.expected_floor`), as the audit's thresholds line names it
        "floor_pair": ((findings.get("thresholds") or {}).get("noise_floor") or {}).get("pair"),
        "temperature": temperature,
    }
    rates = _exceedances(requests, tokens, reference, run_info, info, tokens_only)
    out["flagged_rate"] = float(rates[0].sum() / max(rates[1].sum(), 1)) if rates is not None else None
    out["expected_rate"] = NULL_RATE if rates is not None else None
    excess = dict(zip(rates[2], rates[3])) if rates is not None else {}
    divergent, corrupt, far, n_tokens = _distinct(requests, summary, excess)
    out["requests_test"] = requests_test(
        divergent, corrupt, n_tokens, info.get("engine_dtype"), info.get("alpha"), far_beyond=far
    )
    out["alarm"] = test.get("result") == "different" or out["requests_test"]["alarm"]
    # what sets the window's flagged requests apart (timing and load from the requests' own timestamps)
    out["hypotheses"] = [
        {k: h.get(k) for k in ("feature", "sentence", "p_value")} for h in (findings.get("hypotheses") or [])[:3]
    ]
    if out["alarm"]:
        out["change"] = change_point(requests, tokens, reference, context, run_info, info, tokens_only, flagged)
    return out


def _distinct(requests: pa.Table, summary: pa.Table, excess: dict | None = None) -> tuple[int, int, int, int]:
    """(divergent, corrupt, far beyond, scored output tokens) over the window's distinct (prompt, output)
    pairs: a prompt sent again and answered the same is the same evidence, not a second event (clients
    retry, share prompts). `far beyond`: the divergent ones whose largest token error (`excess`: request id
    -> max |d| / tau) is at least FAR_BEYOND times what the floor explains."""
    excess = excess or {}
    verdicts = dict(zip(summary.column("request_id").to_pylist(), summary.column("verdict").to_pylist()))
    seen: dict[tuple, str] = {}
    for rid, p, o in zip(
        requests.column("request_id").to_pylist(),
        requests.column("prompt_token_ids").to_pylist(),
        requests.column("output_token_ids").to_pylist(),
    ):
        v = verdicts.get(rid)
        if v in ("clean", "noise", "divergent", "corrupt"):
            far = v == "divergent" and excess.get(rid, 0.0) >= FAR_BEYOND
            seen[(tuple(p or ()), tuple(o or ()))] = "far" if far else v
    n_tokens = sum(len(o) for _, o in seen)
    n = {k: sum(v == k for v in seen.values()) for k in ("divergent", "corrupt", "far")}
    return n["divergent"] + n["far"], n["corrupt"], n["far"], n_tokens


@functools.cache
def expected_divergent_rate(engine_dtype: str | None) -> float:
    """Divergent requests per scored token an honest engine of `engine_dtype` stays under (95% bound)."""
    rates = {d: poisson_upper(k, CONFIDENCE) / n for d, (k, n, _) in HONEST_DIVERGENT.items()}
    return rates.get(engine_dtype or "", max(rates.values()))


def requests_test(
    divergent: int, corrupt: int, n_tokens: int, engine_dtype: str | None, alpha=None, far_beyond: int = 0
) -> dict:
    """{flagged, corrupt, far_beyond, expected, rate, p_value, alarm}: the window's divergent + corrupt
    requests against Poisson(expected = rate x n_tokens); alarm when p < alpha (the run-level test's), or
    any is corrupt, or any divergent one is far beyond the floor (`far_beyond` of the `divergent`)."""
    alpha = DEFAULT_ALPHA if alpha is None else float(alpha)
    rate = expected_divergent_rate(engine_dtype)
    k, lam = int(divergent) + int(corrupt), rate * max(int(n_tokens), 0)
    log_p = poisson_log_tail(k, lam)
    return {
        "flagged": k,
        "corrupt": int(corrupt),
        "far_beyond": int(far_beyond),
        "expected": lam,
        "rate": rate,
        "p_value": math.exp(log_p),
        "alarm": bool(corrupt) or bool(far_beyond) or log_p < math.log(alpha),
    }


def _exceedances(requests, tokens, reference, run_info, info, tokens_only):
    """(k, n, ids, excess) per request in seq order: tokens beyond the floor, tokens scored, the request
    ids, and the largest token error over the floor's threshold tau (|d| / tau; a missing logprob counts
    as none); None without a floor or without logprobs."""
    if tokens_only or info.get("floor_table") is None or tokens.num_rows == 0:
        return None
    floor = run_floor(info["floor_table"], run_info)
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
    tau = KAPPA * (floor["token"]["q99"] * ev["s"] + floor["settled"]["q99"])
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.abs(ev["d"]) / tau
    excess = np.zeros(len(order))
    np.maximum.at(excess, at, np.where(np.isfinite(ratio), ratio, 0.0))
    return k, n, order, excess


def change_point(requests, tokens, reference, context, run_info, info, tokens_only, flagged) -> dict:
    if context is not None:
        requests = pa.concat_tables([context[0], requests])
        tokens = pa.concat_tables([context[1], tokens])
        reference = pa.concat_tables([context[2], reference])
    rates = _exceedances(requests, tokens, reference, run_info, info, tokens_only)
    seqs = dict(zip(requests.column("request_id").to_pylist(), requests.column("seq").to_pylist()))
    if rates is not None and rates[0].sum() > 0:
        k, n, order, _ = rates
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
