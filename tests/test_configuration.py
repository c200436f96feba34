"""The engine's configuration in the manifest (`lpf.run.configuration`): what the engine says of itself,
read where it says it (`lpf.adapters.engine_config`), beside what the user declared, and lpf's managed
llama.cpp turning flash attention on for a quantized V cache (llama.cpp computes one only with it).

Readers run on bodies in the shapes the servers' sources write (llama-server's get_res_props, vLLM's
/server_info `vllm_config`); the real servers' answers are read in test_serve.py (lpf serve) and
test_llamacpp.py (llama-server, lpf's and the user's).
"""

from __future__ import annotations

import json

import pytest

from conftest import write_prompts
from lpf.adapters import engine_config as ec
from lpf.run.configuration import FIELDS, block

# llama-server's GET /props, trimmed to what is read (tools/server/server-context.cpp, get_res_props)
PROPS = {
    "default_generation_settings": {
        "params": {"temperature": 0.8, "top_k": 40, "repeat_penalty": 1.0, "repeat_last_n": 64, "n_probs": 0},
        "n_ctx": 4096,
    },
    "total_slots": 4,
    "model_ftype": "Q4_K - Medium",
    "build_info": "b1-abc",
}


def test_block_names_each_field_its_value_and_where_it_came_from():
    read = {"dtype": ("f32", "GET /props model_ftype"), "weight_quantization": ("Q4_K - Medium", "GET /props")}
    got = block(read, {"dtype": "float32", "weight_quantization": "none", "kv_cache_dtype": "q8_0"})
    assert list(got) == list(FIELDS)
    assert got["dtype"] == {"value": "float32", "source": "engine", "via": "GET /props model_ftype"}  # f32 == float32
    # the engine's word wins; the user's disagreement is kept beside it
    assert got["weight_quantization"] == {
        "value": "Q4_K - Medium",
        "source": "engine",
        "via": "GET /props",
        "declared": "none",
        "conflict": True,
    }
    assert got["kv_cache_dtype"] == {"value": "q8_0", "source": "declared", "via": "--kv-cache-dtype"}
    assert got["flash_attention"] == {"value": None, "source": "absent", "via": None}


def test_llama_server_props_give_the_file_type_and_the_servers_sampling_defaults():
    got = ec.from_llama_props(PROPS)
    assert got["dtype"][0] == "q4_k_m" and got["weight_quantization"][0] == "Q4_K - Medium"
    assert got["sampling_defaults"][0] == {"temperature": 0.8, "top_k": 40, "repeat_penalty": 1.0, "repeat_last_n": 64}
    f32 = ec.from_llama_props({**PROPS, "model_ftype": "(guessed) all F32"})
    assert f32["dtype"][0] == "float32" and f32["weight_quantization"][0] == "none"
    # what /props does not say stays unsaid
    assert "kv_cache_dtype" not in got and "flash_attention" not in got
    assert ec.from_llama_props(None) == {} and ec.from_llama_props({"build_info": "x"}) == {}


def test_llama_cpp_python_names_its_defaults_in_its_openapi_schema_and_other_servers_are_not_read():
    """llama-cpp-python's server has no /props; its /openapi.json (the shape 0.3.36 serves) names it and
    documents the defaults of its request fields, repeat_penalty 1.1 among them; its penalties see the tokens
    it generated only. A schema of another title (vLLM's: request defaults None, generation_config.json
    applied instead) says nothing."""
    schema = {"properties": {"repeat_penalty": {"type": "number", "default": 1.1}, "top_k": {"default": 40}}}
    body = {
        "info": {"title": "🦙 llama.cpp Python API", "version": "0.3.36"},
        "components": {"schemas": {"CreateChatCompletionRequest": schema, "CreateCompletionRequest": schema}},
    }
    ((said, via),) = ec.from_openapi(body).values()
    assert said == {"repeat_penalty": 1.1, "top_k": 40, "penalty_scope": "output"}
    assert "llama.cpp Python API 0.3.36" in via and "/openapi.json" in via
    assert ec.from_openapi({**body, "info": {"title": "vLLM API"}}) == {} and ec.from_openapi([]) == {}


def test_vllm_config_gives_dtype_kv_cache_quantization_and_generation_defaults():
    cfg = {
        "model_config": {"dtype": "torch.bfloat16", "quantization": None},
        "cache_config": {"cache_dtype": "fp8_e4m3"},
        "attention_config": {"backend": None},
    }
    got = block(ec.from_vllm_config(cfg, {"repetition_penalty": 1.05}, "GET /server_info"), {})
    assert got["dtype"]["value"] == "bfloat16" and got["kv_cache_dtype"]["value"] == "fp8_e4m3"
    assert got["weight_quantization"]["value"] == "none" and got["flash_attention"]["source"] == "absent"
    assert got["sampling_defaults"]["value"] == {"repetition_penalty": 1.05}
    auto = ec.from_vllm_config({**cfg, "cache_config": {"cache_dtype": "auto"}}, None, "x")
    assert auto["kv_cache_dtype"][0] == "torch.bfloat16" and "sampling_defaults" not in auto


