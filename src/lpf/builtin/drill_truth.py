"""For scoring drills (tests, benchmarks; analysis never reads these): does each flagged request's
per-request mechanism match what the ground truth says happened to it?

Contract: `mechanism_share(flagged, truth) -> dict`. `flagged` is findings' `flagged` list (each entry's
`mechanism.feature`, `lpf.analysis.mechanisms`); `truth` is the run's `faults/` rows as (request_id,
fault, role) tuples. A flagged request matches when its mechanism's feature is one that `EXPECTED`
accepts for some (fault, role) the ground truth records for it (a request both wrapped and
overwritten matches either; each drill declares its features in `drill_catalog`). A flagged request the ground truth never names (a false positive) or
whose fault has no entry here counts as a miss: the share is over every flagged request. Returns
{"flagged", "matched", "share" (None when nothing is flagged), "by_role": {role: [matched, flagged]},
"misses": [{"request_id", "mechanism", "truth"}, ...] (the first 20)}.
"""

from __future__ import annotations

from lpf.builtin.drill_catalog import CATALOG

# fault -> role -> the per-request mechanism features that name what happened (each drill's `truth`)
EXPECTED: dict[str, dict[str, set[str]]] = {name: d.expected() for name, d in CATALOG.items() if d.expected()}


def mechanism_share(flagged: list[dict], truth: list[tuple[str, str, str]]) -> dict:
    events: dict[str, set[tuple[str, str]]] = {}
    for rid, fault, role in truth:
        events.setdefault(rid, set()).add((fault, role))
    matched, by_role, misses = 0, {}, []
    for row in flagged:
        rid = row["request_id"]
        feature = (row.get("mechanism") or {}).get("feature")
        seen = events.get(rid) or {("none", "none")}
        ok = any(feature in EXPECTED.get(fault, {}).get(role, ()) for fault, role in seen)
        matched += ok
        for role in {role for _, role in seen}:
            tally = by_role.setdefault(role, [0, 0])
            tally[0] += ok
            tally[1] += 1
        if not ok and len(misses) < 20:
            misses.append({"request_id": rid, "mechanism": feature, "truth": sorted(f"{f}/{r}" for f, r in seen)})
    n = len(flagged)
    return {
        "flagged": n,
        "matched": matched,
        "share": matched / n if n else None,
        "by_role": by_role,
        "misses": misses,
    }
