"""The run-level test: is the engine's distribution the reference's, beyond the floor its dtype explains?

Per-request verdicts catch a lie that is large in a few requests; this catches one that is small
everywhere (a quantized model under a full-precision name, a quantized KV cache, another fine-tune,
logprobs from another temperature), which a floor calibrated on the run itself would absorb.

Contract: `run_level_test(joined, tokens, reference, requests, floor, sampling, alpha, cols, starts)
-> dict` (findings.json's `run_test`): tables in (`metrics.join_grouped`'s table, its request starts
when the caller has them, and the run's tokens, reference and requests), a dict out. `floor` is an expected floor (`lpf.analysis.floors`: a
calibration run's or the shipped table's, never this run's). Underneath, on numpy columns in
arrival order: `token_evidence.evidence_columns` -> `token_evidence(cols, floor, sampling)` ->
`run_test(evidence, floor, alpha)`; `decide(evidence, lo, hi, alpha)` is the decision over a window
of tokens (the detection benchmark calls it on many windows).

Per scored token t, with d = engine - reference logprob of the engine's token and p_j the
reference's top-k probabilities, the sensitivity s = sqrt((1 - p_t)^2 + sum_{j != t} p_j^2) is how
much a logit error of one nat moves that logprob (a token both sides are sure of barely moves).
Under an honest implementation d ~ sigma * s, sigma the dtype pair's logit error. Three kinds of
evidence, each judged against the expected floor widened by KAPPA (kernels differ between honest
implementations of one dtype; KAPPA times the 99th percentile is what they stay under):
  logprob   |d| > tau = KAPPA * (token.q99 * s + settled.q99): the token's error is beyond what the
            dtype explains; greedy runs also count a flip past the expected tie margin. Tested as a
            whole (`logprob`) and by sign (`over`: d > tau, `under`: d < -tau; an overconfident or
            underconfident engine shows on one side only, at half the null rate).
  topk      (when the engine reports top-k) the spread w of (engine - reference) logprobs over the
            ids both top-k lists share, beyond KAPPA * topk.q99: a logit error seen at every
            position, even where the engine's own token is certain. KL on the shared support is
            reported, not tested (it is weighted by probability, so it too vanishes where the
            reference is sure).
  topk_bulk (with topk) the same spreads past BULK_KAPPA x the floor's median, tested against BULK_NULL:
            the bulk of the distribution, where a substitution shows at almost every position while
            the tail test waits for the few past the 99th percentile (bfloat16 + 4-bit weights: 80%
            of positions past it, rejected after 29 tokens where the tail test needed 105; honest
            bfloat16 engines measured at 0.6% on zoo:stress and 4.8% on 64-token prose).
  sampling  (sampled runs at temperature <= 1, no top-k/top-p) how often the engine's token is the
            reference's top-1, against the probability the reference gives it at that temperature:
            a martingale (each expectation is taken on the actual prefix), so Freedman's
            inequality bounds both tails whatever the dependence between tokens; the margin is
            what the floor lets an honest engine's probabilities move.
Each exceedance count is tested against Binomial(n, NULL_RATE) (NULL_RATE / 2 per sign; BULK_NULL for
topk_bulk), exactly;
the p-value is the smallest sub-test's times the number of sub-tests run (Bonferroni). `different`
when p < alpha. `tokens_needed`: the smallest prefix (every length up to 200 tokens, then 5% steps)
at which the same decision already rejected. A run of more than MAX_TOKENS scored tokens is tested on
every k-th token in arrival order (`sampled_every`: k; `n_tokens` counts the tokens used), which
bounds the cost and still covers the whole run. `expected_floor` / `observed_floor` are the 99th
percentile of |d| / s over informative tokens (s >= departure.S_MIN) of the floor and of this run
(`floors` holds every component of both); `effect_size` is observed / expected (`topk_effect_size`
the same for the top-k spread), and FAR_ABOVE or more on either is a finding of its own.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from lpf.analysis.token_evidence import evidence_columns, sensitivity, topk_spread
from lpf.analysis.stats import binom_log_tail
from lpf.analysis.departure import HONEST_MARGIN, departure, departure_needed, departure_units
from lpf.analysis.floors import KAPPA, floor_stats

NULL_RATE = 0.01  # the share of tokens past the 99th percentile, before KAPPA: an upper bound
# the bulk test: an honest engine's share of positions whose top-k spread is past BULK_KAPPA x the floor's
# median stays far under BULK_NULL (the floor's median is the largest over the implementations measured;
# measured: honest bfloat16 engines 0.6-4.8%, bfloat16 + 4-bit weights 80%; docs/benchmarks.md)
BULK_KAPPA = 3.0
BULK_NULL = 0.25
DEFAULT_ALPHA = 1e-6
FAR_ABOVE = 3.0  # observed floor this many times the expected one: a finding of its own
MIN_TOKENS = 10
SAMPLE = 250_000  # the run's own floor statistics: on at most this many evenly spaced tokens
MAX_TOKENS = 2_000_000  # the test itself: on at most this many (p-values are astronomically small long before)


def run_level_test(
    joined: pa.Table,
    tokens: pa.Table,
    reference: pa.Table,
    requests: pa.Table,
    floor: dict,
    sampling: dict,
    alpha: float = DEFAULT_ALPHA,
    cols: dict | None = None,
    starts: np.ndarray | None = None,
) -> dict:
    """findings.json's `run_test` from the run's tables (`cols`: their `evidence_columns` over every
    token, when the caller already has them; else only the tokens the test reads are gathered)."""
    step = -(-joined.num_rows // MAX_TOKENS)  # a huge run: every step-th token (arrival order), all of it covered
    if cols is None:
        cols = evidence_columns(joined, tokens, reference, requests, every=step, starts=starts)
    elif step > 1:
        cols = {k: v[::step] for k, v in cols.items()}
    out = run_test(token_evidence(cols, floor, sampling), floor, alpha)
    out["sampled_every"] = step
    return out


EVIDENCE_BLOCK = 1 << 17  # rows a block: every value is a row's own, so blocks change none of them


def token_evidence(cols: dict, floor: dict, sampling: dict) -> dict:
    """Per-token evidence arrays (in the order of `cols`) against `floor`.

    `cols`: token_id, engine_logprob, ref_logprob, ref_top1_id, ref_top1_logprob, ref_topk_ids and
    ref_topk_logprobs ([n, k] matrices, ids -1 where a list is short), optionally engine_topk_ids and
    engine_topk_logprobs. `sampling`: temperature, top_k, top_p of the run. Computed in blocks of
    EVIDENCE_BLOCK rows (the temporaries of a block stay small and are reused; fresh whole-length
    ones cost a page fault per page, a huge-page compaction on a busy machine)."""
    n = len(cols["token_id"])
    if n <= EVIDENCE_BLOCK:
        return _token_evidence(cols, floor, sampling)
    rows = {k: v for k, v in cols.items() if k != "order"}
    parts = [
        _token_evidence({k: v[lo : lo + EVIDENCE_BLOCK] for k, v in rows.items()}, floor, sampling)
        for lo in range(0, n, EVIDENCE_BLOCK)
    ]
    ev = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k not in ("n", "cols", "floor")}
    ev["n"], ev["floor"] = n, parts[0]["floor"]
    if "cols" in parts[0]:
        ev["cols"] = cols
    return ev


def _token_evidence(cols: dict, floor: dict, sampling: dict) -> dict:
    tok = np.asarray(cols["token_id"])
    eng = np.asarray(cols["engine_logprob"], dtype=np.float64)
    ref = np.asarray(cols["ref_logprob"], dtype=np.float64)
    ref_ids, ref_lp = cols["ref_topk_ids"], cols["ref_topk_logprobs"]
    d = eng - ref
    finite = np.isfinite(d)
    s = sensitivity(ref, tok, ref_ids, ref_lp)
    tau = KAPPA * (floor["token"]["q99"] * s + floor["settled"]["q99"])
    no_lp = cols.get("no_logprob")
    with np.errstate(invalid="ignore"):
        # a NaN logprob is never within the floor; a token that came without one (`absent`) is no
        # logprob evidence at all, only its greedy flip below counts
        over = (~finite if no_lp is None else ~finite & ~no_lp) | (d > tau)
        under = finite & (d < -tau)
    temperature = float(sampling.get("temperature") or 0.0)
    if temperature == 0:
        margin = np.asarray(cols["ref_top1_logprob"], dtype=np.float64) - ref
        flip = (tok != np.asarray(cols["ref_top1_id"])) & (margin > floor["tie_margin"])
    else:
        flip = np.zeros(len(tok), dtype=bool)
    ev = {"n": len(tok), "d": d, "s": s, "over": over, "under": under, "flip": flip, "logprob": over | under | flip}
    if no_lp is not None:
        ev["absent"] = no_lp
    ev["floor"] = departure_units(floor)
    if "engine_topk_ids" in cols and (floor.get("topk") or {}).get("q99"):  # a floor without top-k tests none
        spread = topk_spread(cols["engine_topk_ids"], cols["engine_topk_logprobs"], ref_ids, ref_lp, details=False)
        has = spread["shared"] >= 2
        if no_lp is not None:
            has &= ~no_lp  # a token without a logprob is no top-k evidence either, whatever lists came with it
        ev.update(w=spread["w"], has_topk=has, topk=has & (spread["w"] > KAPPA * floor["topk"]["q99"]), cols=cols)
        if floor["topk"].get("median"):
            ev["topk_bulk"] = has & (spread["w"] > BULK_KAPPA * floor["topk"]["median"])
    if 0 < temperature <= 1 and not sampling.get("top_k") and (sampling.get("top_p") or 1.0) >= 1.0:
        ev.update(_sampling_evidence(tok, cols, temperature, floor))
    return ev


def _sampling_evidence(tok, cols, temperature, floor) -> dict:
    """Whether each token is the reference's top-1, the probability the reference gives that at the
    run's temperature (exact at 1; below 1, bounds from its top-k: each tail token has at most p_k), and
    the margin the floor allows an honest engine (its top-1 logprob may be off by tau)."""
    lp = cols["ref_topk_logprobs"].astype(np.float64)
    valid = cols["ref_topk_ids"] >= 0
    top1 = np.asarray(cols["ref_top1_logprob"], dtype=np.float64)
    inv = 1.0 / temperature
    scaled = np.where(valid, np.exp(inv * (lp - top1[:, None])), 0.0)  # p_j^(1/T) / p_1^(1/T)
    mass = np.where(valid, np.exp(lp), 0.0).sum(axis=1)
    tail = np.clip(1.0 - mass, 0.0, 1.0)
    pk = np.where(valid, np.exp(lp), np.inf).min(axis=1)
    tail_scaled = (
        tail * np.exp((inv - 1.0) * np.log(np.maximum(pk, 1e-300)) - inv * top1)
        if temperature < 1
        else tail / np.exp(top1)
    )
    z_lo = scaled.sum(axis=1)
    hi = 1.0 / np.maximum(z_lo, 1.0)
    lo = 1.0 / (z_lo + tail_scaled)
    if temperature == 1:  # the probabilities sum to one: exactly the reference's top-1 probability
        lo = hi = np.exp(top1)
    is_top1 = tok == np.asarray(cols["ref_top1_id"])
    p1 = np.exp(top1)
    s1 = np.sqrt((1 - p1) ** 2 + np.maximum(np.where(valid, np.exp(2 * lp), 0.0).sum(axis=1) - p1**2, 0.0))
    allow = hi * np.expm1(KAPPA * (floor["token"]["q99"] * s1 + floor["settled"]["q99"]) * inv)
    return {"is_top1": is_top1, "p_top1_lo": lo, "p_top1_hi": hi, "p_top1_allow": allow}


# -- the decision -----------------------------------------------------------------------------------
def _freedman(excess: float, variance: float) -> float:
    """log of Freedman's bound on P(martingale sum >= excess | predictable variance <= variance)."""
    if excess <= 0:
        return 0.0
    return -(excess**2) / (2.0 * (variance + excess / 3.0))