def test_vllms_kv_scales_are_one_number_when_every_layer_shares_it_and_say_the_cpu_kernels_rounding():
    one, via = ec.kv_cache_scale({"k": [1.0], "v": [1.0]}, cpu_build=True)
    assert one == 1.0 and "no k_scale / v_scale in the checkpoint" in via and "round-toward-zero" in via
    assert block({"kv_cache_scale": (one, via)}, {})["kv_cache_scale"]["value"] == 1.0
    calibrated, via = ec.kv_cache_scale({"k": [0.02, 0.05], "v": [0.01]}, cpu_build=False)
    assert calibrated == {"k": [0.02, 0.05], "v": [0.01]} and "checkpoint" not in via and "round" not in via
    assert ec.kv_cache_scale(None, True) is None and ec.kv_cache_scale({"k": [], "v": []}, True) is None


def test_a_quantized_v_cache_turns_flash_attention_on_or_is_refused_in_one_line():
    from lpf.adapters.llamacpp import LlamaCppOptions, flash_attention
    from lpf.core.errors import LpfError

    q8 = LlamaCppOptions.parse({"cache_type_k": "q8_0", "cache_type_v": "q8_0"})
    fa, why = flash_attention(q8, "float32")
    assert fa == "on" and "quantized V cache (q8_0)" in why
    assert flash_attention(LlamaCppOptions.parse({"cache_type_k": "q4_0"}), "float32")[0] == "on"  # V follows K
    assert flash_attention(LlamaCppOptions.parse({}), "float32")[0] == "off"
    assert flash_attention(LlamaCppOptions.parse({"flash_attn": "on"}), "float32") == ("on", "set (-E flash_attn)")
    assert flash_attention(LlamaCppOptions.parse({}), "q4_k_m")[0] is None  # llama.cpp's auto
    with pytest.raises(LpfError, match="quantized V cache .q8_0. runs only with flash attention"):
        LlamaCppOptions.parse({"cache_type_v": "q8_0", "flash_attn": "off"})


def test_declarations_go_from_the_command_line_to_the_spec_and_the_manifest(tmp_path):
    from lpf.cli.audit_spec import build_audit_spec
    from lpf.core.errors import LpfError
    from lpf.pipeline import create_run

    params = {
        "engine": "openai",
        "model": "tiny-served",
        "reference": "tiny:hybrid",
        "engine_option": ("base_url=http://127.0.0.1:9/v1", "dtype=bfloat16"),
        "workload": str(write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "K12|"}])),
        "out": tmp_path / "run",
        **{k: v for k, v in dict(n=1, temperature=0.0, top_p=1.0, top_k=0, max_tokens=2, seed=0).items()},
        **dict(ignore_eos=False, logprobs=1, part_size=64, reference_dtype="float32", token_budget=16384),
        **dict(reference_device="cpu", executor="local", actors=1, gpus_per_actor=0.0),
        **dict(kv_cache_dtype=" FP8_E4M3 ", flash_attention="on", weight_quantization=None),
    }
    spec = build_audit_spec(params)
    assert spec.run.declared.model_dump() == {
        "kv_cache_dtype": "fp8_e4m3",
        "flash_attention": "on",
        "weight_quantization": None,
    }
    from lpf.pipeline.spec import audit_command

    args = audit_command(spec)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and "--weight-quantization" not in args
    run = create_run(spec)
    # the server the user started: its --dtype is a declaration too
    assert run.manifest["engine"]["declared"] == {
        "kv_cache_dtype": "fp8_e4m3",
        "flash_attention": "on",
        "dtype": "bfloat16",
    }
    with pytest.raises(LpfError, match="--flash-attention"):
        build_audit_spec({**params, "flash_attention": "maybe", "out": tmp_path / "x"})
    # the library takes the same declarations
    from lpf.api.audit import build_spec

    assert build_spec(model="tiny:hybrid", kv_cache_dtype="Q8_0").run.declared.kv_cache_dtype == "q8_0"
    with pytest.raises(LpfError, match="flash_attention"):
        build_spec(model="tiny:hybrid", flash_attention="maybe")


@pytest.mark.slow
def test_the_built_in_engine_records_its_configuration_and_a_declaration_that_disagrees(lpf_cli, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "K12,A37|K12|"}])
    out = tmp_path / "run"
    r = lpf_cli(
        "run", "--model", "tiny:hybrid", "--workload", prompts, "--max-tokens", 2, "--out", out,
        "--kv-cache-dtype", "F32", "--flash-attention", "on", "--weight-quantization", "q8_0",
    )  # fmt: skip
    assert r.code == 0, r.err
    e = json.loads((out / "manifest.json").read_text())["engine"]
    assert e["declared"] == {"kv_cache_dtype": "f32", "flash_attention": "on", "weight_quantization": "q8_0"}
    c = e["configuration"]
    assert c["dtype"] == {"value": "float32", "source": "engine", "via": "the built-in engine's EngineConfig"}
    assert c["kv_cache_dtype"]["value"] == "float32" and "conflict" not in c["kv_cache_dtype"]  # f32 is float32
    assert c["flash_attention"] == {"value": "on", "source": "declared", "via": "--flash-attention"}
    assert c["weight_quantization"] == {**c["weight_quantization"], "value": "none", "conflict": True}
    assert c["sampling_defaults"]["value"] == {}
    spec = json.loads((out / "spec.json").read_text())["run"]["declared"]
    assert spec == {"kv_cache_dtype": "f32", "flash_attention": "on", "weight_quantization": "q8_0"}
    bad = lpf_cli("run", "--model", "tiny:hybrid", "--flash-attention", "maybe", "--out", tmp_path / "x")
    assert bad.code == 2 and "Traceback" not in bad.err
