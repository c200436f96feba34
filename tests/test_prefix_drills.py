"""Forensics of the prefix-caching drills, end to end through `lpf audit --engine builtin`.

For every drill of the class (docs/builtin-engine.md cites the pull request each re-creates): every
request the ground truth (`faults/`, which analysis never reads) marks corrupted gets a non-clean
verdict, nothing outside it does, and the first-ranked hypothesis names the mechanism. Honest
caching on the same workload: no false positive, the hit rate in findings. `prefix-cache-inert`: a
finding of its own (with the hit counts) in findings.json and on the terminal, no verdict.

Configuration: tiny:jamba-longmem (the seed's Mamba1 architecture with long memory), 240 requests of
zoo:shared-prefix, 8 output tokens, 48 tokens per step, 3 MB of cache.
"""

import json
import re

import pytest

from conftest import pre_fix_chunk_without_the_advance, write_prompts
from lpf.views.query import run_query

pytestmark = pytest.mark.slow  # eight audits of 240 requests

MODEL = "tiny:jamba-longmem"
KNOBS = ["--max-tokens", 8, "--max-num-batched-tokens", 48, "--cache-mb", 3]

from lpf.builtin.prefix_drills import KNOBS as DRILL_KNOBS  # noqa: E402
from lpf.builtin.prefix_drills import NAMED_BY  # noqa: E402

# drill -> (extra knobs, features the first hypothesis may name)
DRILLS = {
    d: ([a for k, v in DRILL_KNOBS[d].items() for a in ("-E", f"{k}={v}")], NAMED_BY[d])
    for d in (
        "conv-into-shared-block",
        "unaligned-chunk-hashed",
        "publish-before-write",
        "incomplete-block-cached",
        "resume-wrong-units",
    )
}


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    from lpf.zoo import registry

    return write_prompts(
        tmp_path_factory.mktemp("w") / "shared240.jsonl", registry.workload_items("shared-prefix", n=240)
    )


def audit(lpf_cli, out, workload, *args):
    r = lpf_cli(
        "audit",
        "--engine",
        "builtin",
        "--model",
        MODEL,
        "--workload",
        workload,
        *KNOBS,
        "--out",
        out,
        "--fail-on",
        "never",
        *args,
    )
    assert r.code == 0, r.err
    return json.loads((out / "findings.json").read_text()), r.out + r.err


def q(run, sql):
    return run_query(run, sql)[1]


def truth(run, role="corrupted"):
    if not (run / "faults").is_dir():
        return set()
    return {r[0] for r in q(run, f"SELECT DISTINCT request_id FROM faults WHERE role = '{role}'")}


def verdicts(run):
    return dict(q(run, "SELECT request_id, verdict FROM summary"))


def check_caught(run, findings, features):
    corrupted, v = truth(run), verdicts(run)
    flagged = {f["request_id"] for f in findings["flagged"]}
    assert corrupted, "the drill never fired"
    assert {r for r, x in v.items() if x != "clean"} == corrupted, "exactly the ground truth departs"
    # every one flagged: a nearly-right state (a few tenths of a nat, under the divergent threshold) is
    # still past the expected floor on most of its tokens (`analysis.localized`)
    assert flagged == corrupted
    top = findings["hypotheses"][0]
    assert top["feature"] in features, top
    assert top["flagged_with"] == top["flagged_total"] and top["clean_with"] == 0
    # and each flagged request's own mechanism is the drill's (`lpf.analysis.mechanisms`)
    from lpf.builtin.drill_truth import mechanism_share

    score = mechanism_share(findings["flagged"], q(run, "SELECT request_id, fault, role FROM faults"))
    assert score["share"] >= 0.95, score
    return top


@pytest.mark.parametrize("drill", DRILLS)
def test_prefix_drill_is_caught_and_named(lpf_cli, tmp_path, workload, drill):
    extra, features = DRILLS[drill]
    findings, _ = audit(lpf_cli, tmp_path / "d", workload, "--enable-prefix-caching", *extra, "--inject", drill)
    check_caught(tmp_path / "d", findings, features)
    assert findings["prefix_cache"]["requests_hit"] > 0


def test_stale_conv_on_reuse_is_caught_and_named(lpf_cli, tmp_path, workload):
    findings, _ = audit(lpf_cli, tmp_path / "s", workload, "--inject", "stale-conv-on-reuse")
    top = check_caught(tmp_path / "s", findings, NAMED_BY["stale-conv-on-reuse"])
    assert "started on a state slot an earlier request had used" in top["sentence"]


def test_honest_caching_has_no_false_positive_and_reports_its_hit_rate(lpf_cli, tmp_path, workload):
    findings, out = audit(lpf_cli, tmp_path / "h", workload, "--enable-prefix-caching")
    assert findings["verdict"] == "clean" and findings["counts"]["clean"] == 240 and findings["hypotheses"] == []
    pc = findings["prefix_cache"]
    assert pc["enabled"] and not pc["inert"] and pc["requests_hit"] > 100 and 0.3 < pc["hit_rate"] < 1
    assert f"prefix cache: {pc['requests_hit']}/240 requests hit" in " ".join(out.split())


def test_prefix_cache_inert_is_a_finding_not_a_verdict(lpf_cli, tmp_path, workload):
    findings, out = audit(
        lpf_cli, tmp_path / "i", workload, "--enable-prefix-caching", "--inject", "prefix-cache-inert"
    )
    assert findings["verdict"] == "clean" and not findings["flagged"] and findings["hypotheses"] == []
    pc = findings["prefix_cache"]
    assert pc["finding"] == "prefix-cache-inert" and pc["inert"]
    assert pc["requests_hit"] == 0 and pc["hit_tokens"] == 0 and pc["requests_sharing"] > 100
    text = " ".join(out.split())
    assert "finding: prefix-cache-inert" in text and f"{pc['requests_sharing']}/240 requests share" in text


def test_an_engine_that_stalls_fails_its_requests_with_the_crash_instead_of_hanging(
    lpf_cli, tmp_path, workload, monkeypatch
):
    """The pre-fix chunk rule without its sub-block advance (a 7-token step below a 16-token Mamba
    block): the scheduler stalls; the audit ends, every request holding the crash lpf shrink reads."""
    from lpf.builtin import chunk_align

    monkeypatch.setattr(chunk_align, "pre_fix_chunk", pre_fix_chunk_without_the_advance)
    few = write_prompts(tmp_path / "few.jsonl", [json.loads(x) for x in workload.read_text().splitlines()[:4]])
    args = ["--enable-prefix-caching", "--inject", "unaligned-chunk-hashed", "--max-num-batched-tokens", 7]
    r = lpf_cli("audit", "--model", MODEL, "--workload", few, "--max-tokens", 2, "--out", tmp_path / "r", *args)
    assert r.code == 2 and "every request failed (4 of 4)" in r.err and "SchedulerStallError" in r.err
    errors = q(tmp_path / "r", "SELECT DISTINCT error FROM requests")
    assert len(errors) == 1 and re.search(r"; raised at \S+/scheduler\.py:\d+ in schedule$", errors[0][0])
