"""Engine knobs declared on the Options fields (lpf.core.knobs): what experiments ask of them, the
command-line flags generated from them, and a knob added as one field (max_model_len) working end to end."""

from __future__ import annotations


import pytest
from pydantic import Field

from conftest import write_prompts
from lpf.adapters import engine_names, get_engine_class
from lpf.adapters.base import Options
from lpf.core.knobs import flag_knobs, knob, knob_info, knob_with_role, knobs, knobs_with_role, shrink_knobs


def test_roles_answer_what_the_name_lists_used_to():
    opts = {name: get_engine_class(name).Options for name in engine_names()}
    assert {n: knob_with_role(o, "concurrency") for n, o in opts.items()} == {
        "builtin": "max_num_seqs",
        "hf": "batch_size",
        "vllm": "max_num_seqs",
        "openai": None,
        "sglang": None,
        "llamacpp": "parallel",
    }  # llama-server's slots; its `batch_size` is a step budget, not concurrency
    assert knobs_with_role(opts["vllm"], "cache_size") == [
        "gpu_memory_utilization",
        "num_gpu_blocks_override",
        "cpu_kvcache_space",
    ]
    assert knob_with_role(opts["vllm"], "prefix_cache") == "enable_prefix_caching"
    assert knob_with_role(opts["builtin"], "prefix_cache") == "enable_prefix_caching"
    assert knob_with_role(opts["hf"], "prefix_cache") is None
    # shrink's order: the cache first, then concurrency, budget, chunking, ..., dtype last (the order
    # the old MOVABLE list gave, now per engine)
    assert shrink_knobs(opts["builtin"]) == [
        "cache_mb",
        "max_state_slots",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "speculative",
        "enable_prefix_caching",
        "mamba_block_size",
        "block_size",
        "max_model_len",
        "dtype",
    ]
    assert shrink_knobs(opts["vllm"]) == [
        "gpu_memory_utilization",
        "cpu_kvcache_space",
        "num_gpu_blocks_override",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "speculative_config",  # speculation off: a failure that stays without it is not speculative
        "max_model_len",
        "dtype",
    ]
    assert shrink_knobs(opts["hf"]) == ["batch_size", "dtype"] and shrink_knobs(opts["openai"]) == ["concurrency"]
    with pytest.raises(ValueError, match="unknown knob role"):
        knobs_with_role(opts["builtin"], "cache")


def test_a_plain_field_with_a_description_is_a_knob_with_no_role():
    """Fields other branches add as `Field(..., description=...)` need nothing else to be knobs."""

    class Demo(Options):
        plain: int = Field(3, ge=1, description="A knob declared the plain pydantic way.")
        bare: bool = False
        sized: float = knob(1.0, gt=0, help="Sized.", roles=("cache_size",), shrink_order=5, flag=True)

    by_name = {k.name: k for k in knobs(Demo)}
    assert list(by_name) == ["plain", "bare", "sized"]
    assert (by_name["plain"].help, by_name["plain"].roles, by_name["plain"].flag) == (
        "A knob declared the plain pydantic way.",
        (),
        False,
    )
    assert by_name["plain"].kind == "int" and by_name["bare"].kind == "bool" and by_name["sized"].kind == "float"
    assert shrink_knobs(Demo) == ["sized"] and knob_with_role(Demo, "cache_size") == "sized"
    assert [k.name for k in flag_knobs([Demo])] == ["sized"]
    assert Demo.parse({"plain": "4"}).plain == 4  # still an ordinary validated pydantic field
    assert Demo.model_json_schema()["properties"]["sized"]["lpf"]["roles"] == ["cache_size"]
    with pytest.raises(ValueError, match="unknown knob role"):
        knob(1, help="x", roles=("no-such-role",))


def test_flags_are_generated_from_the_fields_with_their_help(lpf_cli):
    """Today's flag names and help, now read from the fields: one flag per name across engines."""
    names = [k.flag_name for k in flag_knobs(get_engine_class(e).Options for e in engine_names())]
    assert set(names) >= {
        "--dtype",
        "--inject",
        "--cache-mb",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--enable-chunked-prefill",
        "--base-url",
        "--api-key-env",
        "--served-model",
        "--max-model-len",
    }
    r = lpf_cli("audit", "--help")
    assert r.code == 0
    text = " ".join(r.out.split())
    for flag in names:
        assert flag in text, flag
    assert "--no-enable-chunked-prefill" in text and "Built-in engine: cache size in MiB" in text
    assert knob_info(get_engine_class("builtin").Options, "cache_mb").help in text
    serve = " ".join(lpf_cli("serve", "--help").out.split())
    assert "--cache-mb" in serve and "--api-key-env" not in serve  # lpf serve: the built-in engine's flags only


def test_max_model_len_is_one_field_and_works_from_the_flag(lpf_cli, tmp_path):
    """The knob added as one field on EngineConfig: the generated --max-model-len flag reaches the
    engine (outputs stop at the context, a prompt that fills it is that request's error), the manifest
    records it, and conformance asks for it by its role (context_length)."""
    work = write_prompts(
        tmp_path / "w.jsonl",
        [{"id": "short", "prompt_token_ids": [1, 5, 6]}, {"id": "long", "prompt_token_ids": [1] + [7] * 11}],
    )
    r = lpf_cli(
        "run",
        "--model",
        "tiny:hybrid",
        "--workload",
        work,
        "--max-tokens",
        20,
        "--ignore-eos",
        "--max-model-len",
        12,
        "--out",
        tmp_path / "run",
    )
    assert r.code == 0, r.err
    from lpf.run.store import RunDir

    run = RunDir.open(tmp_path / "run")
    assert run.manifest["engine"]["options"]["max_model_len"] == 12
    rows = {r["request_id"]: r for r in run.read("requests").to_pylist()}
    short, long = rows["short-r0"], rows["long-r0"]
    assert len(short["output_token_ids"]) == 12 - 3 and short["finish_reason"] == "length"
    assert long["error"] and "no room for an output in a 12-token context" in long["error"]
    r = lpf_cli("run", "--model", "tiny:hybrid", "--workload", work, "--max-model-len", 0, "--out", tmp_path / "bad")
    assert r.code == 2 and "max_model_len must be >= 1" in r.err and not (tmp_path / "bad").exists()
