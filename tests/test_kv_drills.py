"""The built-in engine's fp8 KV cache judged as configured, and the drills of the `kv` family caught, end to end
through `lpf audit --engine builtin` on zoo:hybrid (a trained model: floors.json has its fp8 rows).

- An honest fp8 run declared with `--kv-cache-dtype fp8_e4m3` (the drills' clean twin: the declaration
  configures the engine) is `same` with the configuration line, exit 0, nothing flagged;
  the same run with its KV cache left out of the configuration (as a server that does not say it) is caught.
- Each drill: every request it harmed flagged, nothing else flagged, the mechanism its catalog entry names on
  every flagged request (`drill_truth.mechanism_share`); `kv-scale-from-position:33` with its onset named
  exactly (position 33: row 32 starts KV block 2). A request is harmed when the ground truth records the
  drill for it and its answer moved against the clean twin's (another token, or a logprob past the run's
  divergent threshold): engine against engine, so what no output comparison could see (kv-requant-on-hit on
  a request whose attention barely matters) is not counted as a miss, and said.
- `lpf shrink` cuts the position drill's run to at most 4 requests (the other drills' shrinks, measured by hand,
  are in docs/builtin-engine.md: each ~10-30 candidate runs, too many for the suite's budget).
"""

import json
import shutil

import pytest

from conftest import lpf_main
from lpf.builtin.drill_truth import mechanism_share
from lpf.views.query import run_query

pytestmark = pytest.mark.slow  # seven audits of 32-40 requests and one shrink

MODEL = "zoo:hybrid"
ORACLE = ["--workload", "zoo:oracle", "--limit", 40, "--max-tokens", 16, "--ignore-eos"]
SHARED = ["--workload", "zoo:shared-prefix", "--limit", 32, "--max-tokens", 8, "--max-num-seqs", 4]
SHARED += ["--enable-prefix-caching"]


def lpf(*args):
    r = lpf_main(*args, width=None)
    return r.returncode, r.stdout, r.stderr


def audit(out, *args, declare=False):
    """`declare`: the KV cache as `--kv-cache-dtype` (which configures the engine) instead of `-E`."""
    kv = ["--kv-cache-dtype", "fp8_e4m3"] if declare else ["-E", "kv_cache_dtype=fp8_e4m3"]
    code, stdout, err = lpf("audit", "--engine", "builtin", "--model", MODEL, *kv, *args, "--out", out, "--json")
    assert code in (0, 1), err
    return json.loads(stdout), code


def q(run, sql):
    return run_query(run, sql)[1]


def truth(run):
    return {r[0] for r in q(run, "SELECT DISTINCT request_id FROM faults")} if (run / "faults").is_dir() else set()


def harmed(run, twin, threshold):
    """The truth's requests whose answer moved against the twin's: another token, or a logprob moved past
    `threshold` at a position where both sampled the same token."""
    moved = set()
    for rid, a_ids, a_lp, b_ids, b_lp in q(
        run,
        f"""SELECT a.request_id, a.ids, a.lps, b.ids, b.lps FROM
            (SELECT request_id, list(token_id ORDER BY position) ids, list(engine_logprob ORDER BY position) lps
             FROM tokens GROUP BY request_id) a JOIN
            (SELECT request_id, list(token_id ORDER BY position) ids, list(engine_logprob ORDER BY position) lps
             FROM read_parquet('{twin}/tokens/*.parquet') GROUP BY request_id) b USING (request_id)""",
    ):
        same = [(x, y) for x, y, i, j in zip(a_lp, b_lp, a_ids, b_ids) if i == j]
        if a_ids != b_ids or any(not abs(x - y) <= threshold for x, y in same):
            moved.add(rid)
    return moved & truth(run)


def check(run, twin, findings, feature):
    flagged = {f["request_id"] for f in findings["flagged"]}
    hit = truth(run)
    assert hit and flagged <= hit, "nothing outside the ground truth is flagged"
    moved = harmed(run, twin, findings["thresholds"]["divergent_abs_diff"])
    assert moved and moved <= flagged, f"recall over harmed requests: missed {sorted(moved - flagged)}"
    score = mechanism_share(findings["flagged"], q(run, "SELECT request_id, fault, role FROM faults"))
    assert score["share"] == 1.0, score
    assert findings["mechanisms"]["covered"][0]["feature"] == feature
    return flagged, hit


