"""Zamba2: transformers clamps dt at config.time_step_min (0.001 by default) in its prefill (chunk) path
but not in its decode (recurrent) path; vLLM clamps nowhere. Three implementations, three answers.

Run with lpf's Python (transformers of the reference):
  python scripts/repro/zamba2_time_step_limit.py MODEL_DIR [VLLM_RUN_DIR]
MODEL_DIR: a Zamba2 checkpoint (the conformance tiny one); VLLM_RUN_DIR (optional): an lpf run of
vLLM on it with --prompt-logprobs, whose prompt logprobs are compared with transformers' prefill with
and without the clamp.
Prints, for one prompt: |teacher-forced - step-by-step decode| over 12 greedy tokens with the clamp as
transformers has it, and with time_step_limit = (0, inf) on every mixer (no clamp anywhere).
"""

import sys

import torch
from transformers import AutoModelForCausalLM


def set_limit(model, low: float) -> None:
    for layer in model.model.layers:
        mixer = getattr(getattr(layer, "mamba_decoder", layer), "mamba", None)
        if mixer is not None:
            mixer.time_step_limit = (low, float("inf"))


def teacher_forced(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def decode_gap(model, prompt, n=12):
    """Greedy decode step by step with the cache, then the same tokens teacher-forced: max |d| of the
    chosen tokens' logprobs."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    toks = out.sequences[0, len(prompt) :].tolist()
    step = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, toks)]
    tf = teacher_forced(model, prompt + toks)
    forced = [float(tf[len(prompt) - 1 + i, t]) for i, t in enumerate(toks)]
    return max(abs(a - b) for a, b in zip(step, forced))


if __name__ == "__main__":
    import transformers

    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    low = model.config.time_step_min
    print(f"transformers {transformers.__version__}; time_step_min {low}")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (40,), generator=g).tolist()
    print(
        f"decode vs teacher-forced, as transformers has it (prefill clamps at {low}, decode does not): "
        f"max |d| {decode_gap(model, prompt):.3e}"
    )
    set_limit(model, 0.0)
    print(f"decode vs teacher-forced, no clamp anywhere: max |d| {decode_gap(model, prompt):.3e}")
    if len(sys.argv) > 2:  # vLLM's prompt logprobs against transformers' prefill with and without the clamp
        import pyarrow.compute as pc

        from lpf.run.store import RunDir

        run = RunDir.open(sys.argv[2])
        req = run.read("requests", ["request_id", "prompt_token_ids"]).to_pylist()[0]
        pt = run.read("prompt_tokens")
        pt = pt.filter(pc.equal(pt.column("request_id"), req["request_id"])).sort_by("position")
        ids, eng = req["prompt_token_ids"], pt.column("engine_logprob").to_pylist()
        for name, limit in (("with the clamp", low), ("without it", 0.0)):
            set_limit(model, limit)
            tf = teacher_forced(model, ids)
            ref = [float(tf[p - 1, ids[p]]) for p in range(1, len(ids))]
            print(
                f"vLLM prompt logprobs vs transformers' prefill {name}: max |d| "
                f"{max(abs(a - b) for a, b in zip(eng, ref)):.3e} over {len(ref)} positions"
            )
