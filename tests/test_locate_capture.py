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
