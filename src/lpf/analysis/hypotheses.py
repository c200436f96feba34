"""Rank candidate mechanisms by how strongly each feature singles out the flagged requests.

Contract: `rank_hypotheses(features, flagged, scored, flagged_label, other_label) -> list[dict]`,
best first, each {"rank", "feature", "sentence", "flagged_with", "flagged_total", "clean_with",
"clean_total", "p_value", "score"} (+ "split" for numeric features). `flagged` and `scored` are
boolean masks over requests (the features' order); the comparison group is scored requests that
are not flagged. Booleans are tested as they are; numeric features at their best split (x >= t or
x <= t over up to 128 candidate cut points that occur in the data), which is optimistic as any
best split is: its p-value is multiplied by the number of splits tried (Bonferroni) and the
sentence says "best split". The test is Fisher's exact test, one-sided for enrichment among flagged
requests (`stats.hypergeom_tail`). score = -log10(p); ties go to the feature with the
better balance of precision and recall, then to the more specific (earlier-listed) feature.
Hypotheses with p >= 0.05 or fewer than 2 flagged requests carrying them are dropped.
"""

from __future__ import annotations

import math

import numpy as np

from lpf.analysis.features import Feature
from lpf.analysis.stats import hypergeom_tail, sign_test

MAX_CUTS = 128
MAX_P = 0.05


def run_wide(
    feature: Feature, flagged: np.ndarray, scored: np.ndarray, flagged_label: str, min_share: float = 0.5
) -> dict | None:
    """A signature carried by most scored requests is a property of the whole run, which a
    flagged-vs-clean contingency cannot see (both groups have it): tested against chance (sign test
    over requests) instead, and stated for the run."""
    x = np.asarray(feature.values).astype(bool) & scored
    n, k = int(scored.sum()), int(x.sum())
    if n == 0 or k < min_share * n:
        return None
    p = sign_test(k, n)
    n_f, a = int((flagged & scored).sum()), int((x & flagged).sum())
    return {
        "feature": feature.name,
        "sentence": f"{k}/{n} requests ({a}/{n_f} {flagged_label} ones) {feature.phrase}.",
        "flagged_with": a,
        "flagged_total": n_f,
        "clean_with": k - a,
        "clean_total": n - n_f,
        "p_value": p,
        "score": float(min(300.0, -math.log10(max(p, 1e-300)))),
        "scope": "run",
    }


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3g}"


def _split_words(f: Feature, op: str, cut: float) -> str:
    words = f"{f.phrase} {op} {_fmt(cut)}"
    if f.stride and op == ">=":
        words += f" (slot * stride >= {int(cut) * f.stride:,} = 2^{math.log2(max(cut * f.stride, 1)):.2f})"
    return words


def _candidates(x: np.ndarray) -> np.ndarray:
    u = np.unique(x[np.isfinite(x)])
    if u.size <= MAX_CUTS:
        return u
    return np.unique(u[np.linspace(0, u.size - 1, MAX_CUTS).round().astype(np.int64)])  # values that occur


def rank_hypotheses(
    features: list[Feature],
    flagged: np.ndarray,
    scored: np.ndarray,
    flagged_label: str = "flagged",
    other_label: str = "clean",
    signatures: list[Feature] = (),
) -> list[dict]:
    """`signatures` are tested per request like features and, when most requests carry one, for
    the run as a whole (`run_wide`)."""
    flagged = flagged & scored
    other = scored & ~flagged
    n_f, n_o = int(flagged.sum()), int(other.sum())
    total = n_f + n_o
    out = []
    for order, f in enumerate(signatures):
        h = run_wide(f, flagged, scored, flagged_label)
        if h is not None and h["p_value"] < MAX_P and n_f:
            out.append((h, 1.0, -len(signatures) + order))
    if n_f == 0 or n_o == 0:
        return _ranked(out)
    wide = {h["feature"] for h, _, _ in out}
    for order, f in enumerate([f for f in signatures if f.name not in wide] + list(features)):
        x = np.asarray(f.values)
        if f.kind == "bool":
            mask = x.astype(bool)
            tests = [(int((mask & flagged).sum()), int((mask & other).sum()), None, f.phrase)]
        else:
            xf = x.astype(np.float64)
            cuts = _candidates(xf[scored])
            # counts at every cut at once: x >= cut / x <= cut over each group's sorted values (NaN: neither)
            xs_f, xs_o = (np.sort(xf[g & ~np.isnan(xf)]) for g in (flagged, other))
            ge_f, ge_o = (v.size - np.searchsorted(v, cuts, "left") for v in (xs_f, xs_o))
            le_f, le_o = (np.searchsorted(v, cuts, "right") for v in (xs_f, xs_o))
            tests = []
            for i, cut in enumerate(cuts):
                tests.append((int(ge_f[i]), int(ge_o[i]), (">=", float(cut)), None))
                tests.append((int(le_f[i]), int(le_o[i]), ("<=", float(cut)), None))
        best = None
        ac = np.array([(a, c) for a, c, _, _ in tests], dtype=np.int64).reshape(-1, 2)
        # each distinct table once, every cut's at once (cuts that split alike give the same table)
        pairs, at = np.unique(ac[(ac[:, 0] >= 2) & (ac.sum(axis=1) < total)], axis=0, return_inverse=True)
        ps = iter(np.atleast_1d(hypergeom_tail(pairs[:, 0], total, pairs.sum(axis=1), n_f))[at.ravel()].tolist())
        for a, c, split, phrase in tests:
            if a < 2 or a + c == total:
                continue
            p = next(ps)
            prec, rec = a / (a + c), a / n_f
            balance = 2 * prec * rec / (prec + rec)
            key = (-p, balance)
            if best is None or key > best[0]:
                best = (key, a, c, p, split, phrase)
        if best is None:
            continue
        _, a, c, p, split, phrase = best
        if split is not None:  # Bonferroni over the cut points tried: a best split is optimistic
            p = min(1.0, p * len(tests))
        if p >= MAX_P:
            continue
        if split is not None:
            phrase = (
                f.template.format(op=split[0], cut=_fmt(split[1])) if f.template else "had " + _split_words(f, *split)
            )
        sentence = (
            f"{a}/{n_f} {flagged_label} requests {phrase}; {c}/{n_o} {other_label} ones did"
            + (" (best split)" if split is not None else "")
            + "."
        )
        h = {
            "feature": f.name,
            "sentence": sentence,
            "flagged_with": a,
            "flagged_total": n_f,
            "clean_with": c,
            "clean_total": n_o,
            "p_value": p,
            "score": float(min(300.0, -math.log10(max(p, 1e-300)))),
        }
        if split is not None:
            h["split"] = {"op": split[0], "value": split[1]}
        out.append((h, best[0][1], order))
    return _ranked(out)


def _ranked(out: list) -> list[dict]:
    out.sort(key=lambda t: (-t[0]["score"], -t[1], t[2]))
    return [{"rank": i + 1, **h} for i, (h, _, _) in enumerate(out)]