@pytest.fixture(scope="module")
def oracle_twin(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv") / "twin"
    findings, code = audit(out, *ORACLE, declare=True)
    return out, findings, code


@pytest.fixture(scope="module")
def shared_twin(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv") / "shared-twin"
    findings, code = audit(out, *SHARED)
    return out, findings, code


def test_an_honest_fp8_run_is_same_as_configured_and_caught_when_the_kv_cache_is_not_said(oracle_twin):
    run, findings, code = oracle_twin
    rt = findings["run_test"]
    assert code == 0 and rt["result"] == "same" and not findings["flagged"]
    assert rt["floor_pair"] == "float32/float32 kv=fp8_e4m3"
    assert rt["configured_sentence"].startswith("departs from the reference as a fp8_e4m3 KV cache does")
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["engine"]["configuration"]["kv_cache_dtype"] == {
        "value": "fp8_e4m3",
        "source": "engine",
        "via": "the built-in engine's EngineConfig",
    }  # declared with --kv-cache-dtype, configured by it, and the engine says it (no conflict)
    assert manifest["engine"]["declared"] == {"kv_cache_dtype": "fp8_e4m3"}
    # the same answers from an engine that does not say its KV cache: judged as float32, caught
    quiet = run.parent / "unsaid"
    shutil.copytree(run, quiet)
    manifest["engine"]["configuration"]["kv_cache_dtype"] = {"value": None, "source": "absent", "via": None}
    (quiet / "manifest.json").write_text(json.dumps(manifest))
    code, out, _ = lpf("analyze", quiet, "--json")
    unsaid = json.loads(out)
    assert code == 1 and unsaid["run_test"]["result"] == "different" and unsaid["verdict"] == "systematic"
    assert "configured_sentence" not in unsaid["run_test"]


def test_decode_reading_another_scale_from_a_position_is_named_with_its_onset(oracle_twin, tmp_path):
    run = tmp_path / "pos"
    findings, code = audit(run, *ORACLE, "--inject", "kv-scale-from-position:33")
    flagged, hit = check(run, oracle_twin[0], findings, "positional_onset")
    assert code == 1 and flagged == hit
    onset = findings["shape"]["absolute_onset"]
    assert onset["position"] == 33 and onset["exact"] == onset["of"] >= 3
    assert onset["blocks"] == "row 32 = 2 x 16 starts a block (KV block size 16)"
    # every flagged request that crossed position 33 from a shorter prompt departed exactly there
    firsts = dict(
        q(
            run,
            "SELECT s.request_id, s.first_divergence + len(r.prompt_token_ids) FROM summary s "
            "JOIN requests r USING (request_id) WHERE len(r.prompt_token_ids) < 33",
        )
    )
    assert {firsts[r] for r in flagged if r in firsts} == {33}


def test_the_position_drill_shrinks_to_one_request_that_still_departs_at_its_position(tmp_path):
    """`lpf shrink` from 8 requests (the cheap cuts bisect the target's lengths first: ~15 candidate runs)."""
    run = tmp_path / "pos8"
    audit(run, *ORACLE[:2], "--limit", 8, *ORACLE[4:], "--inject", "kv-scale-from-position:33")
    out = tmp_path / "shrink"
    code, stdout, err = lpf("shrink", run, "--out", out, "--budget-runs", 20, "--tries", 1, "--json")
    doc = json.loads(stdout)
    assert code == 0 and doc["status"] == "done", err
    assert doc["minimal"]["size"][0] <= 4, doc["minimal"]
    cand = next(c for c in doc["candidates"] if c["id"] == doc["minimal"]["candidate"])
    minimal = out / next(t["dir"] for t in cand["tries"] if t["lie"])
    # the minimum still departs from position 33 on: where its prompt ended before it, exactly there
    (plen, onset), *_ = q(
        minimal,
        "SELECT len(r.prompt_token_ids), s.first_divergence + len(r.prompt_token_ids) FROM summary s "
        "JOIN requests r USING (request_id) WHERE s.verdict IN ('divergent', 'corrupt')",
    )
    assert onset == 33 if plen < 33 else onset == plen + 1


def test_fp4_kv_collapsing_to_one_token_is_named(oracle_twin, tmp_path):
    run = tmp_path / "fp4"
    findings, _ = audit(run, *ORACLE, "--inject", "kv-fp4-collapse")
    flagged, hit = check(run, oracle_twin[0], findings, "collapsed_to_one_token")
    assert flagged == hit and len(flagged) == 40
    assert "one token id, 0, for all of them" in findings["mechanisms"]["covered"][0]["sentence"]
    assert set(q(run, "SELECT DISTINCT unnest(output_token_ids[2:]) FROM requests")) == {(0,)}


def test_honest_fp8_prefix_caching_has_no_false_positive(shared_twin):
    _, findings, code = shared_twin
    assert code == 0 and findings["verdict"] == "clean" and findings["prefix_cache"]["requests_hit"] > 5


@pytest.mark.parametrize("drill", ["kv-offload-scales-lost", "kv-requant-on-hit"])
def test_a_prefix_hits_lost_or_doubled_scales_are_named(shared_twin, tmp_path, drill):
    run = tmp_path / drill
    findings, _ = audit(run, *SHARED, "--inject", drill)
    flagged, hit = check(run, shared_twin[0], findings, "prefix_cache_hit")
    assert len(flagged) >= 0.75 * len(hit)
