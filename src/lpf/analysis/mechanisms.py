"""Per-request mechanism attribution: which ranked hypothesis explains each flagged request.

Contract: `attribute(ranked, features, flagged, scored, flagged_label, other_label, signatures=())
-> (per_request, block)`. `ranked` is `hypotheses.rank_hypotheses`' answer for the same features,
masks and signatures (the run's ranking, findings' `hypotheses`); `features` / `signatures` are the
`Feature`s it ranked, so any feature a future module adds is attributed like the built-in ones.
`per_request` is a list aligned to the masks: None for a request that is not flagged, else
{"feature": NAME | None, "sentence": str, "rank": R | None} (+ "writer": REQUEST_ID when the
feature names, per request, the request whose write it suffered: `Feature.writer`). `block` is
findings' `mechanisms`: {"covered": [{"feature", "sentence", "n", "rank"}, ...] in the order they
were chosen, "unexplained": n, "n_flagged": n}. Pure numpy.

The rule (explaining away, in rounds):
  1. Rank the features for the flagged requests not explained yet (round 1: the run's ranking as it
     is; later rounds: `rank_hypotheses` again, the requests explained so far out of both groups, so
     the same Fisher tests and split corrections).
  2. Take the best-ranked hypothesis that is significant past the family's Bonferroni bar (p < 0.05 /
     the number of features ranked: every round asks all of them), holds for at least 2 of those
     requests and whose feature has not explained an earlier round ("holds": the boolean, or the
     flagged side of a numeric hypothesis' split, x >= t or x <= t; NaN: no). A `descriptive` feature
     (what a request is: its prompt length, rollout or arrival index, not what the engine did to it)
     is taken only when no other feature qualifies, and only when the flagged rate among the requests
     it holds for is at least RISK_RATIO times the rate among the rest.
  3. It explains every not-yet-explained flagged request it holds for; repeat until none is left,
     nothing qualifies, or MAX_ROUNDS rounds. What is left is "unexplained".
Why rounds rather than "the best-ranked hypothesis a request carries": a broad feature is often
significant over the whole run only because it overlaps the real mechanism, and must be significant
again among the requests that mechanism leaves; and a second mechanism hidden behind the first shows
only then (an offset-wrap's victims: most clean requests were overwritten too, so `state_overwritten`
is no enrichment over all flagged requests, and a strong one among those the wrap leaves: 139/139 vs
87/99 unflagged, p = 2e-5, on make demo's run). Why the family's bar and not the ranking's p < 0.05:
with 20 features of random noise beside one real mechanism (100,000 requests), one noise feature
passed 0.05 among the requests the mechanism left and took 253 of them. Why the last resort for
descriptive features: on offset-wrap runs a prompt length split was significant among the victims
the wrap leaves (112/139 vs 57/99 unflagged, p = 0.006; 51/55 vs 26/46 on 200 prompts, p = 0.001,
ahead of `state_overwritten`'s 0.007), a moderator of which victims the model's attention rescues, not
what happened to them (risk ratios 1.7 and 4.0); and a server's repetition penalty showed as "prompt
length >= 43 (p=0.0021)". A trigger condition such as a long-context bug's (flagged only past some
length) has a risk ratio far above 5. A feature explains once, so a split and its opposite cannot
share the requests. A mechanism chosen in round 1 keeps the run's sentence and rank; a later one says
what it holds for among the requests still unexplained ("otherwise unexplained"), with its rank in
the run's ranking, or None when it is not there.
"""

from __future__ import annotations

import numpy as np

from lpf.analysis.feature import Feature
from lpf.analysis.hypotheses import MAX_P, rank_hypotheses

MAX_ROUNDS = 8
MIN_COVER = 2  # a mechanism explains at least 2 requests, as a hypothesis needs 2 flagged ones
RISK_RATIO = 5.0  # a descriptive feature: flagged rate with it / without it, at least
UNEXPLAINED = "unexplained: no hypothesis significant among the requests left holds for it"
RUN_LEVEL = "run_level_departure"
RUN_LEVEL_SENTENCE = (
    "the model or its arithmetic departs from the reference everywhere (the run-level test: different, the "
    "departure not localized), and no engine-side feature explains this request better"
)


def holds(feature: Feature, hypothesis: dict) -> np.ndarray:
    """Where `feature` is on the flagged side of `hypothesis` (its split for a numeric one)."""
    x = np.asarray(feature.values)
    if feature.kind == "bool" or "split" not in hypothesis:
        return x.astype(bool)
    split = hypothesis["split"]
    xf = x.astype(np.float64)
    with np.errstate(invalid="ignore"):  # NaN (unknown) compares False: not on either side
        return xf >= split["value"] if split["op"] == ">=" else xf <= split["value"]


