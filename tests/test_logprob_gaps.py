"""Logprob entries a server left out (llama-server's OpenAI routes send none for a token ending inside a
UTF-8 character): found again from the answer's text, or the answer cut before the first gap, never scored
in the wrong context. Pure `logprob_gaps.align` cases on zoo:hybrid's byte-level vocabulary, and a real
llama-server behind `--engine openai --base-url` (the tiny random Jamba of conformance, whose answers are
full of such tokens: before, 14 of 16 honest requests were called `corrupt`)."""

from __future__ import annotations

import json

import pytest

from test_llamacpp import needs_llamacpp

from lpf.adapters.logprob_gaps import align, entry_bytes


@pytest.fixture(scope="module")
def zoo_map():
    from lpf.adapters.token_map import TokenMap
    from lpf.core.model_specs import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("zoo:hybrid"))
    return tok, TokenMap(tok, len(tok))


def _pieces(m, ids):
    """The bytes a server sends for each token."""
    return [m.bytes_of(t) for t in ids]


def test_a_left_out_byte_token_is_found_again_from_the_text(zoo_map):
    tok, m = zoo_map
    m.by_bytes(b"a")  # builds the byte table
    e1, e2 = m.by_bytes("é".encode()[:1]), m.by_bytes("é".encode()[1:])
    a, b = m.by_bytes(b"a"), m.by_bytes(b"b")
    assert None not in (e1, e2, a, b)  # a byte-level vocabulary: every byte is a token
    ids = [a, e1, e2, b]
    assert tok.decode(ids) == "aéb"
    pieces = _pieces(m, [a, e2, b])  # the server sent no entry for e1 (it ends inside "é")
    got = align(pieces, "aéb", 1, m.by_bytes)
    assert got.slots == [("entry", 0), ("gap", e1), ("entry", 1), ("entry", 2)] and got.prefix == 1
    # the tail: the last token left out
    got = align(_pieces(m, [a, e1, e2]), "aéb", 1, m.by_bytes)
    assert got.slots == [("entry", 0), ("entry", 1), ("entry", 2), ("gap", b)] and got.prefix == 3


def test_a_gap_the_text_cannot_name_keeps_only_the_entries_before_it(zoo_map):
    tok, m = zoo_map
    a, b = m.by_bytes(b"a"), m.by_bytes(b"b")
    # the server's text replaced the broken character (U+FFFD): what was left out cannot be named
    got = align(_pieces(m, [a, b]), "a\ufffd\ufffdb", 1, m.by_bytes)
    assert got.slots is None and got.prefix == 1 and got.gaps == 1
    # more tokens counted than the text shows gaps: not recovered, every entry before the (unseen) gap kept
    got = align(_pieces(m, [a, b]), "ab", 1, m.by_bytes)
    assert got.slots is None and got.prefix == 2 and got.gaps == 0
    assert align([b"a", None], "ab", 1, m.by_bytes).slots is None
    # a special token the text leaves out (EOS) is no gap: the count disagreeing stays the count's problem
    eos = tok.eos_token_id
    got = align(_pieces(m, [a, b]) + [b"<eos>"], "ab", 1, m.by_bytes, [False, False, True])
    assert eos is not None and got.gaps == 0 and got.prefix == 3
    e1 = m.by_bytes("é".encode()[:1])
    assert entry_bytes([195, 169], None, m.bytes_of) == "é".encode() and entry_bytes(None, e1, m.bytes_of) == b"\xc3"
    assert entry_bytes([256], None, m.bytes_of) is None and entry_bytes(None, None, m.bytes_of) is None


@needs_llamacpp
@pytest.mark.slow
def test_llama_server_openai_route_with_left_out_entries_is_not_called_corrupt(lpf_cli, tmp_path):
    from lpf.adapters.llamacpp_gguf import find_tools, gguf_for
    from lpf.adapters.llamacpp_server import LlamaServer
    from lpf.core.model_specs import ModelRef, load_tokenizer, resolve_model
    from lpf.experiments.conformance.grid import write_workload
    from lpf.experiments.conformance.tiny import build_tiny

    tools = find_tools()
    model = build_tiny("jamba")
    tok = load_tokenizer(ModelRef("tiny jamba", model))
    workload = write_workload(tmp_path / "w.jsonl", 16, len(tok), bos=tok.bos_token_id)
    gguf = gguf_for(resolve_model(str(model)), "float32", tools)
    server = LlamaServer(tools.server, gguf.path, ["-np", "4", "-c", "4096", "-t", "1", "-fa", "off"]).start()
    try:
        out = tmp_path / "run"
        r = lpf_cli(
            "audit",
            "--engine",
            "openai",
            "--base-url",
            server.base_url + "/v1",
            "--model",
            str(model),
            "-E",
            "dtype=float32",
            "--workload",
            workload,
            "--max-tokens",
            12,
            "--out",
            out,
            "--json",
        )
    finally:
        server.cleanup()
    assert r.code == 0, r.err
    f = json.loads(r.out)
    assert f["counts"]["corrupt"] == f["counts"]["divergent"] == 0, f["counts"]
    assert f["run_test"]["result"] == "same", f["run_test"]["sentence"]
    assert f["evidence"]["inconsistent"]["by_reason"].get("logprobs_missing", 0) > 0  # kept as evidence
    # an answer whose first token has no entry cannot be placed: an error that says so, not a verdict
    import pyarrow.parquet as pq

    reqs = pq.read_table(out / "requests").to_pylist()
    errors = [r["error"] for r in reqs if r["error"]]
    assert len(errors) == f["errors"] and all("does not begin the answer's text" in e for e in errors)
    # what is not scored is kept as the server sent it: the entries after a gap, in the record
    cut = [r["inconsistency"] for r in reqs if r["inconsistency"] and "entries after the gap" in r["inconsistency"]]
    assert cut and all("the entries not scored (id, logprob): [(" in c for c in cut + errors)