def decide(ev: dict, lo: int, hi: int, alpha: float = DEFAULT_ALPHA) -> dict:
    """The test over tokens lo..hi of the evidence: {result, p_value, log10_p_value, test, statistic,
    n_tokens, tests}."""
    n = hi - lo
    tests: dict[str, dict] = {}

    def count(name, key, rate, total=n):
        k = int(np.count_nonzero(ev[key][lo:hi]))
        # one-sided: at or below the mean the test never rejects, and says so with P = 1
        log_p = 0.0 if k <= total * rate else binom_log_tail(k, int(total), rate)
        tests[name] = {"k": k, "n": int(total), "null_rate": rate, "log_p": log_p}

    count("logprob", "logprob", NULL_RATE)
    count("over", "over", NULL_RATE / 2)
    count("under", "under", NULL_RATE / 2)
    if "topk" in ev:
        m = int(np.count_nonzero(ev["has_topk"][lo:hi]))
        if m:
            count("topk", "topk", NULL_RATE, m)
            if "topk_bulk" in ev:
                count("topk_bulk", "topk_bulk", BULK_NULL, m)
    if "is_top1" in ev:
        o = float(np.count_nonzero(ev["is_top1"][lo:hi]))
        e_lo, e_hi = float(ev["p_top1_lo"][lo:hi].sum()), float(ev["p_top1_hi"][lo:hi].sum())
        allow = float(ev["p_top1_allow"][lo:hi].sum())
        var = float((ev["p_top1_hi"][lo:hi] * (1 - ev["p_top1_lo"][lo:hi])).clip(0, 0.25).sum())
        log_p = min(_freedman(o - e_hi - allow, var), _freedman(e_lo - allow - o, var)) + math.log(2)
        tests["sampling"] = {"k": int(o), "n": n, "expected": [e_lo, e_hi], "log_p": min(0.0, log_p)}
    if n < MIN_TOKENS:
        for v in tests.values():
            v["log10_p"] = v.pop("log_p") / math.log(10)
        return {
            "result": None,
            "reason": f"{n} scored tokens (the test needs {MIN_TOKENS})",
            "n_tokens": n,
            "p_value": None,
            "log10_p_value": None,
            "test": None,
            "statistic": None,
            "tests": tests,
        }
    best = min(tests, key=lambda t: tests[t]["log_p"])
    log_p = min(0.0, tests[best]["log_p"] + math.log(len(tests)))
    t = tests[best]
    statistic = t["k"] / t["n"] if t["n"] else 0.0
    significant = log_p < math.log(alpha)
    size = _departure(ev, lo, hi, best) if significant else None
    for v in tests.values():
        v["log10_p"] = v.pop("log_p") / math.log(10)
    return {
        "result": "different" if significant and size["beyond"] else "same",
        "n_tokens": n,
        "p_value": math.exp(log_p),
        "log10_p_value": log_p / math.log(10),
        "test": best,
        "statistic": statistic,
        "tests": tests,
        "departure": size,
    }


