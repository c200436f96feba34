"""Prefix caching in the built-in engine, engine level (no reference, no CLI): honest caching agrees
with no caching while really hitting, and each drill corrupts exactly the requests its ground truth
names (the requests whose outputs depart from the same run without caching).

The workload is zoo:shared-prefix (fan-outs, sub-block prefixes, conversations, exact resends and a
client that cancels mid-prefill and resends), run through the built-in adapter as `lpf run` would.
The forensics of the same drills (flagged, top hypothesis) are in test_prefix_drills.py (slow).
Only the cancel-and-resend test is fast; the rest run the workload twice or more.
"""

import numpy as np
import pytest

from lpf.adapters.builtin import BuiltinEngine, BuiltinOptions
from lpf.builtin.prefix_drills import KNOBS as DRILL_KNOBS
from lpf.core.model_specs import load_tokenizer, resolve_model
from lpf.core.sampling import SamplingParams
from lpf.core.workload import expand, load_prompts

N = 160
KNOBS = {"max_num_batched_tokens": 48, "cache_mb": 3}


def run(model: str, n: int = N, **options):
    """(completions by id, trace, faults, engine description) of zoo:shared-prefix on the built-in engine."""
    ref = resolve_model(model)
    tok = load_tokenizer(ref)
    sampling = SamplingParams(max_tokens=8)
    from lpf.zoo import registry

    items = registry.workload_items("shared-prefix", n=n)
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(i) + "\n" for i in items))
    prompts, _ = load_prompts(f.name, tok, len(tok), None)
    engine = BuiltinEngine(ref, sampling, BuiltinOptions.parse({**KNOBS, **options}))
    done = {c.request_id: c for c in engine.generate(expand(prompts, 1, sampling))}
    sides = engine.side_tables()
    return done, sides["trace"], sides["faults"], engine.engine.describe()


def departed(a: dict, b: dict, tol: float = 1e-3) -> set[str]:
    """Requests whose tokens or logprobs differ between two runs (beyond float32 rounding)."""
    out = set()
    for rid, ca in a.items():
        cb = b[rid]
        if (
            ca.output_token_ids != cb.output_token_ids
            or np.max(np.abs(np.subtract(ca.logprobs, cb.logprobs)), initial=0) > tol
        ):
            out.add(rid)
    return out


@pytest.fixture(scope="module")
def baseline():
    return {m: run(m)[0] for m in ("tiny:jamba-longmem",)}


@pytest.mark.slow  # two runs of a zoo model each
@pytest.mark.parametrize(
    "model, mode", [("zoo:hybrid", "align"), ("zoo:jamba", "all"), ("tiny:jamba-longmem", "align")]
)
def test_caching_agrees_with_no_caching_while_really_hitting(model, mode):
    off, _, _, _ = run(model)
    on, trace, faults, info = run(
        model, enable_prefix_caching=True, mamba_cache_mode=mode, mamba_block_size=16 if mode == "align" else 32
    )
    assert faults is None
    assert [on[r].output_token_ids for r in off] == [off[r].output_token_ids for r in off]
    worst = max(np.max(np.abs(np.subtract(on[r].logprobs, off[r].logprobs)), initial=0) for r in off)
    assert worst <= 1e-4
    stats = info["prefix_cache"]
    hits = [h for h in trace.column("prefix_cache_hit_tokens").to_pylist() if h]
    assert sum(hits) == stats["hit_tokens"] > 0.25 * stats["query_tokens"] and stats["hits"] > N // 3
    # every resume is honest: the state read covers exactly the hit and was written by its publisher
    rows = [r for r in trace.to_pylist() if r["prefix_cache_hit_tokens"]]
    assert rows and all(
        r["resume_covers_tokens"] == r["prefix_cache_hit_tokens"] and r["resume_writer"] == r["resume_publisher"]
        for r in rows
    )


DRILLS = {d: k for d, k in DRILL_KNOBS.items() if d not in ("prefix-cache-inert", "stale-conv-on-reuse")}


@pytest.mark.slow  # a run per drill beside the baseline run
@pytest.mark.parametrize("drill", DRILLS)
def test_each_drill_corrupts_exactly_the_requests_its_ground_truth_names(baseline, drill):
    model = "tiny:jamba-longmem"
    got, trace, faults, _ = run(model, enable_prefix_caching=True, inject=drill, **DRILLS[drill])
    assert faults is not None, f"{drill} never fired on the shared-prefix workload"
    rows = faults.to_pylist()
    assert {r["fault"] for r in rows} == {drill} and {r["role"] for r in rows} == {"corrupted"}
    truth = {r["request_id"] for r in rows}
    assert departed(baseline[model], got) == truth


