"""Every Mamba2 mixer: a dt limit is applied by transformers' prefill (chunk scan) only, never by its decode
step nor by vLLM. mamba_ssm's own Mamba2 does the same (`forward` passes `dt_limit` to the chunk scan,
`step` calls `selective_state_update` without it), transformers copied that, and vLLM's `MambaMixer2`
hard-codes `dt_limit=(0.0, inf)` (`mamba_mixer2.py:697, 870`). At the default limit (0, inf) nothing
differs; a checkpoint whose config sets `time_step_limit` (Mamba2, FalconH1, GraniteMoeHybrid, Bamba) or
a `time_step_min` above its lowest dt (Zamba2, NemotronH: bugs 4 and 8) gets three answers.

Run with lpf's Python (transformers of the reference):
  python scripts/repro/dt_limit_mamba2_mixers.py MODEL_DIR [VLLM_RUN_DIR]
MODEL_DIR: a checkpoint with a dt limit that acts (the conformance matrix's `<Arch>~dt-limit` rows build
them: `lpf conformance --variants limits`); VLLM_RUN_DIR (optional): an lpf run of vLLM on it with
--prompt-logprobs, whose prompt logprobs are compared with transformers' prefill with and without the
limit. Prints, for one prompt: |teacher-forced - step-by-step decode| over 12 greedy tokens with the
limit as transformers applies it and with no limit anywhere, and (with a run) vLLM against both prefills.
"""

import sys

import torch
from transformers import AutoModelForCausalLM


def limits(model) -> list:
    """Every mixer that holds a dt limit (whatever the architecture nests it under)."""
    return [m for m in model.modules() if hasattr(m, "time_step_limit")]


def set_limit(model, limit) -> None:
    for mixer in limits(model):
        mixer.time_step_limit = tuple(limit)


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

    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    mixers = limits(model)
    limit = tuple(mixers[0].time_step_limit)
    print(f"transformers {transformers.__version__}; {type(model).__name__}: {len(mixers)} mixers, dt limit {limit}")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (40,), generator=g).tolist()
    print(
        f"decode vs teacher-forced, as transformers has it (prefill limits dt, decode does not): "
        f"max |d| {decode_gap(model, prompt):.3e}"
    )
    set_limit(model, (0.0, float("inf")))
    print(f"decode vs teacher-forced, no limit anywhere: max |d| {decode_gap(model, prompt):.3e}")
    if len(sys.argv) > 2:  # vLLM's prompt logprobs against transformers' prefill with and without the limit
        import pyarrow.compute as pc

        from lpf.run.store import RunDir

        run = RunDir.open(sys.argv[2])
        req = run.read("requests", ["request_id", "prompt_token_ids"]).to_pylist()[0]
        pt = run.read("prompt_tokens")
        pt = pt.filter(pc.equal(pt.column("request_id"), req["request_id"])).sort_by("position")
        ids, eng = req["prompt_token_ids"], pt.column("engine_logprob").to_pylist()
        for name, lim in (("with the limit", limit), ("without it", (0.0, float("inf")))):
            set_limit(model, lim)
            tf = teacher_forced(model, ids)
            ref = [float(tf[p - 1, ids[p]]) for p in range(1, len(ids))]
            print(
                f"vLLM prompt logprobs vs transformers' prefill {name}: max |d| "
                f"{max(abs(a - b) for a, b in zip(eng, ref)):.3e} over {len(ref)} positions"
            )
