"""End to end on transformers: `lpf audit --engine hf` against the HF reference, float32."""

import json

import pyarrow.parquet as pq
import pytest

from conftest import lpf_main


def _check_clean(out, proc, n_prompts=200):
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(proc.stdout)
    assert findings == json.loads((out / "findings.json").read_text())
    assert findings["verdict"] == "clean"
    assert findings["n_requests"] == n_prompts
    assert findings["counts"] == {"clean": n_prompts, "noise": 0, "divergent": 0, "corrupt": 0}
    assert findings["flagged"] == []
    assert findings["n_scored_tokens"] == findings["n_tokens"] > n_prompts
    # float32 against float32: far inside the clean threshold, not merely under it
    assert findings["metrics"]["abs_logprob_diff"]["max"] < 1e-3
    summary = pq.read_table(out / "summary.parquet")
    assert set(summary.column("verdict").to_pylist()) == {"clean"}
    return findings


def test_audit_hf_hybrid_clean(hybrid_audit):
    out, proc = hybrid_audit
    findings = _check_clean(out, proc)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"]["name"] == "hf" and manifest["engine"]["version"]
    assert manifest["model"]["architecture"] == "GraniteMoeHybridForCausalLM"
    assert len(manifest["model"]["weights_sha256"]) == 64
    assert manifest["reference"]["dtype"] == "float32"
    assert manifest["status"] == "complete"
    assert findings["oracle"]["n"] == 200  # every prompt carried an expected answer
    assert "verdict: clean" in proc.stderr and "oracle accuracy" in proc.stderr


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_audit_hf_llama_clean(tmp_path, prompts_200):
    out = tmp_path / "llama"
    proc = lpf_main(
        "audit",
        "--engine",
        "hf",
        "--model",
        "tiny:llama",
        "--workload",
        prompts_200,
        "--max-tokens",
        12,
        "--out",
        out,
        "--json",
    )
    _check_clean(out, proc)


def test_sampled_run_is_clean_and_records_raw_logprobs(tmp_path, lpf_cli):
    """At temperature > 0 the engine must report raw logprobs: they still match the reference."""
    from conftest import write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": f"The baker {i} walked"} for i in range(12)])
    r = lpf_cli(
        "audit",
        "--engine",
        "hf",
        "--model",
        "tiny:llama",
        "--workload",
        prompts,
        "--temperature",
        1.5,
        "--top-k",
        20,
        "--n",
        2,
        "--max-tokens",
        10,
        "--out",
        tmp_path / "run",
        "--json",
    )
    assert r.code == 0, r.err
    findings = json.loads(r.out)
    assert findings["n_requests"] == 24 and findings["verdict"] == "clean"
    tokens = pq.read_table(tmp_path / "run" / "tokens").to_pylist()
    # top-k sampling with k=20 at T=1.5 would give very different (processed) logprobs
    assert all(len(t["engine_topk_ids"]) == 5 for t in tokens)