def attribute(
    ranked: list[dict],
    features: list[Feature],
    flagged: np.ndarray,
    scored: np.ndarray,
    flagged_label: str = "flagged",
    other_label: str = "clean",
    signatures: list[Feature] = (),
) -> tuple[list[dict | None], dict]:
    flagged = np.asarray(flagged, dtype=bool) & np.asarray(scored, dtype=bool)
    by_name = {f.name: f for f in [*signatures, *features]}
    rank_of = {h["feature"]: h["rank"] for h in ranked}
    bar = MAX_P / max(1, len(by_name))
    per: list[dict | None] = [None] * len(flagged)
    left = flagged.copy()
    covered, hyps = [], ranked
    for round_ in range(MAX_ROUNDS):
        if not left.any():
            break
        pick = _pick(hyps, by_name, left, bar, {c["feature"] for c in covered})
        if pick is None:
            break
        h, f, mask = pick
        mech = {"feature": f.name, "sentence": h["sentence"], "rank": rank_of.get(f.name)}
        for i in np.flatnonzero(mask):
            per[i] = dict(mech)
            if f.writer is not None and f.writer[i] is not None:
                per[i]["writer"] = str(f.writer[i])
        covered.append({**mech, "n": int(mask.sum())})
        left &= ~mask
        if not left.any() or round_ + 1 == MAX_ROUNDS:
            break
        # the explained requests leave both groups: what is left against the same comparison group
        hyps = rank_hypotheses(
            features,
            left,
            scored & ~(flagged & ~left),
            f"otherwise unexplained {flagged_label}",
            other_label,
            signatures=signatures,
        )
    for i in np.flatnonzero(left):
        per[i] = {"feature": None, "sentence": UNEXPLAINED, "rank": None}
    return per, {"covered": covered, "unexplained": int(left.sum()), "n_flagged": int(flagged.sum())}


def _pick(hyps: list[dict], by_name: dict, left: np.ndarray, bar: float, used: set):
    """(hypothesis, feature, the requests left it holds for) of the round's mechanism, or None."""
    fallback = None
    for h in hyps:
        f = by_name.get(h["feature"])
        if f is None or f.name in used or h["p_value"] >= bar:
            continue
        mask = holds(f, h) & left
        if int(mask.sum()) < MIN_COVER:
            continue
        if not f.descriptive:
            return h, f, mask
        if fallback is None and _risk_ratio(h) >= RISK_RATIO:
            fallback = (h, f, mask)
    return fallback


def _risk_ratio(h: dict) -> float:
    """The flagged rate among the requests a hypothesis holds for, over the rate among the others."""
    a, c = h["flagged_with"], h["clean_with"]
    b, d = h["flagged_total"] - a, h["clean_total"] - c
    if b == 0:
        return float("inf")
    return (a / (a + c)) / (b / (b + d))


def run_level(per: list[dict | None], block: dict, features: list[Feature], test: dict | None) -> tuple[list, dict]:
    """When the run-level test finds the whole run departs (`different`, and the localized rule did not apply:
    the departure is everywhere, not in some requests' state), a flagged request that nothing explains, or only a
    `descriptive` feature (what a request is: a quantized model's flags gather in longer prompts because longer
    requests have more tokens to depart on), is explained by the departure itself: mechanism `RUN_LEVEL`, in
    `block["covered"]` with its count; an engine-side feature's attribution stands."""
    # `localized` is None on a rejected run exactly when the departure is everywhere (`localized.raise_localized`)
    if not test or test.get("result") != "different" or test.get("localized") is not None:
        return per, block
    descriptive = {f.name for f in features if f.descriptive}
    moved = 0
    for i, m in enumerate(per):
        if m is not None and (m["feature"] is None or m["feature"] in descriptive):
            per[i] = {"feature": RUN_LEVEL, "sentence": RUN_LEVEL_SENTENCE, "rank": None}
            moved += 1
    if not moved:
        return per, block
    left = {}
    for m in per:
        if m is not None:
            left[m["feature"]] = left.get(m["feature"], 0) + 1
    covered = [{**c, "n": left[c["feature"]]} for c in block["covered"] if left.get(c["feature"])]
    covered.append({"feature": RUN_LEVEL, "sentence": RUN_LEVEL_SENTENCE, "rank": None, "n": left[RUN_LEVEL]})
    return per, {**block, "covered": covered, "unexplained": 0}
