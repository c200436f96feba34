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
  1. Among the hypotheses significant for the requests not explained yet (round 1: the run's ranking
     as it is), take the best-ranked one whose feature holds for at least 2 of them and has not
     explained any earlier round; "holds" is the boolean, or the flagged side of the numeric
     hypothesis' split (x >= t or x <= t; NaN: no). Significant here is stricter than the ranking's
     p < 0.05: p < 0.05 / (the number of features tested), a Bonferroni bar over the family of
     candidate mechanisms, since every round asks all of them (numeric splits already carry their
     own correction for the cut points tried).
  2. It explains every not-yet-explained flagged request it holds for.
  3. Rank the features again (`rank_hypotheses`, the same Fisher tests and Bonferroni-corrected
     splits) with only the flagged requests still unexplained against the same comparison group
     (the requests explained so far leave both groups), and repeat from 1 until none is left, no
     hypothesis is significant for what is left, or MAX_ROUNDS rounds.
  4. What is left is "unexplained".
Why rounds rather than "the best-ranked hypothesis a request carries": a broad, weak feature (prompt
length, arrival index) is often significant on the whole run only because it overlaps the real
mechanism; once the requests that mechanism explains are set aside it must be significant again on
what remains, which it rarely is, so it cannot "explain" everything it happens to cover (measured: on
an offset-wrap run without the write log, prompt length <= 28 held for 112 of the 139 victims the wrap
does not explain and for 57/99 unflagged requests, p = 0.0065 after its split correction: past 0.05,
not past the family's bar; a feature explains once, so its opposite split cannot take the rest). The
reverse: a second mechanism hidden behind the first shows up only then (the victims of an
offset-wrap's stray writes: most of the run's clean requests were overwritten too, so
`state_overwritten` is no enrichment among all flagged requests, and a strong one among those the
wrap itself does not explain). A mechanism chosen in round 1 keeps the run's ranking's sentence and
rank; a later one says what it holds for among the requests still unexplained ("otherwise
unexplained"), with its rank in the run's ranking, or None when it is not there.
"""

from __future__ import annotations

import numpy as np

from lpf.analysis.feature import Feature
from lpf.analysis.hypotheses import MAX_P, rank_hypotheses

MAX_ROUNDS = 8
MIN_COVER = 2  # a mechanism explains at least 2 requests, as a hypothesis needs 2 flagged ones
UNEXPLAINED = "unexplained: no hypothesis significant among the requests left holds for it"


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
        pick = _first_holding(hyps, by_name, left, bar, {c["feature"] for c in covered})
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


def _first_holding(hyps: list[dict], by_name: dict, left: np.ndarray, bar: float, used: set):
    for h in hyps:
        f = by_name.get(h["feature"])
        if f is None or f.name in used or h["p_value"] >= bar:
            continue
        mask = holds(f, h) & left
        if int(mask.sum()) >= MIN_COVER:
            return h, f, mask
    return None
