"""The `llamacpp` engine: llama.cpp's own llama-server (built by `make llamacpp` from the llama.cpp that
llama-cpp-python 0.3.36's sdist vendors) on GGUFs written by llama.cpp's own converter.

Fast tests: the options (what --base-url refuses), the wire format's checks on answers shaped as
tools/server/server-task.cpp writes them, the trace table, and the zoo tokenizer's registration hash
against the converter's own test text. Real ones (skipped without the build; `make test` builds it):
zoo:jamba and zoo:hybrid audited through a real llama-server on 127.0.0.1 (clean per request at float32,
the engine's tokens the reference's greedy tokens), parallel slots with the slot trace, the vocabulary
round trip through the server, a Q4_K_M GGUF behind --base-url under the float32 name (caught by the
run-level test), and the server's logprob normaliser replayed to the bit (docs/real-engines.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import write_prompts
from lpf.adapters.base import Completion
from lpf.adapters.http import RequestFailed
from lpf.core.errors import LpfError
from lpf.core.sampling import SamplingParams
from lpf.core.workload import EngineRequest


def _built() -> bool:
    from lpf.adapters.llamacpp_gguf import find_tools

    try:
        find_tools()
        return True
    except LpfError:
        return False


needs_llamacpp = pytest.mark.skipif(not _built(), reason="llama.cpp not built: run `make llamacpp` (make test does)")


# -- options, wire format, trace (no server) ---------------------------------------------------------
def test_base_url_refuses_the_knobs_of_a_server_lpf_starts(lpf_cli, tmp_path):
    r = lpf_cli(
        "audit",
        "--engine",
        "llamacpp",
        "--base-url",
        "http://127.0.0.1:9",
        "-E",
        "parallel=4",
        "--model",
        "zoo:hybrid",
        "--out",
        tmp_path / "r",
    )
    assert r.code == 2 and "parallel configure a server lpf starts" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "r").exists()
    r = lpf_cli("audit", "--engine", "llamacpp", "--dtype", "q3_k", "--model", "zoo:hybrid", "--out", tmp_path / "r")
    assert r.code == 2 and "dtype must be" in r.err


def _req(n_prompt=4, max_tokens=4):
    return EngineRequest("r0", 0, "p0", 0, tuple(range(3, 3 + n_prompt)), max_tokens, 7)


def test_payload_sets_every_sampler_and_asks_for_raw_probabilities():
    from lpf.adapters import llamacpp_wire as wire

    greedy = wire.payload(_req(), SamplingParams(logprobs=0), cache_prompt=True)
    assert greedy["samplers"] == ["temperature"] and greedy["temperature"] == 0.0
    assert greedy["n_probs"] == 1 and greedy["post_sampling_probs"] is False and greedy["prompt"] == [3, 4, 5, 6]
    assert (
        greedy["min_p"],
        greedy["typical_p"],
        greedy["repeat_penalty"],
        greedy["top_k"],
        greedy["top_p"],
        greedy["mirostat"],
        greedy["dry_multiplier"],
        greedy["xtc_probability"],
    ) == (0.0, 1.0, 1.0, 0, 1.0, 0, 0.0, 0.0)
    sampled = wire.payload(_req(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logprobs=3), cache_prompt=False)
    assert sampled["samplers"] == ["temperature", "top_k", "top_p"] and sampled["n_probs"] == 3
    assert (sampled["top_k"], sampled["top_p"], sampled["cache_prompt"], sampled["ignore_eos"]) == (
        5,
        0.9,
        False,
        False,
    )
    assert wire.payload(_req(), SamplingParams(ignore_eos=True), True, ban_eos=True)["ignore_eos"] is True


def _body(ids, lps, **over):
    """An answer in the shape of server_task_result_cmpl_final::to_json_non_oaicompat."""
    probs = [
        {
            "id": t,
            "token": "x",
            "bytes": [120],
            "logprob": lp,
            "top_logprobs": [
                {"id": t, "token": "x", "bytes": [120], "logprob": lp},
                {"id": 9, "token": "y", "bytes": [121], "logprob": -3.4028234663852886e38},
            ],
        }
        for t, lp in zip(ids, lps)
    ]
    body = {
        "content": None,
        "tokens": list(ids),
        "id_slot": 2,
        "stop": True,
        "tokens_predicted": len(ids),
        "truncated": False,
        "stop_type": "limit",
        "tokens_cached": 8,
        "timings": {"cache_n": 3, "prompt_n": 1, "predicted_n": len(ids), "prompt_ms": 1.5, "predicted_ms": 2.5},
        "completion_probabilities": probs,
    }
    body.update(over)
    return body


def _parse(body, s=SamplingParams(logprobs=2)):
    from lpf.adapters import llamacpp_wire as wire

    def check_answer(req, ids, claimed, finish, text, problems, detail=None):
        if claimed != len(ids):
            problems.add("token_count", f"{claimed} != {len(ids)}")

    return wire.parse(_req(), body, s, 512, None, check_answer)


def test_parse_keeps_ids_and_raw_logprobs_and_reads_minus_flt_max_as_minus_inf():
    c = _parse(_body([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4]))
    assert isinstance(c, Completion) and c.output_token_ids == [5, 6, 7, 8] and c.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert c.topk_ids[0] == [5, 9] and c.topk_logprobs[0][1] == -math.inf
    assert c.finish_reason == "length" and c.inconsistency is None
    assert _parse(_body([5], [-0.1]), SamplingParams(logprobs=0)).topk_ids == []  # k=0: no top-k kept


def test_parse_keeps_inconsistent_answers_as_evidence_and_refuses_unusable_ones():
    c = _parse(_body([5, 6], [-0.1, -0.2], tokens=[5, 7], truncated=True, tokens_predicted=3))
    assert c.output_token_ids == [5, 6]
    assert "tokens:" in c.inconsistency and "truncated:" in c.inconsistency and "token_count:" in c.inconsistency
    with pytest.raises(RequestFailed, match="completion_probabilities"):
        _parse({"content": "x", "tokens": []})
    # no entry for any token: server-task.cpp leaves the key out; the tokens stand, without logprobs
    # (14 of 300 honest prose answers were failed requests, their tokens lost, before)
    body = _body([5], [-0.1], tokens=[6, 2], tokens_predicted=2)
    del body["completion_probabilities"]
    c = _parse(body)
    assert c.output_token_ids == [6, 2] and c.logprobs == [None, None] and c.topk_ids == [[], []]
    assert "logprobs_missing:" in c.inconsistency and "no completion_probabilities for any" in c.inconsistency
    with pytest.raises(RequestFailed, match="not a token id"):
        _parse(_body([600], [-0.1]))


def test_missing_probabilities_are_aligned_by_id_and_stored_as_none():
    # llama-server sends no entry for a token that ends inside a UTF-8 character (process_token):
    # tokens 6 and 8 here; the generated tokens stand, no logprob (and no top-k) where nothing came
    body = _body([5, 7], [-0.1, -0.3], tokens=[5, 6, 7, 8], tokens_predicted=4)
    c = _parse(body)
    assert c.output_token_ids == [5, 6, 7, 8] and c.logprobs[0] == -0.1 and c.logprobs[2] == -0.3
    assert c.logprobs[1] is None and c.logprobs[3] is None and c.topk_ids[1] == [] and c.topk_ids[2] == [7, 9]
    assert c.inconsistency.startswith("logprobs_missing: no completion_probabilities entry for 2 of 4 tokens")


def test_missing_probabilities_fall_where_llama_server_leaves_them_out():
    """A repeated token makes matching entries by id ambiguous: [a lone 3-byte lead, "7", "7", EOS] gets entries
    for positions 2 and 3 (llama-server's text is cut off until the second "7"); the first match put position
    2's logprob and top-k on position 1, and an honest float32 llama-server audit of prose had a request
    `divergent` by 0.58 nats. Replayed from the tokens' bytes, they land where the server sent them; without
    the bytes, or where the replay cannot hold the entries, the first match stands."""
    from lpf.adapters import llamacpp_wire as wire

    pieces = {170: b"\xe2", 25: b"7", 2: b"</s>", 5: b"a", 6: b"\xc3", 7: b"\xa9"}
    body = _body([25, 2], [-0.07, -1e-6], tokens=[170, 25, 25, 2], tokens_predicted=4)

    def check_answer(req, ids, claimed, finish, text, problems, detail=None):
        pass

    c = wire.parse(_req(), body, SamplingParams(logprobs=2), 512, pieces.get, check_answer)
    assert c.logprobs == [None, None, -0.07, -1e-6] and c.topk_ids[1] == [] and c.topk_ids[2] == [25, 9]
    assert "positions [0, 1]" in c.inconsistency
    assert _parse(body).logprobs == [None, -0.07, None, -1e-6]  # no bytes: the first match
    # a 2-byte character split over tokens 6 and 7: only 6 goes without, as the server does
    split = wire.parse(
        _req(),
        _body([5, 7], [-0.1, -0.2], tokens=[5, 6, 7], tokens_predicted=3),
        SamplingParams(),
        512,
        pieces.get,
        check_answer,
    )
    assert split.logprobs == [-0.1, None, -0.2]
    assert wire._cut_off(b"a\xe2\x82") and not wire._cut_off(b"\xe2\x82\xac") and wire._cut_off(b"\xf0\x9f\x98")


def test_trace_rows_use_lpf_columns_where_they_fit():
    from lpf.adapters import llamacpp_wire as wire
    from lpf.adapters.llamacpp import TRACE_SCHEMA, trace_table
    from lpf.run.schema import TRACE

    row = {**wire.slot_row(_req(n_prompt=6), _body([5], [-0.1])), "step": 0}
    table = trace_table([row, {**row, "step": 1, "cache_n": 0}])
    assert table.schema == TRACE_SCHEMA and table.schema.names[: len(TRACE.names)] == TRACE.names
    first, second = table.to_pylist()
    assert (first["state_slot"], first["num_computed_tokens"], first["num_scheduled_tokens"], first["phase"]) == (
        2,
        3,
        1,
        "extend",
    )
    assert second["phase"] == "prefill" and first["prefix_cache_hit_tokens"] == 3 and first["num_prompt_tokens"] == 6
    assert first["batch_size"] is None and first["preempted"] is False


def test_slot_context_follows_llama_context_padding():
    from lpf.adapters.llamacpp import LlamaCppOptions, slot_context

    assert slot_context(LlamaCppOptions(parallel=4, ctx_size=1024), 4096) == 256
    assert slot_context(LlamaCppOptions(parallel=4, ctx_size=1000), 4096) == 256
    assert slot_context(LlamaCppOptions(parallel=3, ctx_size=2048), 4096) == 768  # 682 padded to 256
    assert slot_context(LlamaCppOptions(parallel=8), 100_000) == 4096 and slot_context(LlamaCppOptions(), 300) == 512


@needs_llamacpp
@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_zoo_tokenizer_is_registered_under_the_hash_the_converter_computes():
    import ast
    import hashlib

    from lpf.adapters import llamacpp_convert
    from lpf.adapters.llamacpp_gguf import find_tools
    from lpf.core.model_specs import ModelRef, load_tokenizer
    from lpf.zoo.registry import tokenizer_dir

    source = (find_tools().converter_dir / "conversion" / "base.py").read_text()
    fn = next(
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "get_vocab_base_pre"
    )
    chktxt = llamacpp_convert.converter_chktxt(ast.get_source_segment(source, fn))
    assert chktxt and chktxt.startswith("\n \n\n")
    tok = load_tokenizer(ModelRef("zoo", tokenizer_dir()))
    digest = hashlib.sha256(str(tok.encode(chktxt)).encode()).hexdigest()
    assert llamacpp_convert.REGISTERED == {digest: "gpt-2"}


# -- real llama-server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oracle24(tmp_path_factory, prompts_200):
    lines = prompts_200.read_text().splitlines()[:24]
    return write_prompts(tmp_path_factory.mktemp("llamacpp") / "p24.jsonl", [json.loads(x) for x in lines])


def _tokens_are_reference_greedy(out: Path) -> None:
    """Every engine token is the reference's argmax at that position (teacher-forced on the engine's own
    prefix, so the sequences are transformers' greedy ones), and each ends at EOS or max_tokens."""
    import duckdb

    con = duckdb.connect()
    flips = con.execute(f"""SELECT count(*) FROM '{out}/tokens/*.parquet' t JOIN '{out}/reference/*.parquet' r
                            USING (request_id, position) WHERE t.token_id <> r.ref_top1_id""").fetchone()[0]
    assert flips == 0
    ends = con.execute(f"SELECT finish_reason, count(*) FROM '{out}/requests/*.parquet' GROUP BY 1").fetchall()
    assert {f for f, _ in ends} <= {"stop", "length"}


@needs_llamacpp
@pytest.mark.slow
@pytest.mark.parametrize("model", ["zoo:jamba", "zoo:hybrid"])
def test_llama_server_float32_is_clean_per_request_and_greedy_like_transformers(lpf_cli, tmp_path, oracle24, model):
    out = tmp_path / "run"
    r = lpf_cli(
        "audit",
        "--engine",
        "llamacpp",
        "--model",
        model,
        "--workload",
        oracle24,
        "--max-tokens",
        24,
        "-E",
        "threads=1",
        "--out",
        out,
        "--json",
    )
    # the default gate passes (issue 39: llama.cpp's float32 kernels and its float32 normaliser are measurably
    # not the reference's arithmetic, and the run test says so in a line of its own, not as `systematic`)
    assert r.code == 0, r.err
    f = json.loads(r.out)
    assert f["verdict"] == "clean" and f["run_test"]["result"] == "same", f["run_test"]["sentence"]
    assert f["counts"]["clean"] == f["n_requests"] == 24 and f["errors"] == 0
    # float32 rounding plus llama-server's float32 normaliser (test_reported_logprobs_are_...): < 5e-5
    assert f["metrics"]["abs_logprob_diff"]["max"] < 5e-5
    _tokens_are_reference_greedy(out)
    e = json.loads((out / "manifest.json").read_text())["engine"]
    assert e["name"] == "llamacpp" and e["dtype"] == "float32" and e["options"]["dtype"] == "float32"
    assert e["gguf"]["vocab_check"]["n_mismatches"] == 0 and set(e["gguf"]["tensor_types"]) == {"F32"}
    cmd = e["server"]["command"]
    assert (
        cmd[cmd.index("-ctk") + 1] == "f32" and cmd[cmd.index("-fa") + 1] == "off" and e["samplers"] == ["temperature"]
    )
    assert f["trace"] == {"recorded": True, "source": "engine", "rows": 24, "why": None}


@needs_llamacpp
@pytest.mark.slow  # a tiny model's GGUF (cached) and 16 requests through llama-server: ~15 s warm here
def test_partial_utf8_tokens_without_probabilities_leave_an_honest_run_clean(lpf_cli, tmp_path):
    """llama-server sends no probabilities for a token that ends inside a UTF-8 character
    (tools/server/server-context.cpp, `process_token`): a tiny random-weight Jamba (conformance's) writes
    such tokens in most of its 16 requests. They are judged from their tokens alone (`lpf.analysis.absent`),
    not as logprob errors: the honest float32 run is clean, the run test `same`, the default gate passes,
    and the server's `logprobs_missing` stays recorded as evidence."""
    import pyarrow.compute as pc

    from lpf.core.model_specs import ModelRef, load_tokenizer
    from lpf.experiments.conformance.grid import write_workload
    from lpf.experiments.conformance.tiny import build_tiny

    model = build_tiny("jamba")
    tok = load_tokenizer(ModelRef("tiny jamba", model))
    workload = write_workload(tmp_path / "w.jsonl", 16, len(tok), bos=tok.bos_token_id)
    out = tmp_path / "run"
    r = lpf_cli(
        "audit",
        "--engine",
        "llamacpp",
        "--model",
        model,
        "--workload",
        workload,
        "--max-tokens",
        12,
        "-E",
        "dtype=float32",
        "-E",
        "threads=1",
        "--out",
        out,
        "--json",
    )
    assert r.code == 0, r.err
    f = json.loads(r.out)
    missing = f["judged"].get("no_logprob", 0)
    assert f["judged"]["logprobs"] == "some" and missing > 0  # the server left tokens out: the case at hand
    assert f["verdict"] == "clean" and f["run_test"]["result"] == "same", f["run_test"]["sentence"]
    assert f["counts"]["clean"] == f["n_requests"] == 16
    assert f["metrics"]["abs_logprob_diff"]["max"] < 1e-3
    inconsistent = f["evidence"]["inconsistent"]
    assert inconsistent["by_reason"].get("logprobs_missing", 0) > 0 and inconsistent["flagged"] == 0
    summary = pq.read_table(out / "summary.parquet")
    assert pc.sum(summary.column("n_no_logprob")).as_py() == missing
    assert pq.read_table(out / "tokens").column("engine_logprob").null_count == missing
    _tokens_are_reference_greedy(out)


@needs_llamacpp
@pytest.mark.slow
def test_parallel_slots_are_reused_and_traced(lpf_cli, tmp_path, oracle24):
    """4 slots of 256 tokens, each prompt twice (rollouts share a prompt): 8 requests in flight, then
    one at a time, where the second rollout lands on the slot its twin left and reuses its prompt
    (llama-server picks a slot by prompt similarity and restores the context checkpoint near the
    prompt's end: the recurrent state cannot be rewound otherwise)."""
    runs = {}
    for name, extra in (("concurrent", []), ("sequential", ["-E", "concurrency=1"])):
        out = tmp_path / name
        r = lpf_cli(
            "audit",
            "--engine",
            "llamacpp",
            "--model",
            "zoo:hybrid",
            "--workload",
            oracle24,
            "--n",
            2,
            "--max-tokens",
            16,
            "-E",
            "parallel=4",
            "-E",
            "ctx_size=1024",
            "-E",
            "threads=1",
            *extra,
            "--out",
            out,
            "--json",
            "--fail-on",
            "never",
        )
        assert r.code == 0, r.err
        f = json.loads(r.out)
        assert f["counts"]["clean"] == 48 and f["errors"] == 0 and f["metrics"]["abs_logprob_diff"]["max"] < 5e-5
        trace = pq.read_table(out / "trace").to_pylist()
        assert len(trace) == 48 and sorted(t["step"] for t in trace) == list(range(48))
        per_slot: dict = {}
        for t in trace:
            per_slot.setdefault(t["state_slot"], []).append(t)
        assert set(per_slot) == {0, 1, 2, 3} and all(len(rows) > 1 for rows in per_slot.values())
        assert all(t["num_computed_tokens"] + t["num_scheduled_tokens"] == t["num_prompt_tokens"] for t in trace)
        e = json.loads((out / "manifest.json").read_text())["engine"]
        assert e["props"]["total_slots"] == 4 and e["options"]["parallel"] == 4
        c = e["configuration"]  # /props' file type and defaults, lpf's own command line for the rest
        assert c["dtype"] == {"value": "float32", "source": "engine", "via": "GET /props model_ftype 'all F32'"}
        assert c["weight_quantization"]["value"] == "none" and c["kv_cache_dtype"]["value"] == "float32"  # -ctk f32
        assert c["flash_attention"]["value"] == "off" and "f16 copy" in c["flash_attention"]["via"]
        assert "repeat_penalty" in c["sampling_defaults"]["value"]
        runs[name] = {t["request_id"]: t for t in trace}
    reused = {rid for rid, t in runs["sequential"].items() if t["num_computed_tokens"] > 0}
    assert reused == {rid for rid in runs["sequential"] if rid.endswith("-r1")}
    assert all(
        runs["sequential"][rid]["phase"] == "extend" and runs["sequential"][rid]["num_scheduled_tokens"] >= 1
        for rid in reused
    )


@pytest.fixture(scope="module")
def hybrid_server_q4(tmp_path_factory):
    """llama-server started by the test on a Q4_K_M GGUF of zoo:hybrid (the user's server)."""
    from lpf.adapters.llamacpp_gguf import find_tools, gguf_for
    from lpf.adapters.llamacpp_server import LlamaServer
    from lpf.core.model_specs import resolve_model

    tools = find_tools()
    gguf = gguf_for(resolve_model("zoo:hybrid"), "q4_k_m", tools)
    server = LlamaServer(tools.server, gguf.path, ["-np", "2", "-c", "2048", "-t", "1"]).start()
    yield server, gguf
    server.cleanup()


@needs_llamacpp
@pytest.mark.slow
def test_q4_k_gguf_under_the_float32_name_is_caught_by_the_run_level_test(
    lpf_cli, tmp_path, oracle24, hybrid_server_q4
):
    server, gguf = hybrid_server_q4
    assert gguf.dtype == "q4_k_m" and gguf.header["file_type_name"] == "MOSTLY_Q4_K_M"
    out = tmp_path / "run"
    r = lpf_cli(
        "audit",
        "--engine",
        "llamacpp",
        "--base-url",
        server.base_url,
        "--dtype",
        "float32",
        "--model",
        "zoo:hybrid",
        "--workload",
        oracle24,
        "--max-tokens",
        16,
        "--out",
        out,
        "--json",
        "--fail-on",
        "never",
    )
    assert r.code == 0, r.err
    f = json.loads(r.out)
    rt = f["run_test"]
    # judged by llama-server's defaults (f16 K/V: /props says neither its KV type nor flash attention), the more
    # lenient row, and still caught
    assert f["errors"] == 0 and rt["result"] == "different" and rt["floor_pair"] == "float32/float32 kv=float16"
    # 9.4x that row since it covers chat-template prompts (scripts/measure_floor_chat.py; 30x before), 100x+
    # float32's: still rejected at the test's minimum of 10 tokens
    assert 0 < rt["tokens_needed"] <= rt["n_tokens"] and rt["effect_size"] > 5
    e = json.loads((out / "manifest.json").read_text())["engine"]
    assert e["server"] == {"started_by": "user", "base_url": server.base_url} and e["options"]["dtype"] == "float32"
    assert e["props"]["total_slots"] == 2
    # the server's own word (its GGUF's file type) recorded, the user's float32 beside it as a conflict
    c = e["configuration"]
    assert c["dtype"] == {
        "value": "q4_k_m",
        "source": "engine",
        "via": "GET /props model_ftype 'Q4_K - Medium'",
        "declared": "float32",
        "conflict": True,
    }
    assert c["weight_quantization"]["value"] == "Q4_K - Medium" and c["flash_attention"]["source"] == "absent"
    # llama-server as a server reference: its completions API gives no prompt logprobs (vLLM's field is ignored,
    # `echo` echoes no prompt logprobs), so it is refused in one line that names both
    import shutil

    shutil.copytree(out, tmp_path / "by-server")
    url = server.base_url + "/v1"
    r = lpf_cli("rescore", tmp_path / "by-server", "--redo", "--reference", url, "--reference-model", "zoo:hybrid")
    assert r.code == 2 and f"the reference at {url} gives no prompt logprobs (field: " in r.err, r.err
    said = [line for line in r.err.splitlines() if line.startswith("error:")]  # after the progress bar
    assert len(said) == 1 and "echo: " in said[0] and "Traceback" not in r.err


@needs_llamacpp
@pytest.mark.slow
def test_vocabulary_round_trips_through_the_server(hybrid_server_q4):
    import httpx

    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.zoo import registry

    server, gguf = hybrid_server_q4
    tok = load_tokenizer(resolve_model("zoo:hybrid"))
    assert gguf.vocab["n_mismatches"] == 0 and gguf.vocab["n_tokens"] == len(tok) and gguf.vocab["pre"] == "gpt-2"
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        for i in range(len(tok)):  # every id decodes to the Hugging Face tokenizer's text
            assert c.post("/detokenize", json={"tokens": [i]}).json()["content"] == tok.decode([i]), i
        for it in registry.workload_items("stress", seed=3, n=40):  # and text tokenizes the same way
            want = tok(it["prompt"], add_special_tokens=False)["input_ids"]
            assert c.post("/tokenize", json={"content": it["prompt"], "add_special": False}).json()["tokens"] == want


@needs_llamacpp
@pytest.mark.slow
def test_reported_logprobs_are_the_float32_running_sum_normaliser():
    """The departure every float32 llama.cpp run shows: scripts/repro/llamacpp_logprob_normalizer.py."""
    import runpy

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    repro = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts/repro/llamacpp_logprob_normalizer.py"))
    import httpx

    from lpf.adapters.llamacpp_gguf import find_tools, gguf_for
    from lpf.adapters.llamacpp_server import LlamaServer
    from lpf.core.model_specs import load_tokenizer, resolve_model

    model = resolve_model("zoo:jamba")
    tok, tools = load_tokenizer(model), find_tools()
    ids = tok("copy:KQ7LMB3RZN|")["input_ids"]  # an uncertain position: a visible tail
    server = LlamaServer(
        tools.server,
        gguf_for(model, "float32", tools).path,
        ["-np", "1", "-c", "512", "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-t", "1"],
    ).start()
    try:
        body = httpx.post(
            server.base_url + "/completion",
            timeout=60,
            json={
                "prompt": ids,
                "n_predict": 1,
                "n_probs": len(tok),
                "post_sampling_probs": False,
                "samplers": ["temperature"],
                "temperature": 0,
                "cache_prompt": False,
            },
        ).json()
    finally:
        server.cleanup()
    got = np.array(
        [a["logprob"] for a in sorted(body["completion_probabilities"][0]["top_logprobs"], key=lambda a: a["id"])]
    )
    m = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0, -1].double().numpy()
    top = int(np.argmax(logits))
    too_high = got[top] - (logits[top] - np.logaddexp.reduce(logits))
    assert np.exp(got).sum() > 1 + 1e-6 and too_high > 1e-6  # the reported distribution sums to more than 1
    # the float32 running sum replayed on the float64 model's logits lands next to the server's number
    assert abs(got[top] - repro["replay"](logits)[top]) < 0.2 * too_high


