"""Flash attention's signature when a server does not say its KV cache (issue 52), on recorded evidence.

tests/data/kv_signature/*.parquet: the first 120 zoo:stress requests (greedy, 32 tokens, zoo:jamba float32 GGUF,
top-20 on both sides, the float32 transformers reference) of three real llama-server runs, tokens and
reference joined row by row (`seq`: arrival order):
  fa-on    a llama-server the user started with `-ctk f32 -ctv f32 -np 8` and flash attention at its default
           (auto: on): an f16 copy of K/V (/work/runs-userfa, 2026-12-07)
  fa-off   lpf's managed llama-server with `-fa off`: exact float32 kernels of llama.cpp's own
  kv-q8_0  lpf's managed llama-server with a q8_0 KV cache (`-ctk q8_0 -ctv q8_0`, flash attention on)
Each is judged as a server that says nothing of its KV cache would be (`kv_seen`), declared float32 and with its
dtype unknown: the f16 copy is named and `same`; exact float32 stays float32's; the undeclared 8-bit KV cache
stays `different`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from lpf.analysis import floors, kv_signature
from lpf.analysis.floors import expected_floor, observed_logit_error
from lpf.analysis.metrics import join_grouped
from lpf.analysis.run_test import run_level_test

DATA = Path(__file__).parent / "data" / "kv_signature"
TOKENS = ["request_id", "position", "token_id", "engine_logprob", "engine_topk_ids", "engine_topk_logprobs"]
REFERENCE = ["request_id", "position", "ref_logprob", "ref_top1_id", "ref_top1_logprob", "ref_topk_ids"]


@pytest.fixture(scope="module")
def table():
    return json.loads((Path(floors.__file__).parent / "floors.json").read_text())


def _recorded(name: str):
    rows = pq.read_table(DATA / f"{name}.parquet")
    tokens = rows.select(TOKENS)
    reference = rows.select(REFERENCE + ["ref_topk_logprobs"])
    first = pc.equal(rows.column("position"), 0)
    requests = rows.filter(first).select(["request_id", "seq"])
    return tokens, reference, requests


def _judged(table, name: str, engine_dtype: str | None):
    tokens, reference, requests = _recorded(name)
    seen = kv_signature.seen([kv_signature.spread(tokens, reference)])
    joined, starts = join_grouped(tokens, reference)
    d = joined.column("engine_logprob").to_numpy() - joined.column("ref_logprob").to_numpy()
    observed = observed_logit_error(d, joined.column("ref_logprob").to_numpy()) if engine_dtype is None else None
    floor = expected_floor(table, engine_dtype, "float32", "zoo:jamba", observed=observed, kv_seen=seen)
    test = run_level_test(joined, tokens, reference, requests, floor, {"temperature": 0.0}, starts=starts)
    return seen, floor, test


@pytest.mark.parametrize("dtype", ["float32", None])
def test_an_f16_copy_of_the_kv_cache_is_named_and_judged_by_its_row(table, dtype):
    seen, floor, test = _judged(table, "fa-on", dtype)
    assert seen["n"] >= 600 and floor["pair"] == "float32/float32 kv=float16", floor["detail"]
    assert floor["configured"]["inferred"] and "--kv-cache-dtype float16" in floor["configured"]["inferred"]
    assert test["result"] == "same", test["sentence"]
    line = test["configured_sentence"]
    assert line.startswith("departs from the reference as an f16 KV copy (flash attention") and "-fa off" in line
    # the same evidence against float32's own floor: hundreds of times it (the false `systematic` of issue 52)
    plain = expected_floor(table, "float32", "float32", "zoo:jamba")
    assert test["floors"]["observed"]["topk"]["q99"] > 100 * plain["topk"]["q99"]


@pytest.mark.parametrize("dtype", ["float32", None])
def test_exact_float32_kernels_stay_judged_by_float32s_floor(table, dtype):
    _, floor, test = _judged(table, "fa-off", dtype)
    assert floor["pair"] == "float32/float32" and "configured" not in floor, floor["detail"]
    assert test["result"] == "same" and "configured_sentence" not in test


@pytest.mark.parametrize("dtype", ["float32", None])
def test_an_undeclared_8bit_kv_cache_stays_different(table, dtype):
    seen, floor, test = _judged(table, "kv-q8_0", dtype)
    assert test["result"] == "different", (floor["pair"], test["sentence"])
    assert "configured_sentence" not in test
    # nearer the f16 row than float32's, and still far past it
    assert seen["topk_q99"] > 5 * table["pairs"]["float32/float32 kv=float16"]["models"]["zoo:jamba"]["topk"]["q99"]


def test_a_shift_of_the_reported_logprobs_does_not_move_the_signature():
    """A server that lowers every reported logprob of a position (top-k too) by nats neither fakes nor hides
    an f16 copy: the spread is over differences within a position."""
    tokens, reference, _ = _recorded("fa-off")
    shift = pa.array(np.full(tokens.num_rows, -1.5))
    lists = tokens.column("engine_topk_logprobs").combine_chunks()
    moved = pa.ListArray.from_arrays(lists.offsets, pc.add(lists.values, pa.scalar(-1.5, lists.values.type)))
    lowered = tokens.set_column(3, "engine_logprob", pc.add(tokens.column("engine_logprob"), shift)).set_column(
        5, "engine_topk_logprobs", moved
    )
    a = kv_signature.seen([kv_signature.spread(tokens, reference)])
    b = kv_signature.seen([kv_signature.spread(lowered, reference)])
    assert b["n"] == a["n"] and b["topk_q99"] == pytest.approx(a["topk_q99"], abs=2e-6)


def test_only_a_server_that_says_nothing_of_its_kv_cache_is_inferred():
    absent = {f: {"value": None, "source": "absent", "via": None} for f in ("kv_cache_dtype", "flash_attention")}
    said = {**absent, "flash_attention": {"value": "on", "source": "declared", "via": "--flash-attention"}}
    assert kv_signature.unsaid("openai", absent) and kv_signature.unsaid("sglang", None)
    assert not kv_signature.unsaid("openai", said)  # declared: judged as declared
    assert not kv_signature.unsaid("builtin", absent) and not kv_signature.unsaid("llamacpp", absent)