@pytest.mark.slow
def test_stale_conv_on_reuse_needs_no_prefix_cache(baseline):
    """SGLang #24717: a prefill on a reused slot takes its stale conv state; nothing else departs."""
    got, _, faults, _ = run("tiny:jamba-longmem", inject="stale-conv-on-reuse")
    truth = {r["request_id"] for r in faults.to_pylist() if r["role"] == "corrupted"}
    assert truth and departed(baseline["tiny:jamba-longmem"], got) == truth


@pytest.mark.slow
def test_prefix_cache_inert_is_on_and_supplies_nothing(baseline):
    got, trace, faults, info = run("tiny:jamba-longmem", enable_prefix_caching=True, inject="prefix-cache-inert")
    assert faults is None and not departed(baseline["tiny:jamba-longmem"], got)
    assert set(trace.column("prefix_cache_hit_tokens").to_pylist()) == {0}
    assert info["prefix_cache"]["hits"] == 0 and info["prefix_cache"]["mamba_block_size"] > 4096


def test_a_cancelled_request_is_resent_and_both_attempts_are_kept():
    got, trace, _, _ = run("tiny:jamba-longmem", n=40, enable_prefix_caching=True)
    resent = [c for c in got.values() if c.attempts]
    assert resent and all(
        len(c.attempts) == 2
        and c.attempts[0]["error"].startswith("cancelled by the client")
        and c.attempts[1]["error"] is None
        and c.error is None
        for c in resent
    )
    aborted = [r for r in trace.to_pylist() if r["aborted"]]
    assert {r["request_id"] for r in aborted} == {f"{c.request_id}~attempt0" for c in resent}
    assert all(r["phase"] is None and r["num_scheduled_tokens"] > 0 for r in aborted)


def test_a_request_asking_for_prompt_logprobs_never_reads_the_cache():
    """Prompt logprobs need every prompt position computed (a self-reference's second pass: prompt + output sent
    back as a prompt): such a request is prefilled whole, as vLLM does (skip_reading_prefix_cache), and gets every
    prompt row; a plain request with the same prefix right after it still hits what it published."""
    from lpf.core.workload import EngineRequest

    ref = resolve_model("tiny:jamba-longmem")
    sampling = SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=True)
    engine = BuiltinEngine(ref, sampling, BuiltinOptions.parse({**KNOBS, "enable_prefix_caching": True}))
    ids = tuple(range(5, 5 + 40))
    first, again = (
        next(iter(engine.generate([EngineRequest(rid, i, rid, 0, ids, max_tokens=1, seed=0)])))
        for i, rid in enumerate(("a", "b"))
    )
    assert first.error is None and again.error is None, again.error
    assert len(again.prompt_logprobs) == len(ids) - 1
    assert np.max(np.abs(np.subtract(first.prompt_logprobs, again.prompt_logprobs))) < 1e-5
    engine.sampling = SamplingParams(max_tokens=1, logprobs=1)
    (plain,) = engine.generate([EngineRequest("c", 2, "c", 0, ids, max_tokens=1, seed=0)])
    trace = engine.side_tables()["trace"].to_pylist()
    hit = {r["request_id"]: r["prefix_cache_hit_tokens"] for r in trace if r["prefix_cache_hit_tokens"] is not None}
    assert not hit.get("a") and not hit.get("b") and hit.get("c"), hit


def test_bad_prefix_knobs_and_cancel_points_are_refused_in_one_line(lpf_cli, tmp_path):
    from conftest import write_prompts

    base = ["audit", "--engine", "builtin", "--model", "tiny:jamba-longmem", "--out"]
    cases = [
        (["--inject", "conv-into-shared-block"], "needs --enable-prefix-caching"),
        (["--enable-prefix-caching", "--inject", "resume-wrong-units"], "add -E mamba_block_size=32"),
        (["--enable-prefix-caching", "--inject", "incomplete-block-cached"], "mamba_cache_mode=all"),
        (["--enable-prefix-caching", "-E", "mamba_block_size=20"], "must be a multiple of block_size"),
    ]
    for i, (args, words) in enumerate(cases):
        r = lpf_cli(*base, tmp_path / f"r{i}", *args)
        assert r.code == 2 and words in r.err and "Traceback" not in r.err, (args, r.err)
    bad = write_prompts(tmp_path / "bad.jsonl", [{"prompt": "R:A12|A", "abort_after_tokens": 40}])
    r = lpf_cli(*base, tmp_path / "w", "--workload", bad)
    assert r.code == 2 and "bad.jsonl:1: 'abort_after_tokens' must be an integer from 1" in r.err