@needs_llamacpp
@pytest.mark.slow
def test_a_q8_0_kv_cache_runs_with_flash_attention_on_and_says_why(lpf_cli, tmp_path):
    """`-E cache_type_k=q8_0 -E cache_type_v=q8_0` on zoo:jamba stopped before the first request ("failed to
    create context": a quantized V cache needs flash attention, which lpf turned off for float32)."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"K{i}2,A37|K{i}2|"} for i in range(1, 5)])
    out = tmp_path / "run"
    r = lpf_cli(
        "run", "--engine", "llamacpp", "--model", "zoo:jamba", "--workload", prompts, "--max-tokens", 4,
        "-E", "cache_type_k=q8_0", "-E", "cache_type_v=q8_0", "-E", "threads=1", "--out", out,
    )  # fmt: skip
    assert r.code == 0, r.err
    reqs = pq.read_table(out / "requests").to_pylist()
    assert len(reqs) == 4 and all(x["error"] is None and x["output_token_ids"] for x in reqs)
    e = json.loads((out / "manifest.json").read_text())["engine"]
    assert "-fa" in e["server"]["command"] and e["server"]["command"][e["server"]["command"].index("-fa") + 1] == "on"
    c = e["configuration"]
    assert c["kv_cache_dtype"]["value"] == "q8_0" and c["flash_attention"]["value"] == "on"
    assert "quantized V cache (q8_0) needs flash attention" in c["flash_attention"]["via"]
    bad = lpf_cli(
        "run", "--engine", "llamacpp", "-E", "cache_type_v=q4_0", "-E", "flash_attn=off", "--out", tmp_path / "x"
    )
    assert bad.code == 2 and "runs only with flash attention" in bad.err and "Traceback" not in bad.err


@needs_llamacpp
@pytest.mark.slow  # two audits of 24 requests through llama-server
@pytest.mark.parametrize(
    "knobs, pair, why",
    [
        (["-E", "flash_attn=on"], "float32/float32 kv=float16", "flash attention's f16 copy"),
        (["-E", "cache_type_k=q8_0", "-E", "cache_type_v=q8_0"], "float32/float32 kv=q8_0", "a q8_0 KV cache"),
    ],
    ids=["flash-attention", "q8_0-kv"],
)
def test_a_configured_kv_is_judged_against_its_own_floor(lpf_cli, tmp_path, oracle24, knobs, pair, why):
    """Issue 52: llama-server's flash attention on a float32 KV cache (its default -fa) computes on an f16 copy
    (docs/bugs.md 18) and a q8_0 KV cache rounds K and V: honest configurations, judged `systematic` against
    float32's floor. The run's configuration names the floor row measured for it (scripts/measure_floor_config.py),
    the run is `same` with a line saying what departs and why, exit 0."""
    out = tmp_path / "run"
    r = lpf_cli(
        "audit", "--engine", "llamacpp", "--model", "zoo:jamba", "--workload", oracle24, "--max-tokens", 24,
        "-E", "threads=1", *knobs, "--out", out, "--json",
    )  # fmt: skip
    assert r.code == 0, r.err
    f = json.loads(r.out)
    assert f["thresholds"]["noise_floor"]["pair"] == pair and f["run_test"]["result"] == "same"
    assert (
        why in f["run_test"]["configured_sentence"]
        and "configured, not a fault" in f["run_test"]["configured_sentence"]
    )
