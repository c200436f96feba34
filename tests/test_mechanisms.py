"""Per-request mechanism attribution (`lpf.analysis.mechanisms`), the write log's features
(`lpf.analysis.write_features`) and the drill scoring against ground truth (`lpf.builtin.drill_truth`).

Unit tests over synthetic features and traces (fast); one end-to-end offset-wrap audit through the CLI
(slow: the built-in engine's write log, findings' contract, `lpf inspect`, the match against `faults/`).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from conftest import lpf_main
from lpf.analysis.feature import Feature
from lpf.analysis.hypotheses import rank_hypotheses
from lpf.analysis.mechanisms import UNEXPLAINED, attribute
from lpf.analysis.write_features import write_features
from lpf.builtin.drill_truth import mechanism_share
from lpf.run import schema


def _run_like():
    """600 requests: 100 flagged by a wrap (A), 60 flagged victims (B, which 300 clean requests also
    carry: no enrichment over the whole run), 5 flagged with nothing; prompt length overlaps (80% of
    flagged requests are short, 60% of clean ones: significant over the run, p ~ 2e-4)."""
    n = 600
    i = np.arange(n)
    flagged = np.zeros(n, dtype=bool)
    flagged[:165] = True
    a = np.zeros(n, dtype=bool)
    a[:100] = True
    a[500:503] = True  # 3 clean requests wrapped harmlessly
    b = np.zeros(n, dtype=bool)
    b[100:160] = True
    b[200:500] = True  # most clean requests were overwritten too
    writer = np.full(n, None, dtype=object)
    writer[b] = [f"w{i}" for i in np.flatnonzero(b)]
    short = np.where(i < 165, i % 5 < 4, i % 5 < 3)
    length = np.where(short, 10 + i % 19, 29 + i % 31).astype(np.float64)
    feats = [
        Feature("prompt_length", "numeric", length, "prompt length (tokens)", descriptive=True),
        Feature("wrapped", "bool", a, "prefilled past the wrap"),
        Feature("overwritten", "bool", b, "had their state overwritten", writer=writer),
    ]
    return feats, flagged, np.ones(n, dtype=bool)


def test_each_flagged_request_gets_its_own_mechanism_victims_included():
    feats, flagged, scored = _run_like()
    ranked = rank_hypotheses(feats, flagged, scored, "corrupt", "clean")
    assert ranked[0]["feature"] == "wrapped"
    assert "overwritten" not in {h["feature"] for h in ranked}, "no enrichment over the whole run"
    per, block = attribute(ranked, feats, flagged, scored, "corrupt", "clean")
    assert [(c["feature"], c["n"]) for c in block["covered"]] == [("wrapped", 100), ("overwritten", 60)]
    assert block["unexplained"] == 5 and block["n_flagged"] == 165
    assert all(per[i] is None for i in np.flatnonzero(~flagged)), "only flagged requests get one"
    assert per[0] == {"feature": "wrapped", "sentence": ranked[0]["sentence"], "rank": 1}
    victim = per[120]
    assert victim["feature"] == "overwritten" and victim["writer"] == "w120" and victim["rank"] is None
    assert victim["sentence"].startswith("60/65 otherwise unexplained corrupt requests had their state overwritten")
    assert per[162] == {"feature": None, "sentence": UNEXPLAINED, "rank": None}


def test_a_broad_descriptive_feature_explains_nothing_it_merely_overlaps():
    """Without the write log the victims stay unexplained: prompt length is significant over the run
    (p < 1e-3) but not among the requests the wrap leaves, and never twice (a split and its opposite)."""
    feats, flagged, scored = _run_like()
    feats = feats[:2]
    ranked = rank_hypotheses(feats, flagged, scored, "corrupt", "clean")
    assert [h["feature"] for h in ranked] == ["wrapped", "prompt_length"] and ranked[1]["p_value"] < 1e-3
    per, block = attribute(ranked, feats, flagged, scored, "corrupt", "clean")
    assert [c["feature"] for c in block["covered"]] == ["wrapped"]
    assert block["unexplained"] == 65


def test_noise_that_passes_005_among_the_requests_left_explains_nothing():
    """20 features of noise beside one real mechanism: among the flagged requests it leaves, a noise
    feature reaches p = 0.03 (one of 20 tested: chance), below the ranking's 0.05 and not the family's
    bar, so those requests stay unexplained."""
    rng = np.random.default_rng(3)
    n = 5000
    flagged = rng.random(n) < 0.04
    feats = [Feature(f"noise{i}", "bool", rng.random(n) < 0.3, "did something random") for i in range(20)]
    feats.append(Feature("real", "bool", flagged & (rng.random(n) < 0.6), "met the bug"))
    scored = np.ones(n, dtype=bool)
    left = flagged & ~feats[-1].values
    chance = rank_hypotheses(feats, left, scored & ~(flagged & ~left))
    assert [h["feature"] for h in chance] == ["noise5"] and 0.05 / 21 < chance[0]["p_value"] < 0.05
    per, block = attribute(rank_hypotheses(feats, flagged, scored), feats, flagged, scored)
    assert [c["feature"] for c in block["covered"]] == ["real"]
    assert block["unexplained"] == int(left.sum()) and all(per[i]["feature"] is None for i in np.flatnonzero(left))


def _descriptive_only(short_flagged: int, short_clean: int):
    """40 flagged of 600; `short_*` of each group have a short prompt; nothing else to go on."""
    i = np.arange(600)
    flagged = i < 40
    short = np.where(flagged, i < short_flagged, (i - 40) < short_clean)
    length = np.where(short, 20.0, 60.0 + i % 7)
    return [Feature("prompt_length", "numeric", length, "prompt length (tokens)", descriptive=True)], flagged


def test_a_descriptive_feature_explains_only_as_a_strong_last_resort():
    scored = np.ones(600, dtype=bool)
    # a broad association (34/40 flagged short, 330/560 clean: p = 0.009, past the bar of one feature,
    # but a risk ratio of 3.7): ranked, explains none
    feats, flagged = _descriptive_only(34, 330)
    ranked = rank_hypotheses(feats, flagged, scored)
    assert ranked and ranked[0]["p_value"] < 0.01
    _, block = attribute(ranked, feats, flagged, scored)
    assert block["covered"] == [] and block["unexplained"] == 40
    # a long-context bug's shape (38/40 flagged short vs 20/560: a rate 100x higher): it is the explanation
    feats, flagged = _descriptive_only(38, 20)
    ranked = rank_hypotheses(feats, flagged, scored)
    per, block = attribute(ranked, feats, flagged, scored)
    assert [(c["feature"], c["n"]) for c in block["covered"]] == [("prompt_length", 38)]
    assert per[0]["feature"] == "prompt_length" and per[39]["feature"] is None


def test_numeric_mechanisms_hold_on_their_split_side_only():
    n = 300
    slot = np.arange(n, dtype=np.float64) % 40
    slot[5] = np.nan  # unknown: on neither side
    flagged = slot >= 27
    flagged[5] = True
    feats = [Feature("max_state_slot", "numeric", slot, "state slot id")]
    ranked = rank_hypotheses(feats, flagged, np.ones(n, dtype=bool))
    assert ranked[0]["split"] == {"op": ">=", "value": 27.0}
    per, block = attribute(ranked, feats, flagged, np.ones(n, dtype=bool))
    assert block["covered"][0]["n"] == int((slot >= 27).sum()) and block["unexplained"] == 1
    assert per[5]["feature"] is None and per[39]["feature"] == "max_state_slot"


def _trace(rows):
    cols = {k: [r.get(k) for r in rows] for k in ("step", "request_id", "stray_writes")}
    t = schema.table(schema.TRACE, {k: v for k, v in cols.items() if k != "stray_writes"})
    return t.append_column(
        pa.field("stray_writes", pa.list_(schema.STRAY_WRITE)),
        pa.array(cols["stray_writes"], pa.list_(schema.STRAY_WRITE)),
    )


def test_write_log_names_victims_and_their_first_writer():
    requests = schema.table(schema.REQUESTS, {"request_id": ["r0", "r1", "r2", "r3"], "seq": [0, 1, 2, 3]})
    w = lambda owner, slot: {"memory": "state", "owner": owner, "slot": slot, "start": slot * 10, "end": slot * 10 + 10}  # noqa: E731
    trace = _trace(
        [
            {"step": 3, "request_id": "r2", "stray_writes": [w("r0", 0), w(None, 1)]},
            {"step": 1, "request_id": "r3", "stray_writes": [w("r0", 0)]},  # the earlier write: the first writer
            {"step": 2, "request_id": "r0", "stray_writes": []},
            {"step": 4, "request_id": "r1", "stray_writes": None},
            # a K/V write into a block r2 holds too (a double free): r2's K/V, not its state
            {"step": 5, "request_id": "r1", "stray_writes": [dict(w("r2", 7), memory="kv")]},
        ]
    )
    feats = {f.name: f for f in write_features(requests, trace)}
    assert feats["state_overwritten"].values.tolist() == [True, False, False, False]
    assert feats["state_overwritten"].writer.tolist() == ["r3", None, None, None]
    assert feats["kv_overwritten"].values.tolist() == [False, False, True, False]
    assert feats["kv_overwritten"].writer.tolist() == [None, None, "r1", None]
    assert feats["state_write_strayed"].values.tolist() == [False, False, True, True]
    # no write log (older traces, other engines): no features, not all-false ones
    assert write_features(requests, schema.table(schema.TRACE, {"step": [1], "request_id": ["r0"]})) == []
    nulls = _trace([{"step": 1, "request_id": "r0", "stray_writes": None}])
    assert write_features(requests, nulls) == []


def test_drill_scoring_counts_victims_and_false_positives():
    flagged = [
        {"request_id": "a", "mechanism": {"feature": "slot_offset_over_wrap"}},
        {"request_id": "b", "mechanism": {"feature": "state_overwritten"}},
        {"request_id": "c", "mechanism": {"feature": "slot_offset_over_wrap"}},  # a victim called wrapped: a miss
        {"request_id": "d", "mechanism": {"feature": None}},  # outside the ground truth: a miss
    ]
    truth = [
        ("a", "offset-wrap", "wrapped"),
        ("a", "offset-wrap", "corrupted"),
        ("b", "offset-wrap", "overwritten"),
        ("c", "offset-wrap", "overwritten"),
    ]
    r = mechanism_share(flagged, truth)
    assert (r["matched"], r["flagged"], r["share"]) == (2, 4, 0.5)
    assert r["by_role"] == {"wrapped": [1, 1], "corrupted": [1, 1], "overwritten": [1, 2], "none": [0, 1]}
    assert [m["request_id"] for m in r["misses"]] == ["c", "d"]


@pytest.mark.slow
def test_offset_wrap_victims_get_the_write_that_hit_them(tmp_path):
    """`make demo`'s offset-wrap audit (zoo:hybrid, zoo:oracle's 500 requests, 4 MB: slots >= 18 wrap
    at 2^18): the wrapped requests and the victims of their stray writes are flagged, and >= 95% of
    flagged requests get the mechanism the ground truth names (victims: the write log's writer). On
    200 of these prompts the victims are too few for `state_overwritten` to pass the family's bar
    (55/55 vs 40/46 unflagged, p = 0.007): they stay unexplained there, as they should."""
    run = tmp_path / "ow"
    proc = lpf_main(
        "audit", "--inject", "offset-wrap:18", "--cache-mb", "4", "--out", run, "--json", "--fail-on", "never"
    )
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(proc.stdout)
    from lpf.views.query import run_query

    truth = run_query(run, "SELECT request_id, fault, role FROM faults")[1]
    score = mechanism_share(findings["flagged"], truth)
    assert score["by_role"].get("overwritten", [0, 0])[1] > 0, "victims among the flagged"
    assert score["share"] >= 0.95, score
    block = findings["mechanisms"]
    assert block["n_flagged"] == len(findings["flagged"])
    assert sum(c["n"] for c in block["covered"]) + block["unexplained"] == block["n_flagged"]
    assert {c["feature"] for c in block["covered"]} >= {"state_overwritten"}
    victim = next(f for f in findings["flagged"] if f["mechanism"]["feature"] == "state_overwritten")
    writer = victim["mechanism"]["writer"]
    # the writer named is one whose stray write the trace logged into the victim's slot
    landed = run_query(
        run,
        f"SELECT count(*) FROM (SELECT unnest(stray_writes) AS w FROM trace WHERE request_id = '{writer}') "
        f"WHERE w.owner = '{victim['request_id']}'",
    )[1]
    assert landed[0][0] >= 1
    shown = lpf_main("inspect", run, victim["request_id"], "--json")
    info = json.loads(shown.stdout)
    assert info["mechanism"] == victim["mechanism"]
    assert writer in {w["writer"] for w in info["overwritten_by"]}
    text = lpf_main("inspect", run, victim["request_id"]).stdout
    assert f"mechanism: state_overwritten (written over by {writer})" in text
    shown = lpf_main("analyze", run, "--fail-on", "never")
    assert shown.returncode == 0, shown.stderr
    summary = " ".join((shown.stdout + shown.stderr).split())
    n = sum(c["n"] for c in block["covered"] if c["feature"] == "state_overwritten")
    assert f"what explains each flagged request ({block['n_flagged']}):" in summary
    assert f"{n} state_overwritten: {n}/{n} otherwise unexplained" in summary


def test_a_run_level_departure_explains_what_only_a_description_would():
    """Issue 52: on a 4-bit model under the float32 name every flagged request got "prompt length >= 12" while
    the run-level test said the model departs everywhere. A flagged request that only a descriptive feature or
    nothing explains is the run-level departure's; an engine-side mechanism stands; a localized departure (some
    requests' state) keeps the attribution as it was."""
    from lpf.analysis.mechanisms import RUN_LEVEL, run_level

    feats = [
        Feature("prompt_length", "numeric", np.arange(6.0), "prompt length (tokens)", descriptive=True),
        Feature("first_phase_decode", "bool", np.array([1, 0, 0, 0, 0, 0], bool), "started with a decode step"),
    ]

    def attributed():
        per = [
            {"feature": "first_phase_decode", "sentence": "s", "rank": 1},
            {"feature": "prompt_length", "sentence": "p", "rank": 2},
            {"feature": None, "sentence": "unexplained", "rank": None},
            None,
        ]
        block = {
            "covered": [
                {"feature": "first_phase_decode", "sentence": "s", "rank": 1, "n": 1},
                {"feature": "prompt_length", "sentence": "p", "rank": 2, "n": 1},
            ],
            "unexplained": 1,
            "n_flagged": 3,
        }
        return per, block

    per, block = run_level(*attributed(), feats, {"result": "different", "localized": None})
    assert [m and m["feature"] for m in per] == ["first_phase_decode", RUN_LEVEL, RUN_LEVEL, None]
    assert [(c["feature"], c["n"]) for c in block["covered"]] == [("first_phase_decode", 1), (RUN_LEVEL, 2)]
    assert block["unexplained"] == 0 and block["n_flagged"] == 3
    for test in ({"result": "same"}, {"result": "different", "localized": {"requests": 0, "clean": 40}}, None):
        assert run_level(*attributed(), feats, test) == attributed()