def _departure(ev: dict, lo: int, hi: int, best: str) -> dict:
    """Whether a significant window is another model or other honest arithmetic: its departure per
    component against what it must reach (`departure.departure_needed`), the largest first. A sampling-rate
    departure is no arithmetic's, so it stands on its significance. Greedy flips past the tie margin
    are not a way past the gate: an honest engine whose logit error is 30x the floor's moves near-ties
    30x too (a flip that makes a request wrong is the per-request verdicts' to call)."""
    units = ev.get("floor") or {}
    w = ev["w"][lo:hi][ev["has_topk"][lo:hi]] if "w" in ev else None
    gone = ev["absent"][lo:hi] if "absent" in ev else None
    seen = departure(ev["d"][lo:hi], ev["s"][lo:hi], w, units, gone)
    need = departure_needed(units)
    past = sorted((c for c in seen if seen[c] is not None and seen[c] >= need[c]), key=lambda c: -seen[c] / need[c])
    why = "sampling" if best == "sampling" else past[0] if past else None
    return {"seen": seen, "needed": need, "beyond": why is not None, "by": why}


def tokens_needed(ev: dict, alpha: float = DEFAULT_ALPHA) -> int | None:
    """The smallest prefix (every length to 200, then 5% steps) at which the test rejects."""
    return first_rejecting_prefix(ev, decide, alpha)


