"""An engine that drops a checkpoint's biases: its prompt logprobs against transformers' prefill as the
checkpoint is, and with the biases it is suspected of dropping zeroed.

vLLM's AutoWeightsLoader ignores every unexpected `.bias` weight (`model_executor/models/utils.py:457-458`,
"typically from GPTQ models"), so a layer vLLM builds without a bias its config asks for loses it
silently. Run with lpf's Python (transformers of the reference):
  python scripts/repro/ignored_biases.py MODEL_DIR VLLM_RUN_DIR REGEX
MODEL_DIR: a conformance variant's checkpoint (e.g. FalconH1~attention_bias=1, `model` in
variants/FalconH1.json); VLLM_RUN_DIR: vLLM's cell on it (with prompt logprobs); REGEX: the parameter
names to zero (e.g. 'self_attn\\..*\\.bias$'). Agreement with the zeroed model to float32 rounding, and
not with the checkpoint, says the engine computes without those biases.
"""

import re
import sys

import pyarrow.compute as pc
import torch
from transformers import AutoModelForCausalLM

from lpf.run.store import RunDir


def prompt_gap(model, run, n=4) -> float:
    pt_all = run.read("prompt_tokens")
    worst = 0.0
    for req in run.read("requests", ["request_id", "prompt_token_ids"]).to_pylist()[:n]:
        pt = pt_all.filter(pc.equal(pt_all.column("request_id"), req["request_id"])).sort_by("position")
        ids, eng = req["prompt_token_ids"], pt.column("engine_logprob").to_pylist()
        with torch.no_grad():
            tf = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        worst = max(worst, max(abs(a - float(tf[p - 1, ids[p]])) for p, a in zip(range(1, len(ids)), eng)))
    return worst


if __name__ == "__main__":
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    run, pattern = RunDir.open(sys.argv[2]), re.compile(sys.argv[3])
    print(f"vLLM prompt logprobs vs transformers, the checkpoint as it is: max |d| {prompt_gap(model, run):.3e}")
    names = [n for n, _ in model.named_parameters() if pattern.search(n)]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in names:
                p.zero_()
    print(f"  with {len(names)} parameters zeroed ({', '.join(names[:3])}, ...): max |d| {prompt_gap(model, run):.3e}")
