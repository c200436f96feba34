"""The run-level test: is the engine's distribution the reference's, beyond the floor its dtype explains?

Per-request verdicts catch a lie that is large in a few requests; this catches one that is small
everywhere (a quantized model under a full-precision name, a quantized KV cache, another fine-tune,
logprobs from another temperature), which a floor calibrated on the run itself would absorb.

Contract: `run_level_test(joined, tokens, reference, requests, floor, sampling, alpha) -> dict`
(findings.json's `run_test`): tables in (`metrics.join_grouped`'s table and the run's tokens,
reference and requests), a dict out. `floor` is an expected floor (`lpf.analysis.floors`: a
calibration run's or the shipped table's, never this run's). Underneath, on numpy columns in
arrival order: `evidence_columns` -> `token_evidence(cols, floor, sampling)` -> `run_test(evidence,
floor, alpha)`; `decide(evidence, lo, hi, alpha)` is the decision over a window of tokens (the
detection benchmark calls it on many windows).

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
  sampling  (sampled runs at temperature <= 1, no top-k/top-p) how often the engine's token is the
            reference's top-1, against the probability the reference gives it at that temperature:
            a martingale (each expectation is taken on the actual prefix), so Freedman's
            inequality bounds both tails whatever the dependence between tokens; the margin is
            what the floor lets an honest engine's probabilities move.
Each exceedance count is tested against Binomial(n, NULL_RATE) (NULL_RATE / 2 per sign), exactly;
the p-value is the smallest sub-test's times the number of sub-tests run (Bonferroni). `different`
when p < alpha. `tokens_needed`: the smallest prefix (every length up to 200 tokens, then 5% steps)
at which the same decision already rejected. The floors reported are the median of |d| / s over
informative tokens (s >= S_MIN) and of the top-k spread: `effect_size` is observed / expected;
FAR_ABOVE or more is a finding of its own.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.floors import KAPPA, floor_stats

NULL_RATE = 0.01  # the share of tokens past the 99th percentile, before KAPPA: an upper bound
DEFAULT_ALPHA = 1e-6
FAR_ABOVE = 3.0  # observed floor this many times the expected one: a finding of its own
MIN_TOKENS = 10
SAMPLE = 250_000  # the run's own floor statistics: on at most this many evenly spaced tokens
MARGIN_P = 0.01  # a position is contested when the reference's second choice has at least this probability
CHUNK = 1 << 18


def list_matrix(col, fill) -> np.ndarray:
    """A list column as an [n, k] matrix (k its longest list; short or null lists padded with `fill`)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    n = len(arr)
    if n == 0:
        return np.zeros((0, 0))
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    width = np.diff(offsets)
    if arr.null_count:
        width = np.where(arr.is_valid().to_numpy(zero_copy_only=False), width, 0)
    k = int(width.max()) if n else 0
    if k == 0 or values.size == 0:
        return np.full((n, 0), fill, dtype=values.dtype if values.size else np.float64)
    if int(width.min()) == k and not arr.null_count:
        return values[offsets[0]:offsets[0] + n * k].reshape(n, k)
    idx = offsets[:-1, None] + np.arange(k)
    return np.where(np.arange(k) < width[:, None], values[np.minimum(idx, values.size - 1)], fill)


def _row_index(table: pa.Table, keys: pa.Table) -> np.ndarray:
    """The row of `table` holding each (request_id, position) of `keys` (all present)."""
    if table.num_rows == keys.num_rows and table.column("position").equals(keys.column("position")) and \
            table.column("request_id").equals(keys.column("request_id")):
        return np.arange(keys.num_rows)
    left = keys.select(["request_id", "position"]).append_column("_k", pa.array(np.arange(keys.num_rows)))
    right = table.select(["request_id", "position"]).append_column("_t", pa.array(np.arange(table.num_rows)))
    j = left.join(right, keys=["request_id", "position"], join_type="inner").sort_by("_k")
    return j.column("_t").to_numpy()


