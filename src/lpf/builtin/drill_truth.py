"""For scoring drills (tests, benchmarks; analysis never reads these): does each flagged request's
per-request mechanism match what the ground truth says happened to it?

Contract: `mechanism_share(flagged, truth) -> dict`. `flagged` is findings' `flagged` list (each entry's
`mechanism.feature`, `lpf.analysis.mechanisms`); `truth` is the run's `faults/` rows as (request_id,
fault, role) tuples. A flagged request matches when its mechanism's feature is one that `EXPECTED`
accepts for some (fault, role) the ground truth records for it (a request both wrapped and
overwritten matches either). A flagged request the ground truth never names (a false positive) or
whose fault has no entry here counts as a miss: the share is over every flagged request. Returns
{"flagged", "matched", "share" (None when nothing is flagged), "by_role": {role: [matched, flagged]},
"misses": [{"request_id", "mechanism", "truth"}, ...] (the first 20)}.
"""

from __future__ import annotations

from lpf.builtin.prefix_drills import NAMED_BY

# a request whose prefill's state write wrapped decodes from a slot it never wrote
_WRAP = {"slot_offset_over_wrap", "state_write_strayed", "max_state_slot"} | {
    f"slot{b}_offset_over_2^{n}" for b in ("", "_byte") for n in (31, 32)
}
# the imposter: a first step run as a decode on a slot an earlier request had left its state in
_STALE = {
    "first_decode_uncomputed",
    "admitted_as_decode",
    "first_phase_decode",
    "first_slot_used_before",
    "first_step_one_token",
}

# fault -> role -> the per-request mechanism features that name what happened
EXPECTED: dict[str, dict[str, set[str]]] = {
    "offset-wrap": {"wrapped": _WRAP, "corrupted": _WRAP, "overwritten": {"state_overwritten"}},
    "stale-state": {"corrupted": _STALE, "discarded": _STALE},
    # both holders of a double-freed block write K/V into it: each is the other's victim
    "kv-double-free": {"corrupted": {"kv_overwritten"}},
    **{d: {"corrupted": set(features)} for d, features in NAMED_BY.items() if features},
    # speculative decoding (`spec_decode`): the trace's verify-path and rollback columns
    "spec-prefill-verify": {"corrupted": {"prompt_on_verify_path"}},
    "spec-accepted-permuted": {"corrupted": {"state_rolled_back_wrong"}},
    "spec-no-rollback": {"corrupted": {"state_kept_rejected_drafts"}},
    "spec-checkpoint-rejected": {"corrupted": {"resumed_overshot_state"}},
    "spec-draft-probs-permuted": {"corrupted": {"spec_decision_against_odds", "sampled_spec_batch_over_2"}},
}


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
