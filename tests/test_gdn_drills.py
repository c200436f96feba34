"""The recurrent-state drills of issue 54 on the Gated DeltaNet hybrid, end to end through `lpf audit`.

tiny:qwen35-longmem (tiny:qwen35 with a slowly decaying delta-rule memory and a 4x LM head, so a wrong
state shows), greedy zoo:shared-prefix requests: 16 of 8 tokens; for the speculative drills 12, every
other one asking for 1 token (it never decodes, so never speculates: the requests those drills leave
whole) and the rest for 6, the draft model the target itself (every draft accepted, so a state kept at
the wrong position is never a rejected draft's); spec-state-before-accept on the trained zoo:qwen35 with
n-gram drafts, 16 zoo:oracle requests of up to 32 tokens (with self-drafts and 6 tokens its run is
spec-state-block-zero's token for token: both keep block 0 up to a request's first harm). For each
drill: the ground truth (`faults/`, which analysis never reads) fired on some requests and not all; the
requests flagged are exactly those it marks corrupted (recall 1.0 over the harmed requests, no false
positive); the first hypothesis is the drill's catalogued feature, for all of them and no clean request;
each flagged request's own mechanism is the drill's (`drill_truth`); and the clean twin (the same
configuration, no drill) flags nothing. `state-fp16` changes every request by a
float16 rounding of the state: every request departs as `noise` (the verdict of a precision change) and
nothing is flagged. Every drill runs on the shared Mamba state paths (`mamba_base`,
`speculative_decode`, `prefix_drills`), not on GDN-only code.
"""

from __future__ import annotations

import json

import pytest

from conftest import write_prompts
from lpf.builtin.drill_catalog import CATALOG
from lpf.builtin.drill_truth import mechanism_share
from lpf.views.query import run_query

pytestmark = pytest.mark.slow  # eleven audits of 12-16 requests

MODEL = "tiny:qwen35-longmem"
N = 16
CONFIGS = {
    "chunked": ["--max-num-batched-tokens", 64],
    "prefix": ["--max-num-batched-tokens", 32, "--enable-prefix-caching", "-E", "mamba_block_size=16"],
    "draft": ["-E", f"speculative=draft:{MODEL}:3"],
    # the trained GDN model with n-gram drafts (the last --model wins): accepted counts vary, so
    # spec-state-before-accept's previous count is not block zero's after a request's first harm
    "ngram": ["--model", "zoo:qwen35", "-E", "speculative=ngram:3", "--max-tokens", 32],
}
DRILLS = {
    "chunk-state-transposed": "chunked",
    "padding-updates-state": "chunked",
    "snapshot-never-written": "prefix",
    "spec-verify-zero-state": "draft",
    "spec-state-block-zero": "draft",
    "spec-state-before-accept": "ngram",
}


@pytest.fixture(scope="module")
def workloads(tmp_path_factory):
    """{"draft": 12 requests, every other one of 1 token; "ngram": 16 zoo:oracle requests; "": 16 of 8 tokens}."""
    from lpf.zoo import registry

    at = tmp_path_factory.mktemp("w")
    spec = [
        dict(it, max_tokens=6 if i % 2 else 1) for i, it in enumerate(registry.workload_items("shared-prefix", n=12))
    ]
    plain = [dict(it, max_tokens=8) for it in registry.workload_items("shared-prefix", n=N)]
    oracle = registry.workload_items("oracle", n=16)
    return {
        "draft": write_prompts(at / "spec.jsonl", spec),
        "ngram": write_prompts(at / "oracle.jsonl", oracle),
        "": write_prompts(at / "plain.jsonl", plain),
    }


def workload(workloads, config: str):
    return workloads.get(config, workloads[""])


def audit(lpf_cli, out, workload, *args):
    r = lpf_cli(
        "audit", "--engine", "builtin", "--model", MODEL, "--workload", workload, "--out", out, "--fail-on", "never", *args,
    )  # fmt: skip
    assert r.code == 0, r.err
    return json.loads((out / "findings.json").read_text())


def q(run, sql):
    return run_query(run, sql)[1]


@pytest.mark.parametrize("config", sorted(set(DRILLS.values())))
def test_clean_twin_flags_nothing(lpf_cli, tmp_path, workloads, config):
    findings = audit(lpf_cli, tmp_path / "r", workload(workloads, config), *CONFIGS[config])
    assert findings["flagged"] == [] and set(findings["counts"]) == {"clean", "noise", "divergent", "corrupt"}
    assert findings["counts"]["clean"] == sum(findings["counts"].values()), findings["counts"]


@pytest.mark.parametrize("drill", DRILLS)
def test_drill_is_caught_and_named(lpf_cli, tmp_path, workloads, drill):
    run, config = tmp_path / "r", DRILLS[drill]
    findings = audit(lpf_cli, run, workload(workloads, config), *CONFIGS[config], "--inject", drill)
    corrupted = {r[0] for r in q(run, "SELECT DISTINCT request_id FROM faults WHERE role = 'corrupted'")}
    flagged = {f["request_id"] for f in findings["flagged"]}
    assert corrupted and len(corrupted) < sum(findings["counts"].values()), (
        "the drill must harm some requests and leave others"
    )
    assert flagged == corrupted  # recall 1.0 over the harmed requests, no false positive
    top = findings["hypotheses"][0]
    assert top["feature"] in CATALOG[drill].named_by, top
    assert top["flagged_with"] == top["flagged_total"] and top["clean_with"] == 0, top
    score = mechanism_share(findings["flagged"], q(run, "SELECT request_id, fault, role FROM faults"))
    assert score["share"] == 1.0, score


def test_state_fp16_departs_everywhere_as_noise(lpf_cli, tmp_path, workloads):
    run = tmp_path / "r"
    findings = audit(lpf_cli, run, workload(workloads, "chunked"), *CONFIGS["chunked"], "--inject", "state-fp16")
    touched = {r[0] for r in q(run, "SELECT DISTINCT request_id FROM faults WHERE fault = 'state-fp16'")}
    assert len(touched) == N and findings["counts"]["noise"] == N and findings["flagged"] == [], findings["counts"]