def evidence_columns(joined: pa.Table, tokens: pa.Table, reference: pa.Table, requests: pa.Table) -> dict:
    """The `token_evidence` inputs for every row of `joined`, in arrival order (request `seq`, then
    position). Top-k lists come from `tokens` / `reference` by key (Arrow joins carry no lists)."""
    order = _arrival_order(joined, requests)
    pick = (lambda a: a) if order is None else (lambda a: a[order])  # noqa: E731  (None: already in order)
    cols = {name: pick(joined.column(name).to_numpy())
            for name in ("token_id", "engine_logprob", "ref_logprob", "ref_top1_id", "ref_top1_logprob")}
    r = pick(_row_index(reference, joined))
    cols["ref_topk_ids"] = _rows(list_matrix(reference.column("ref_topk_ids"), -1), r)
    cols["ref_topk_logprobs"] = _rows(list_matrix(reference.column("ref_topk_logprobs"), -np.inf), r)
    if "engine_topk_ids" in tokens.column_names:
        ids = list_matrix(tokens.column("engine_topk_ids"), -1)
        if ids.shape[1]:
            t = pick(_row_index(tokens, joined))
            cols["engine_topk_ids"] = _rows(ids, t)
            cols["engine_topk_logprobs"] = _rows(list_matrix(tokens.column("engine_topk_logprobs"), -np.inf), t)
    cols["order"] = np.arange(joined.num_rows) if order is None else order
    return cols


