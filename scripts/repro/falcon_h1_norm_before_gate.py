"""FalconH1 with `mamba_rms_norm` on: transformers applies its gated RMSNorm in the order
`mamba_norm_before_gate` says (default true: normalise, then multiply by silu(gate)); vLLM's
Mixer2RMSNormGated always gates first (norm_before_gate=False), whatever the config says.

Run with lpf's Python (transformers of the reference):
  python scripts/repro/falcon_h1_norm_before_gate.py MODEL_DIR VLLM_RUN_DIR
MODEL_DIR: the FalconH1~mamba_rms_norm=1 variant's checkpoint (`model` in variants/FalconH1.json);
VLLM_RUN_DIR: vLLM's cell on it (with prompt logprobs). Prints vLLM's prompt logprobs against
transformers' prefill with the checkpoint's gate order and with the order flipped to gate-first.
"""

import sys

import torch
from transformers import AutoModelForCausalLM

from lpf.run.store import RunDir

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ignored_biases import prompt_gap  # noqa: E402 - the sibling reproducer's comparison

if __name__ == "__main__":
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    run = RunDir.open(sys.argv[2])
    cfg = model.config
    print(f"mamba_rms_norm {cfg.mamba_rms_norm}, mamba_norm_before_gate {cfg.mamba_norm_before_gate}")
    print(f"vLLM vs transformers, the checkpoint's order: max |d| {prompt_gap(model, run):.3e}")
    norms = [layer.mamba.norm for layer in model.model.layers if hasattr(layer.mamba.norm, "norm_before_gate")]
    for norm in norms:
        norm.norm_before_gate = False
    print(f"vLLM vs transformers, gate first in {len(norms)} mixers: max |d| {prompt_gap(model, run):.3e}")
