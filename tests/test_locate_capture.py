"""The reference's capture for `lpf locate` (lpf.locate.hf_capture) on real transformers models: every Mamba2
mixer's (and Mamba1's) step size `dt` and scan output are recorded at every position, in the teacher-forced pass and on the
decode path, whatever form the modeling code's kernel functions take (plain functions up to transformers
5.24; nn.Modules with a `(*args, **kwargs)` call from 5.25 on, with the `kernels` package, where binding
the call's arguments found no `dt` and locate named the next op, `gate_norm`, instead)."""

from __future__ import annotations

import numpy as np
import pytest

# each modeling module has its own copy of the kernel functions; one per form of the mixer: Mamba2's, Zamba2's
# (the one test_locate_vllm locates), NemotronH's (its limit from the config field 5.25 changed) and Mamba1's
MIXERS = ("mamba2", "zamba2", "nemotron_h", "mamba")


@pytest.mark.parametrize("model_type", MIXERS)
def test_every_mamba_mixer_s_dt_and_scan_output_are_captured_in_both_paths(model_type):
    import torch
    from transformers import AutoModelForCausalLM

    from lpf.experiments.conformance.tiny import build_tiny
    from lpf.locate.hf_capture import HFCapture

    model = AutoModelForCausalLM.from_pretrained(build_tiny(model_type), dtype=torch.float32).eval()
    cap = HFCapture(model)
    ids, prompt = [1, *range(3, 24)], 16
    forced, decode = cap.teacher_forced(ids), cap.decode_path(ids, prompt)
    # NemotronH names every layer's block `mixer`, attention and MLP ones too: its Mamba mixers have A_log
    mixers = [i for i in cap.mamba_layers if hasattr(cap._mixer(cap.layers[i]), "A_log")]
    assert mixers
    for i in mixers:
        for acts in (forced, decode):
            assert acts.positions(f"L{i}.dt") == list(range(len(ids))), (model_type, i, acts.order)
        assert forced.positions(f"L{i}.ssm_out") == list(range(len(ids))), (model_type, i, forced.order)
        # a decode step's kernel output is ssm_out only when it is called without the gate z (FalconH1's
        # one-token update gates inside the kernel in 5.24)
        assert decode.positions(f"L{i}.ssm_out")[:prompt] == list(range(prompt)), (model_type, i)
        # the chunk scan's dt is clamped to the mixer's own limit (the one-token update's is not clamped)
        lo = float(getattr(cap._mixer(cap.layers[i]), "time_step_limit", (0.0,))[0])
        assert min(float(v.min()) for v in forced.get(f"L{i}.dt").values()) >= lo
    # the decode path's prompt pass is the same computation as the teacher-forced one
    for i in mixers:
        for p in range(prompt):
            np.testing.assert_allclose(decode.get(f"L{i}.dt")[p], forced.get(f"L{i}.dt")[p], rtol=1e-5, atol=1e-7)


def test_every_gated_deltanet_op_is_captured_in_both_paths():
    """Qwen3.5's GDN layers (transformers' torch GDN functions, wrapped): the gates g and beta, the rule's output and
    the output gate at every position on both paths, the decode path's prompt pass equal to the teacher-forced one;
    the delta-rule state per decode step in the built-in engine's layout ([value heads, d_k, d_v])."""
    import torch
    from transformers import AutoModelForCausalLM

    from lpf.experiments.conformance.tiny import build_tiny
    from lpf.locate.hf_capture import HFCapture

    model = AutoModelForCausalLM.from_pretrained(build_tiny("qwen3_5_text"), dtype=torch.float32).eval()
    cap = HFCapture(model)
    ids, prompt = [1, *range(3, 24)], 16
    forced, decode = cap.teacher_forced(ids), cap.decode_path(ids, prompt)
    gdn = [i for i, layer in enumerate(cap.layers) if hasattr(layer, "linear_attn")]
    assert gdn and cap.mamba_layers == gdn
    cfg = model.config
    for i in gdn:
        for op in ("in_proj", "conv", "g", "beta", "ssm_out", "gate_norm", "out_proj"):
            for acts in (forced, decode):
                assert acts.positions(f"L{i}.{op}") == list(range(len(ids))), (i, op, acts.order)
        assert len(forced.get(f"L{i}.g")[0]) == cfg.linear_num_value_heads
        for p in range(prompt):
            np.testing.assert_allclose(decode.get(f"L{i}.g")[p], forced.get(f"L{i}.g")[p], rtol=1e-6)
        size = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        assert decode.positions(f"L{i}.state_in") == list(range(prompt, len(ids)))
        assert len(decode.get(f"L{i}.state_out")[prompt]) == size


@pytest.mark.slow  # an audit and a locate: ~12 s of CPU
def test_a_transposed_gdn_state_between_chunks_is_located_to_the_layer_s_input_state(tmp_path):
    """chunk-state-transposed on the Gated DeltaNet hybrid (one request prefilled in 16-token chunks): located
    to layer 0's delta-rule state at the first chunk boundary, its own previous chunk's write having agreed
    with the reference and the norm unchanged (a layout change); the gates and the output gate are aligned on
    both sides, and agree up to the boundary."""
    from conftest import lpf_main, write_prompts
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.locate import locate
    from lpf.zoo import registry

    item = registry.workload_items("shared-prefix", n=1)[0]
    # the prompt's first 27 tokens after BOS: 28 tokens, two 16-token chunks
    tok = load_tokenizer(resolve_model("tiny:qwen35-longmem"))
    text = tok.decode(tok.encode(item["prompt"])[1:28])
    assert len(tok.encode(text)) == 28
    prompts = write_prompts(tmp_path / "w.jsonl", [{"id": item["id"], "prompt": text}])
    run = tmp_path / "run"
    args = ["--model", "tiny:qwen35-longmem", "--workload", prompts, "--max-tokens", 2]
    args += ["--max-num-batched-tokens", 16, "--inject", "chunk-state-transposed", "--fail-on", "never"]
    proc = lpf_main("audit", "--engine", "builtin", *args, "--out", run)
    assert proc.returncode == 0, proc.stderr
    doc, _ = locate(run, trials=False)
    loc, state = doc["located"], doc["mamba"]
    assert (loc["layer"], loc["name"], loc["position"]) == (0, "state_in", 16), doc["sentence"]
    assert state["kind"] == "Gated DeltaNet" and state["differed_parts"] == ["ssm"]  # the conv state is whole
    assert state["previous_state_out_agreed"] and state["step"]["phase"] == "extend"
    assert abs(state["engine_state_norm"] - state["reference_state_norm"]) <= 1e-4 * state["reference_state_norm"]
    assert "another layout" in doc["sentence"] and doc["verdict"]["suspect"] == "engine"
    modules = {m["op"]: m for m in doc["modules"]}  # the ops both sides captured, aligned
    for op in ("L0.in_proj", "L0.conv", "L0.g", "L0.beta", "L0.ssm_out", "L0.gate_norm", "L0.out_proj"):
        assert op in modules and modules[op]["positions"] >= 16, (op, sorted(modules)[:20])
        first = modules[op]["first_departure"]  # the gates never depart: they do not read the state
        assert first is None or (first >= 16 and op not in ("L0.in_proj", "L0.conv", "L0.g", "L0.beta")), (op, first)