def _rows(matrix: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """matrix[rows], without the copy when `rows` is 0..n-1."""
    if len(rows) == len(matrix) and (len(rows) == 0 or (rows[0] == 0 and rows[-1] == len(rows) - 1
                                                         and bool(np.all(np.diff(rows) == 1)))):
        return matrix
    return matrix[rows]


def _arrival_order(joined: pa.Table, requests: pa.Table) -> np.ndarray | None:
    """The permutation of `joined` into (request seq, position) order; None when it is in order."""
    seq_of = pc.index_in(joined.column("request_id"), value_set=requests.column("request_id").combine_chunks())
    seq = requests.column("seq").to_numpy()[seq_of.fill_null(0).to_numpy(zero_copy_only=False)]
    pos = joined.column("position").to_numpy()
    if len(seq) < 2:
        return None
    ds = np.diff(seq)
    if bool(np.all((ds > 0) | ((ds == 0) & (np.diff(pos) > 0)))):
        return None
    return np.lexsort((pos, seq))


def run_level_test(joined: pa.Table, tokens: pa.Table, reference: pa.Table, requests: pa.Table, floor: dict,
             sampling: dict, alpha: float = DEFAULT_ALPHA) -> dict:
    """findings.json's `run_test` from the run's tables."""
    cols = evidence_columns(joined, tokens, reference, requests)
    return run_test(token_evidence(cols, floor, sampling), floor, alpha)


def engine_floor(cols: dict) -> dict:
    """`floors.floor_stats` of the engine against the reference (`evidence_columns`' arrays)."""
    s = sensitivity(cols["ref_logprob"], cols["token_id"], cols["ref_topk_ids"], cols["ref_topk_logprobs"])
    topk = topk_spread(cols["engine_topk_ids"], cols["engine_topk_logprobs"], cols["ref_topk_ids"],
                       cols["ref_topk_logprobs"]) if "engine_topk_ids" in cols else None
    return floor_stats(cols["engine_logprob"] - cols["ref_logprob"], s, topk)


def calibration_floor(cols: dict, joined: pa.Table, calibration: pa.Table) -> dict | None:
    """`floors.floor_stats` of a calibration run (the reference again at the engine's dtype) against
    the reference, on the engine's tokens: what an honest implementation at that dtype departs by.
    None when the two share no token."""
    keys = joined.select(["request_id", "position"]).take(pa.array(cols["order"]))
    if keys.num_rows == calibration.num_rows:
        pos, r = np.arange(keys.num_rows), _row_index(calibration, keys) if calibration.num_rows else None
    else:  # a partial calibration run: the tokens it scored
        both = keys.append_column("_k", pa.array(np.arange(keys.num_rows))).join(
            calibration.select(["request_id", "position"]).append_column("_c", pa.array(np.arange(calibration.num_rows))),
            keys=["request_id", "position"], join_type="inner").sort_by("_k")
        pos, r = both.column("_k").to_numpy(), both.column("_c").to_numpy()
    if r is None or not len(pos):
        return None
    ref_ids, ref_lp = cols["ref_topk_ids"][pos], cols["ref_topk_logprobs"][pos]
    s = sensitivity(cols["ref_logprob"][pos], cols["token_id"][pos], ref_ids, ref_lp)
    topk = topk_spread(list_matrix(calibration.column("ref_topk_ids"), -1)[r],
                       list_matrix(calibration.column("ref_topk_logprobs"), -np.inf)[r], ref_ids, ref_lp)
    return floor_stats(calibration.column("ref_logprob").to_numpy()[r] - cols["ref_logprob"][pos], s, topk)


def sensitivity(ref_logprob: np.ndarray, token: np.ndarray, ref_ids: np.ndarray, ref_lp: np.ndarray) -> np.ndarray:
    """s per token: how far one nat of logit error moves the token's logprob (see the module doc)."""
    one_minus = -np.expm1(np.minimum(ref_logprob, 0.0))
    # p_j^2 = exp(2 lp_j), in float32: s needs no more precision than the top-k lists have
    sq = np.exp(2 * ref_lp.astype(np.float32))
    sq[(ref_ids == token[:, None]) | (ref_ids < 0)] = 0.0
    return np.sqrt(one_minus**2 + sq.sum(axis=1, dtype=np.float64))


def _aligned_topk(eng_ids, eng_lp, ref_ids) -> np.ndarray:
    """[n, k_ref] float32: the engine's logprob of each of the reference's top-k ids (NaN where the
    engine's top-k lacks it). Rows whose two lists hold the same ids in the same order (most rows:
    small errors rarely reorder a top-k) are taken as they are; only the others are matched id by id."""
    n, kr = ref_ids.shape
    valid = ref_ids >= 0
    if eng_ids.shape[1] == kr:
        same = ((eng_ids == ref_ids) | ~valid).all(axis=1)
        out = np.where(valid, eng_lp, np.nan).astype(np.float32)
        rest = np.flatnonzero(~same)
    else:
        out = np.full((n, kr), np.nan, dtype=np.float32)
        rest = np.arange(n)
    for lo in range(0, rest.size, CHUNK):
        rows = rest[lo:lo + CHUNK]
        ei, el, ri = eng_ids[rows], eng_lp[rows].astype(np.float32), ref_ids[rows]
        match = (ri[:, :, None] == ei[:, None, :]) & (ri[:, :, None] >= 0)
        at = np.take_along_axis(el, match.argmax(axis=2), axis=1)
        out[rows] = np.where(match.any(axis=2), at, np.nan)
    return out


def topk_spread(eng_ids, eng_lp, ref_ids, ref_lp, details: bool = True) -> dict:
    """Per position, over the ids both top-k lists hold: `w`, the sample standard deviation of engine
    - reference logprob over them (NaN below 2 shared), and `shared`, their count; with `details`
    also `kl`, KL(reference || engine) on that support renormalised (NaN below 2), and `margin`, how
    far the engine moved the reference's top-2 margin (NaN unless both of the reference's top two
    are shared and the second has p >= MARGIN_P: a contested position, where a greedy flip can
    happen). Float32 throughout: the top-k lists are float32."""
    e = _aligned_topk(eng_ids, eng_lp, ref_ids)
    rl = ref_lp.astype(np.float32)
    x = e - rl  # NaN where the engine lacks the id (or the reference's list is short)
    has = ~np.isnan(x)
    np.copyto(x, 0.0, where=~has)
    ones = np.ones(x.shape[1], dtype=np.float32)  # row sums as a matrix-vector product: numpy's
    m = (has.astype(np.float32) @ ones).astype(np.int64)  # reductions over a short axis are slow
    ok = m >= 2
    mean = (x @ ones) / np.maximum(m, 1)
    x -= mean[:, None]  # centred: the same spread and KL, no overflow
    np.copyto(x, 0.0, where=~has)
    w = np.sqrt(((x * x) @ ones) / np.maximum(m - 1, 1))
    out = {"w": np.where(ok, w, np.nan), "shared": m}
    if not details:
        return out
    # KL(p_S || q_S) = log sum p_S e^x - sum p_S x, with p_S the reference renormalised over S
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        rs = np.where(has, rl, -np.inf)
        p = np.exp(rs - rs.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        div = np.log((p * np.exp(x)).sum(axis=1)) - (p * x).sum(axis=1)
    out["kl"] = np.where(ok, np.maximum(div, 0.0), np.nan)
    out["margin"] = np.full(len(e), np.nan)
    if e.shape[1] >= 2:  # the error of the engine's margin between the reference's first and second choices
        both = has[:, 0] & has[:, 1] & (rl[:, 1] >= math.log(MARGIN_P))
        with np.errstate(invalid="ignore"):
            out["margin"] = np.where(both, np.abs((e[:, 0] - e[:, 1]) - (rl[:, 0] - rl[:, 1])), np.nan)
    return out


def token_evidence(cols: dict, floor: dict, sampling: dict) -> dict:
    """Per-token evidence arrays (in the order of `cols`) against `floor`.

    `cols`: token_id, engine_logprob, ref_logprob, ref_top1_id, ref_top1_logprob, ref_topk_ids and
    ref_topk_logprobs ([n, k] matrices, ids -1 where a list is short), optionally engine_topk_ids and
    engine_topk_logprobs. `sampling`: temperature, top_k, top_p of the run."""
    tok = np.asarray(cols["token_id"])
    eng = np.asarray(cols["engine_logprob"], dtype=np.float64)
    ref = np.asarray(cols["ref_logprob"], dtype=np.float64)
    ref_ids, ref_lp = cols["ref_topk_ids"], cols["ref_topk_logprobs"]
    d = eng - ref
    finite = np.isfinite(d)
    s = sensitivity(ref, tok, ref_ids, ref_lp)
    tau = KAPPA * (floor["token"]["q99"] * s + floor["settled"]["q99"])
    with np.errstate(invalid="ignore"):
        over = ~finite | (d > tau)  # a missing logprob is never within the floor
        under = finite & (d < -tau)
    temperature = float(sampling.get("temperature") or 0.0)
    if temperature == 0:
        margin = np.asarray(cols["ref_top1_logprob"], dtype=np.float64) - ref
        flip = (tok != np.asarray(cols["ref_top1_id"])) & (margin > floor["tie_margin"])
    else:
        flip = np.zeros(len(tok), dtype=bool)
    ev = {"n": len(tok), "d": d, "s": s, "over": over, "under": under, "flip": flip,
          "logprob": over | under | flip}
    if "engine_topk_ids" in cols:
        spread = topk_spread(cols["engine_topk_ids"], cols["engine_topk_logprobs"], ref_ids, ref_lp, details=False)
        has = spread["shared"] >= 2
        ev.update(w=spread["w"], has_topk=has, topk=has & (spread["w"] > KAPPA * floor["topk"]["q99"]),
                  cols=cols)
    if 0 < temperature <= 1 and not sampling.get("top_k") and (sampling.get("top_p") or 1.0) >= 1.0:
        ev.update(_sampling_evidence(tok, ref, cols, temperature, s, floor))
    return ev


def _sampling_evidence(tok, ref, cols, temperature, s, floor) -> dict:
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
    tail_scaled = tail * np.exp((inv - 1.0) * np.log(np.maximum(pk, 1e-300)) - inv * top1) if temperature < 1 else \
        tail / np.exp(top1)
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
def log_binom_sf(k: int, n: int, p: float) -> float:
    """log P(X >= k), X ~ Binomial(n, p), exactly (0.0, i.e. P = 1, at or below the mean)."""
    if k <= 0 or k <= n * p:
        return 0.0
    if k > n:
        return -math.inf
    lg = math.lgamma
    log_first = lg(n + 1) - lg(k + 1) - lg(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    total, i, log_term = 0.0, k, 0.0  # terms relative to the first; ratios fall as i grows
    while i < n:
        j = np.arange(i, min(n, i + 4096))
        logs = log_term + np.cumsum(np.log((n - j) / (j + 1.0)) + math.log(p / (1 - p)))
        total += float(np.exp(logs).sum())
        log_term = float(logs[-1])
        i = int(j[-1]) + 1
        if log_term < math.log(1e-18) + math.log1p(total):
            break
    return min(0.0, log_first + math.log1p(total))


def _freedman(excess: float, variance: float) -> float:
    """log of Freedman's bound on P(martingale sum >= excess | predictable variance <= variance)."""
    if excess <= 0:
        return 0.0
    return -excess**2 / (2.0 * (variance + excess / 3.0))


def decide(ev: dict, lo: int, hi: int, alpha: float = DEFAULT_ALPHA) -> dict:
    """The test over tokens lo..hi of the evidence: {result, p_value, log10_p_value, test, statistic,
    n_tokens, tests}."""
    n = hi - lo
    tests: dict[str, dict] = {}

    def count(name, key, rate, total=n):
        k = int(np.count_nonzero(ev[key][lo:hi]))
        tests[name] = {"k": k, "n": int(total), "null_rate": rate, "log_p": log_binom_sf(k, int(total), rate)}

    count("logprob", "logprob", NULL_RATE)
    count("over", "over", NULL_RATE / 2)
    count("under", "under", NULL_RATE / 2)
    if "topk" in ev:
        m = int(np.count_nonzero(ev["has_topk"][lo:hi]))
        if m:
            count("topk", "topk", NULL_RATE, m)
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
        return {"result": None, "reason": f"{n} scored tokens (the test needs {MIN_TOKENS})", "n_tokens": n,
                "p_value": None, "log10_p_value": None, "test": None, "statistic": None, "tests": tests}
    best = min(tests, key=lambda t: tests[t]["log_p"])
    log_p = min(0.0, tests[best]["log_p"] + math.log(len(tests)))
    t = tests[best]
    statistic = t["k"] / t["n"] if t["n"] else 0.0
    for v in tests.values():
        v["log10_p"] = v.pop("log_p") / math.log(10)
    return {"result": "different" if log_p < math.log(alpha) else "same", "n_tokens": n,
            "p_value": math.exp(log_p), "log10_p_value": log_p / math.log(10), "test": best,
            "statistic": statistic, "tests": tests}


def tokens_needed(ev: dict, alpha: float = DEFAULT_ALPHA) -> int | None:
    """The smallest prefix (every length to 200, then 5% steps) at which the test rejects."""
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
    spread = None
    if "w" in ev:
        c = ev["cols"]
        spread = topk_spread(c["engine_topk_ids"][rows], c["engine_topk_logprobs"][rows], c["ref_topk_ids"][rows],
                             c["ref_topk_logprobs"][rows])
    return floor_stats(ev["d"][rows], ev["s"][rows], spread)


def run_test(ev: dict, floor: dict, alpha: float = DEFAULT_ALPHA) -> dict:
    """findings.json's `run_test` over all scored tokens of `ev` (arrival order)."""
    out = decide(ev, 0, ev["n"], alpha)
    seen = observed_floor(ev)
    keep = lambda f: {"token": dict(f["token"]), "settled": dict(f["settled"]),  # noqa: E731
                      "topk": dict(f["topk"]) if f.get("topk") else None}
    out["floors"] = {"expected": keep(floor), "observed": keep(seen)}
    out["expected_floor"], out["observed_floor"] = floor["token"]["q99"], seen["token"]["q99"]
    out["effect_size"] = _ratio(out["observed_floor"], out["expected_floor"])
    topk_ratio = _ratio((seen.get("topk") or {}).get("q99"), (floor.get("topk") or {}).get("q99"))
    out["topk_effect_size"] = topk_ratio
    ratios = [r for r in (out["effect_size"], topk_ratio) if r is not None]
    out["floor_far_above_expected"] = bool(ratios) and max(ratios) >= FAR_ABOVE
    out["tokens_needed"] = tokens_needed(ev, alpha) if out["result"] == "different" else None
    out.update(alpha=alpha, kappa=KAPPA, null_rate=NULL_RATE, floor_source=floor.get("source"),
               floor_pair=floor.get("pair"), floor_detail=floor.get("detail"))
    out["sentence"] = _sentence(out)
    out["floor_sentence"] = _floor_sentence(out, floor) if out["floor_far_above_expected"] else None
    return out


def _sentence(r: dict) -> str:
    pair = (r.get("floor_pair") or "?").replace("/", " vs ")
    floors = f"observed floor {_g(r['observed_floor'])} vs expected {_g(r['expected_floor'])}"
    if r["effect_size"] is not None and math.isfinite(r["effect_size"]):
        floors += f", {r['effect_size']:.2g}x"
    if r["result"] is None:
        return f"run-level test not decided: {r.get('reason')}"
    if r["result"] == "same":
        return (f"same: within what {pair} explains ({floors}; p = {_p(r)} over "
                f"{r['n_tokens']} scored tokens)")
    t = r["tests"][r["test"]]
    what = {"logprob": "tokens whose logprob error is past", "over": "tokens the engine overrates past",
            "under": "tokens the engine underrates past", "topk": "positions whose top-k logprobs spread past",
            "sampling": "tokens sampled as the reference's top-1 (the temperature's share differs) past"}[r["test"]]
    past = f"{t['k']}/{t['n']} {what} {r['kappa']:g}x the expected 99th percentile (at most " \
           f"{100 * t.get('null_rate', r['null_rate']):g}% expected)" if r["test"] != "sampling" else \
           f"{t['k']}/{t['n']} tokens were the reference's top-1 where {t['expected'][0]:.0f}..{t['expected'][1]:.0f} were expected"
    return (f"different: beyond what {pair} explains ({floors}); {past}; p = {_p(r)}, "
            f"rejected after {r['tokens_needed']} tokens")


def _floor_sentence(r: dict, floor: dict) -> str:
    token, topk = r["effect_size"], r["topk_effect_size"]
    name, ratio = ("top-k spread", topk) if topk is not None and (token is None or topk > token) else ("token error", token)
    times = f"{ratio:.2g}x" if math.isfinite(ratio) else "far above"
    return (f"this run's own floor ({name}, 99th percentile) is {times} the floor expected for "
            f"{r.get('floor_pair')} ({floor.get('detail') or floor.get('source')}): the engine does not compute "
            f"what an honest implementation at its dtype computes")


def _g(x) -> str:
    return "-" if x is None else f"{x:.2g}"


def _p(r: dict) -> str:
    """The p-value, as a power of ten where a float cannot hold it."""
    return _g(r["p_value"]) if r["p_value"] and r["p_value"] > 1e-300 else f"1e{r['log10_p_value']:.0f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return float(a / b) if b > 0 else (None if a == 0 else math.inf)
