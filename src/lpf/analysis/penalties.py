"""Server-side sampling penalties, fitted from a greedy run's choices: what a server did to the logits.

Contract: `fit_penalty(tokens, reference, requests, tie, configured=None) -> dict | None` (pure: Arrow tables in,
plain data out). None when the run cannot say: not greedy (the caller's gate), no reference top-k, or
no raw-logit offset (`ref_logsumexp`, null in runs scored before it: a repetition penalty acts on the
raw logits' signs, which logprobs alone do not give). Otherwise the best-fitting model among

  repetition_penalty  a token already in the context (prompt + output; or, llama.cpp's default, its
                      last 64 tokens; or, llama-cpp-python's server, the output only) has its logit divided
                      by theta when positive, multiplied when negative (HF's, vLLM's and llama.cpp's semantics)
  presence_penalty    a token already in the output (or the context) loses alpha
  frequency_penalty   a token loses beta per earlier occurrence in the output

each on a grid (the kind: `_kind`; theta 0.5..2 by 0.0025, alpha and beta -2..2 by 0.01; a pass on a grid
`penalty_evidence.COARSE` times coarser first), judged by how many positions' engine tokens it predicts: the
engine's token must be the argmax (within `tie`: what the engine's dtype moves a near tie by, the run's tie
margin as findings passes it) of the penalised raw logits over the reference's top-k plus the token (logit =
reference logprob + ref_logsumexp; the engine runs the reference's model, so its logits are the reference's).
Tokens outside the top-k are not candidates. Only positions where a candidate was already seen can change
(`penalty_evidence`: at most MAX_POSITIONS of them: a bigger run is fitted on every k-th request); the fit is
the value at the middle of the best plateau (its interval: the values around it whose agreement an exact sign
test cannot tell from it, `_interval`), and it is reported when it turns at least MIN_EXPLAINED of the neutral
value's greedy flips into agreements, significantly (p < MAX_P, twice the smaller of: an exact sign test of
explained flips against lost agreements; `_coincidence`, how likely the flips meet the fit's changes by chance
among the informative positions). A penalty the server states (`configured`:
`configured_penalties` of the manifest's sampling defaults, e.g. llama-cpp-python's documented repeat_penalty 1.1
over its output) is one hypothesis fixed before the evidence: tested at its stated value with nothing fitted
(`_chance` over one set of choices), it is named (`source` "stated") when it turns at least one flip into an
agreement, more than it loses, and its changes meet the flips beyond chance (p < INTERVAL_ALPHA), where the fit
alone names nothing (a handful of flips); beside a significant fit, the stated kind is named when the evidence
cannot tell it from the best one (at the value the evidence gives it). Flips it does not predict stay
unexplained. The dict: {mechanism, scope, value, interval [lo, hi], explained (flips the fit turns into
agreements), flips (greedy flips where a candidate was seen), lost, p_value, source ("fitted" | "stated"),
stated (what the server said: {mechanism, scope, value, via, named}, or None), consistent (the other kinds,
each at its best value, that explain flips and that the evidence cannot tell from the one named: an exact sign
test over the positions where they differ, p >= INTERVAL_ALPHA), requests (ids with an explained flip),
explained_requests (those with no other flip: none the fit leaves, none where no candidate had been seen),
sentence}.
`lower_explained(summary, fit, clean_abs_diff) -> (summary, n)`: the `divergent` requests whose only flagged
tokens are flips the fit explains judged as the server's sampling (`noise`/`clean`, column `server_processing`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.penalty_evidence import LAST_N, evidence, fine_agreement
from lpf.analysis.stats import hypergeom_tail, sign_test

MIN_EXPLAINED = 2  # two flips each exactly where the fit puts one can be significant (`_coincidence`)
MAX_P = 1e-3
INTERVAL_ALPHA = 0.05  # the interval: values the evidence cannot tell from the fit at this level

# (mechanism, scope, grid, neutral value)
MODELS = (
    ("repetition_penalty", "context", np.round(np.arange(0.5, 2.0 + 1e-9, 0.0025), 6), 1.0),
    ("repetition_penalty", "last64", np.round(np.arange(0.5, 2.0 + 1e-9, 0.0025), 6), 1.0),
    ("presence_penalty", "output", np.round(np.arange(-2.0, 2.0 + 1e-9, 0.01), 6), 0.0),
    ("presence_penalty", "context", np.round(np.arange(-2.0, 2.0 + 1e-9, 0.01), 6), 0.0),
    ("frequency_penalty", "output", np.round(np.arange(-2.0, 2.0 + 1e-9, 0.01), 6), 0.0),
    # llama-cpp-python's server: its repeat_penalty (1.1 by default) over the tokens it generated only
    ("repetition_penalty", "output", np.round(np.arange(0.5, 2.0 + 1e-9, 0.0025), 6), 1.0),
)
_SCOPE_WORDS = {
    "context": "tokens already in the context",
    "last64": f"tokens among the last {LAST_N} of the context",
    "output": "tokens already in the output",
}


def configured_penalties(configuration: dict | None) -> list[dict]:
    """The penalties a server says it applies to a request that sets none (`configuration`: the manifest's
    `engine.configuration`; its `sampling_defaults` {name: value} read from the server), as MODELS' kinds:
    [{mechanism, scope, value, via}]. llama.cpp's `repeat_penalty` over its `penalty_scope` when the server names
    it (llama-cpp-python: "output"), else its `repeat_last_n` (LAST_N: `last64`; -1 or 0: the context); HF's and
    vLLM's `repetition_penalty` over the context; presence and frequency penalties over the output. Neutral
    values, and windows no kind covers, are left out."""
    block = ((configuration or {}).get("sampling_defaults") or {}) if isinstance(configuration, dict) else {}
    said = block.get("value") if isinstance(block, dict) else None
    if not isinstance(said, dict):
        return []
    via = block.get("via") or "the server's configuration"

    def number(key):
        v = said.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    out = []
    rep, last_n, scope = number("repeat_penalty"), number("repeat_last_n"), said.get("penalty_scope")
    if rep is not None and rep != 1.0:
        if scope not in _SCOPE_WORDS:
            scope = "last64" if last_n == LAST_N else "context" if last_n in (-1.0, 0.0) else None
        if scope is not None:
            out.append({"mechanism": "repetition_penalty", "scope": scope, "value": rep, "via": via})
    hf = number("repetition_penalty")
    if hf is not None and hf != 1.0:
        out.append({"mechanism": "repetition_penalty", "scope": "context", "value": hf, "via": via})
    for name in ("presence_penalty", "frequency_penalty"):
        v = number(name)
        if v is not None and v != 0.0:
            out.append({"mechanism": name, "scope": "output", "value": v, "via": via})
    return out


def fit_penalty(
    tokens: pa.Table,
    reference: pa.Table,
    requests: pa.Table,
    tie: float,
    n_rows: int | None = None,
    configured: list[dict] | None = None,
) -> dict | None:
    """`n_rows`: the whole run's scored rows with a log-sum-exp, when `tokens` holds only the requests
    that `request_stride(n_rows)` keeps (the streamed analysis gathers those): the same sample. `configured`:
    the penalties the server says it applies (`configured_penalties`)."""
    if "ref_logsumexp" not in reference.column_names or "ref_topk_ids" not in reference.column_names:
        return None
    ev = evidence(tokens, reference, requests, n_rows, tie)
    if ev is None:
        return None
    fits = []
    for mech, scope, grid, neutral in MODELS:
        agree = fine_agreement(ev, mech, scope, grid, neutral, tie)
        g0 = int(np.flatnonzero(grid == neutral)[0])
        counts = agree.sum(0)
        top = int(counts.max())
        lo, hi = _plateau(counts, top, g0)
        g = (lo + hi) // 2
        fits.append({"gain": top - int(counts[g0]), "mech": mech, "scope": scope, "grid": grid, "g": g, "agree": agree})
        fits[-1]["g0"] = g0
    stated = _stated(fits, configured or [])
    best = _kind(fits)
    if best is None or best["gain"] <= 0:
        best = None
    fitted = None
    if best is not None:
        flips = ~best["agree"][:, best["g0"]]
        n_exp, n_lost = _changes(best["agree"], best["g"], best["g0"])
        p = min(1.0, 2 * min(sign_test(n_exp, n_exp + n_lost), _coincidence(fits, flips, n_exp, n_lost)))
        if n_exp >= MIN_EXPLAINED and p < MAX_P:
            fitted = (best, best["g"], p)
    said = None
    for f, gi, entry in stated:  # the server's own word, tested as stated (one hypothesis, nothing fitted)
        n_exp, n_lost = _changes(f["agree"], gi, f["g0"])
        flips = ~f["agree"][:, f["g0"]]
        p = _chance(flips, n_exp, n_lost, 1)
        if n_exp >= 1 and n_exp > n_lost and p < INTERVAL_ALPHA:
            said = (f, gi, p, entry)
            break
    if fitted is not None:
        f, g, p = fitted
        if said is not None and (said[0] is f or _not_worse(said[0]["agree"][:, said[0]["g"]], f["agree"][:, g])):
            # the evidence supports the stated kind as well as the best one: the stated kind, at the value the
            # evidence gives it
            f, g = said[0], said[0]["g"]
        return _result(ev, fits, f, g, p, "fitted", _stated_block(stated, f))
    if said is None:
        return None
    f, gi, p, _ = said
    return _result(ev, fits, f, gi, p, "stated", _stated_block(stated, f))


def _stated(fits: list[dict], configured: list[dict]) -> list[tuple[dict, int, dict]]:
    """(the kind's fit, the stated value's grid index, the stated entry) of each configured penalty MODELS
    has a kind and grid point for."""
    out = []
    for entry in configured:
        for f in fits:
            if (f["mech"], f["scope"]) != (entry["mechanism"], entry["scope"]):
                continue
            gi = int(np.argmin(np.abs(f["grid"] - entry["value"])))
            if abs(float(f["grid"][gi]) - entry["value"]) <= 1e-6:
                out.append((f, gi, entry))
    return out


def _stated_block(stated: list[tuple[dict, int, dict]], named: dict) -> dict | None:
    """What the server said, beside the kind named: {mechanism, scope, value, via, named (is it the kind named)}."""
    if not stated:
        return None
    f, _, entry = next(((f, gi, e) for f, gi, e in stated if f is named), stated[0])
    return {**{k: entry[k] for k in ("mechanism", "scope", "value", "via")}, "named": f is named}


def _changes(agree: np.ndarray, g: int, g0: int) -> tuple[int, int]:
    """(the neutral value's flips the value at `g` turns into agreements, the agreements it loses)."""
    return int((~agree[:, g0] & agree[:, g]).sum()), int((agree[:, g0] & ~agree[:, g]).sum())


def _not_worse(a: np.ndarray, b: np.ndarray) -> bool:
    """Agreement column `a` is not significantly worse than `b` (exact sign test over where they differ)."""
    wins = int((b & ~a).sum())
    return sign_test(wins, wins + int((a & ~b).sum())) >= INTERVAL_ALPHA


def _result(ev: dict, fits: list[dict], f: dict, g: int, p: float, source: str, stated: dict | None) -> dict:
    agree, g0 = f["agree"], f["g0"]
    flips = ~agree[:, g0]
    explained = flips & agree[:, g]
    n_exp, n_lost = _changes(agree, g, g0)
    value = float(f["grid"][g])
    rid = np.asarray(ev["request_id"], dtype=object)
    ids = sorted(set(rid[explained].tolist()))
    # a request every flip of which the penalty explains, none where no candidate had been seen: the server's
    # processing, not a divergence (`lower_explained`)
    unexplained = set(rid[flips & ~agree[:, g]].tolist()) | ev["stray"]
    at = agree[:, g]
    consistent = [
        {"mechanism": o["mech"], "scope": o["scope"], "value": float(o["grid"][o["g"]])}
        for o in fits
        if o is not f and o["gain"] > 0 and _not_worse(o["agree"][:, o["g"]], at)
    ]
    out = {
        "mechanism": f["mech"],
        "scope": f["scope"],
        "value": value,
        "interval": [float(f["grid"][i]) for i in _interval(agree, g)],
        "explained": n_exp,
        "flips": int(flips.sum()),
        "lost": n_lost,
        "p_value": p,
        "source": source,
        "stated": stated,
        "consistent": consistent,
        "requests": ids,
        "explained_requests": sorted(set(ids) - unexplained),
    }
    out["sentence"] = sentence(f["mech"], f["scope"], value, n_exp, int(flips.sum()), len(ids))
    if source == "stated":
        out["sentence"] += (
            f"; the server's stated default ({stated['via'].split(':')[0]}), tested as stated: too few flips to fit a "
            f"kind on their own, and p = {p:.2g} that its changes meet them by chance"
        )
    elif stated is not None and not stated["named"]:
        out["sentence"] += f"; not the kind the server states ({_kind_words(stated)} {stated['value']:.3g})"
    if consistent:
        out["sentence"] += "; the evidence cannot tell it from " + ", ".join(
            f"{_kind_words(c)} of about {c['value']:.3g}" for c in consistent
        )
    return out


def _kind_words(entry: dict) -> str:
    return f"{entry['mechanism'].replace('_', ' ')} over {_SCOPE_WORDS[entry['scope']]}"


LOWERED_BY = ("self_contradiction", "sure_token", "spec_decision", "inconsistency")  # other steps' reasons


def lower_explained(summary: pa.Table, fit: dict | None, clean_abs_diff: float) -> tuple[pa.Table, int]:
    """(`summary` with each `divergent` request whose only flagged tokens are greedy flips the fitted penalty
    explains, `fit["explained_requests"]`, judged as the server's configured sampling: `noise` (or `clean`
    within `clean_abs_diff`), no first divergence, column `server_processing` naming the mechanism; how many).
    A request another step raised (a contradiction, a sure token, a decision, an inconsistent answer) stays."""
    if fit is None or not fit.get("explained_requests"):
        return summary, 0
    keep = pc.is_in(summary.column("request_id"), value_set=pa.array(fit["explained_requests"], pa.string()))
    lower = pc.and_(keep, pc.equal(summary.column("verdict"), "divergent"))
    flips = summary.column("n_greedy_flips")
    lower = pc.and_(lower, pc.and_(pc.greater(flips, 0), pc.equal(summary.column("n_flagged_tokens"), flips)))
    for name in LOWERED_BY:
        if name in summary.column_names:
            lower = pc.and_(lower, pc.is_null(summary.column(name)))
    lower = lower.to_numpy(zero_copy_only=False) if hasattr(lower, "to_numpy") else np.asarray(lower)
    n = int(lower.sum())
    if n == 0:
        return summary, 0
    worst = summary.column("max_abs_logprob_diff").to_numpy(zero_copy_only=False)
    with np.errstate(invalid="ignore"):
        calm = np.where(worst > clean_abs_diff, "noise", "clean")
    verdict = np.where(lower, calm, np.asarray(summary.column("verdict").to_pylist(), dtype=object))
    first = pc.if_else(pa.array(lower), pa.nulls(summary.num_rows, pa.int32()), summary.column("first_divergence"))
    out = summary.set_column(
        summary.column_names.index("verdict"),
        "verdict",
        pa.array(verdict.tolist(), summary.schema.field("verdict").type),
    )
    out = out.set_column(
        out.column_names.index("first_divergence"),
        "first_divergence",
        first.cast(summary.schema.field("first_divergence").type),
    )
    why = pa.array([fit["mechanism"] if x else None for x in lower], pa.string())
    return out.append_column("server_processing", why), n


def sentence(mech: str, scope: str, value: float, explained: int, flips: int, n_requests: int) -> str:
    what = {"repetition_penalty": "a repetition penalty", "presence_penalty": "a presence penalty"}.get(
        mech, "a frequency penalty"
    )
    return (
        f"the server applies {what} of about {value:.3g} to {_SCOPE_WORDS[scope]} "
        f"(it explains {explained} of the {flips} greedy choices that differ from the reference where a "
        f"candidate had been seen, in {n_requests} request(s))"
    )


def phrase(fit: dict) -> str:
    """The per-request feature's words: what a request carrying it did."""
    return (
        f"chose tokens that a {fit['mechanism'].replace('_', ' ')} of {fit['value']:.3g} on "
        f"{_SCOPE_WORDS[fit['scope']]} predicts and the raw logits do not (server-side sampling processing)"
    )


def _coincidence(fits: list[dict], flips: np.ndarray, n_exp: int, n_lost: int) -> float:
    """How likely the fit's choices meet the engine's flips by chance: of the P informative positions, the fit
    changes the raw choice at n_exp + n_lost plus, at most, the flips it leaves (an upper bound); the engine
    flipped at F; under a fault that flips where it flips whatever the penalty does, the overlap is
    hypergeometric, P(X >= n_exp). Times the distinct sets of choices tried (Bonferroni: per kind, the grid
    points where some position's agreement changes, plus one). A handful of flips, each exactly where a
    penalty puts one and none elsewhere, is evidence the sign test alone cannot give (2 flips: p >= 0.25)."""
    tried = sum(int(np.any(f["agree"][:, 1:] != f["agree"][:, :-1], axis=0).sum()) + 1 for f in fits)
    return _chance(flips, n_exp, n_lost, tried)


def _chance(flips: np.ndarray, n_exp: int, n_lost: int, tried: int) -> float:
    """`_coincidence` for `tried` distinct sets of choices (1: a penalty the server states, tested as stated)."""
    n_flips = int(flips.sum())
    if n_exp == 0:
        return 1.0
    changed = n_lost + n_flips  # the fit's changes: explained + lost, and the flips it leaves (bound)
    return min(1.0, tried * hypergeom_tail(n_exp, flips.size, changed, n_flips))


def _kind(fits: list[dict]) -> dict | None:
    """The model the evidence supports: the one that explains the most flips, unless one listed before it in
    MODELS (the more common semantics first) is not significantly worse at its own best value (exact sign
    test over the positions where the two disagree, p >= INTERVAL_ALPHA): two kinds that act on the same
    tokens (a presence penalty and a repetition penalty over the output) are told apart only past that."""
    if not fits:
        return None
    top = max(fits, key=lambda f: f["gain"])
    at = top["agree"][:, top["g"]]
    for f in fits:
        if f is top:
            break
        other = f["agree"][:, f["g"]]
        wins = int((at & ~other).sum())
        if f["gain"] > 0 and sign_test(wins, wins + int((other & ~at).sum())) >= INTERVAL_ALPHA:
            return f
    return top


def _interval(agree: np.ndarray, g: int) -> tuple[int, int]:
    """[lo, hi] grid indices: the contiguous values around the fit `g` whose agreement the evidence cannot
    tell from the fit's: over the positions where the two disagree, the fit's wins are not improbable under
    an even split (exact sign test, p >= INTERVAL_ALPHA one-sided). A plateau of equal counts is the least
    of it; one grid point only when a step away already loses significantly."""
    at = agree[:, g]

    def same(i: int) -> bool:
        wins = int((at & ~agree[:, i]).sum())
        return sign_test(wins, wins + int((agree[:, i] & ~at).sum())) >= INTERVAL_ALPHA

    lo = hi = g
    while lo > 0 and same(lo - 1):
        lo -= 1
    while hi + 1 < agree.shape[1] and same(hi + 1):
        hi += 1
    return lo, hi


def _plateau(counts: np.ndarray, top: int, g0: int) -> tuple[int, int]:
    """The contiguous run of grid points at the maximum count: the one nearest the neutral value's far
    side (the first maximum found walking away from neutral), as [lo, hi] indices."""
    at = np.flatnonzero(counts == top)
    first = int(at[np.argmin(np.abs(at - g0))])
    lo = hi = first
    while lo > 0 and counts[lo - 1] == top:
        lo -= 1
    while hi + 1 < counts.size and counts[hi + 1] == top:
        hi += 1
    return lo, hi