def first_rejecting_prefix(ev: dict, decide, alpha: float) -> int | None:
    """The smallest prefix of `ev`'s tokens (every length from MIN_TOKENS to 200, then 5% steps) at which
    `decide(ev, 0, size, alpha)` (this test's or `token_test`'s) says "different"; None when none does."""
    n = ev["n"]
    sizes = list(range(MIN_TOKENS, min(n, 200) + 1))
    while sizes and sizes[-1] < n:
        sizes.append(min(n, max(sizes[-1] + 1, int(sizes[-1] * 1.05))))
    for size in sizes:
        if decide(ev, 0, size, alpha)["result"] == "different":
            return size
    return None


def observed_floor(ev: dict) -> dict:
    """The run's own floors, measured as the expected ones are (`floors.floor_stats`; on at most
    SAMPLE evenly spaced tokens, as the quantiles need no more)."""
    rows = slice(None, None, max(1, ev["n"] // SAMPLE))
    if "absent" in ev:  # tokens that came back without a logprob: left out
        rows = np.arange(ev["n"])[rows][~ev["absent"][rows]]
    spread = None
    if "w" in ev:
        c = ev["cols"]
        spread = topk_spread(
            c["engine_topk_ids"][rows],
            c["engine_topk_logprobs"][rows],
            c["ref_topk_ids"][rows],
            c["ref_topk_logprobs"][rows],
        )
    return floor_stats(ev["d"][rows], ev["s"][rows], spread)


def run_test(ev: dict, floor: dict, alpha: float = DEFAULT_ALPHA) -> dict:
    """findings.json's `run_test` over all scored tokens of `ev` (arrival order)."""
    out = decide(ev, 0, ev["n"], alpha)
    seen = observed_floor(ev)

    def keep(f):
        return {
            "token": dict(f["token"]),
            "settled": dict(f["settled"]),
            "topk": dict(f["topk"]) if f.get("topk") else None,
        }

    out["floors"] = {"expected": keep(floor), "observed": keep(seen)}
    out["expected_floor"], out["observed_floor"] = floor["token"]["q99"], seen["token"]["q99"]
    out["effect_size"] = _ratio(out["observed_floor"], out["expected_floor"])
    topk_ratio = _ratio((seen.get("topk") or {}).get("q99"), (floor.get("topk") or {}).get("q99"))
    out["topk_effect_size"] = topk_ratio
    need = departure_needed(ev["floor"])
    out["floor_far_above_expected"] = any(
        r is not None and r >= max(FAR_ABOVE, need[c]) for c, r in (("token", out["effect_size"]), ("topk", topk_ratio))
    )
    out["tokens_needed"] = tokens_needed(ev, alpha) if out["result"] == "different" else None
    out.update(
        alpha=alpha,
        kappa=KAPPA,
        null_rate=NULL_RATE,
        floor_source=floor.get("source"),
        floor_pair=floor.get("pair"),
        floor_detail=floor.get("detail"),
    )
    out["sentence"] = _sentence(out)
    out["arithmetic_sentence"] = _arithmetic_sentence(out)
    configured = floor.get("configured")
    if configured and out["result"] == "same":  # a configuration's own floor explains it: said, never hidden
        size = out["effect_size"]
        out["configured_sentence"] = (
            f"departs from the reference as {configured['why']} does"
            + (f" ({size:.2g}x its floor)" if size is not None and math.isfinite(size) else "")
            + (f": {configured['inferred']}" if configured.get("inferred") else ": configured, not a fault")
        )
    out["floor_sentence"] = _floor_sentence(out, floor) if out["floor_far_above_expected"] else None
    return out


def _sentence(r: dict) -> str:
    pair = (r.get("floor_pair") or "?").replace("/", " vs ")
    floors = f"observed floor {_g(r['observed_floor'])} vs expected {_g(r['expected_floor'])} nats of logit error"
    if r["effect_size"] is not None and math.isfinite(r["effect_size"]):
        floors += f", {r['effect_size']:.2g}x"
    if r["result"] is None:
        return f"run-level test not decided: {r.get('reason')}"
    if r["result"] == "same" and r.get("departure"):
        return (
            f"same: other honest arithmetic at {pair}, not another model ({floors}; over {r['n_tokens']} scored tokens)"
        )
    if r["result"] == "same":
        return f"same: within what {pair} explains ({floors}; p = {_p(r)} over {r['n_tokens']} scored tokens)"
    t = r["tests"][r["test"]]
    what = {
        "logprob": "tokens whose logprob error is past",
        "over": "tokens the engine overrates past",
        "under": "tokens the engine underrates past",
        "topk": "positions whose top-k logprobs spread past",
        "topk_bulk": "positions whose top-k logprobs spread past",
        "sampling": "tokens sampled as the reference's top-1 (the temperature's share differs) past",
    }[r["test"]]
    times, where = (BULK_KAPPA, "median") if r["test"] == "topk_bulk" else (r["kappa"], "99th percentile")
    past = (
        f"{t['k']}/{t['n']} {what} {times:g}x the expected {where} (at most "
        f"{100 * t.get('null_rate', r['null_rate']):g}% expected)"
        if r["test"] != "sampling"
        else f"{t['k']}/{t['n']} tokens were the reference's top-1 where {t['expected'][0]:.0f}..{t['expected'][1]:.0f} were expected"
    )
    return (
        f"different: beyond what {pair} explains ({floors}); {past}; p = {_p(r)}, "
        f"rejected after {r['tokens_needed']} tokens"
    )


def _arithmetic_sentence(r: dict) -> str | None:
    """A significant departure too small to be another model: said, as the harmless finding it is."""
    size = r.get("departure")
    if r["result"] != "same" or not size:
        return None
    seen = {c: v for c, v in size["seen"].items() if v is not None}
    if not seen:
        return None
    c = max(seen, key=lambda k: seen[k] / size["needed"][k])
    what = {"token": "token error", "settled": "rounding of settled tokens", "topk": "top-k spread"}[c]
    dtype = (r.get("floor_pair") or "?").split("/")[0]
    return (
        f"this engine's {dtype} arithmetic differs measurably from the reference's (p = {_p(r)}): its {what} is "
        f"{seen[c]:.2g}x the floor's 99th percentile, under the {size['needed'][c]:.2g}x another model needs "
        f"(at least {HONEST_MARGIN:g}x what honest implementations measured): other kernels, harmless"
    )


def _floor_sentence(r: dict, floor: dict) -> str:
    token, topk = r["effect_size"], r["topk_effect_size"]
    name, ratio = (
        ("top-k spread", topk) if topk is not None and (token is None or topk > token) else ("token error", token)
    )
    times = f"{ratio:.2g}x" if math.isfinite(ratio) else "far above"
    return (
        f"this run's own floor ({name}, 99th percentile) is {times} the floor expected for "
        f"{r.get('floor_pair')} ({floor.get('detail') or floor.get('source')}): the engine does not compute "
        f"what an honest implementation at its dtype computes"
        + (f" (that floor was measured over {floor['settings']})" if floor.get("settings") else "")
    )


def _g(x) -> str:
    return "-" if x is None else f"{x:.2g}"


def _p(r: dict) -> str:
    """The p-value, as a power of ten where a float cannot hold it."""
    return _g(r["p_value"]) if r["p_value"] and r["p_value"] > 1e-300 else f"1e{r['log10_p_value']:.0f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return float(a / b) if b > 0 else (None if a == 0 else math.inf)


# the pieces the tokens-only test (`token_test`) shares with this one
sampling_evidence = _sampling_evidence
freedman_log_bound = _freedman
