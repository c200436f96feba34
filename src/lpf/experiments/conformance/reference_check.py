"""The reference column: does the reference (transformers) agree with itself, path by path, against float64?

Contract: `check_reference(model_dir, prompts, max_tokens) -> dict` loads the tiny checkpoint in
float64 (the gold; MoE experts run eagerly there, torch's grouped_mm has no float64) and float32, greedy-generates `max_tokens` tokens per prompt in float32 with the
model's own cache (its decode path: the recurrent step kernels of a state-space layer, the KV cache of
attention) and keeps the logits of every step, then teacher-forces prompt + those tokens through:
the float64 model (gold), the float32 model with its default attention (sdpa where it has one: the
chunked prefill kernels of a state-space layer) and with eager attention. Per path, the largest
|logprob - gold logprob| of the actual tokens on output positions (and prompt positions for the
teacher-forced paths):
  decode            generate's per-step logits (recurrent / cached path) vs the float64 teacher-forced pass
  recurrent         every position, prompt included, through that cached one-token step (generate from
                    the first token with each next token forced; its raw logits): recurrent vs chunked
                    kernels on the prompt as well
  teacher-forced    the float32 forward (chunked / parallel kernels)
  eager             the float32 forward with attn_implementation="eager" (absent when the model has
                    no other attention kernel)
A path departs when its max |d| exceeds both `DEPART` (the analysis' float32 clean threshold, 1e-3
nats; honest float32 paths sit near 1e-5 here) and `SPREAD` x the closest path's max |d| (the model's
own float32 rounding, `float32_floor`: 1.1e-3 on the tiny Zamba2, whose teacher-forced and eager
paths agree with each other and the gold to that). `status`: `reference consistent`, `reference
inconsistent` (with `departing`: the paths that depart, and the first departing position), or
`reference cannot run` with the error's one line. One prompt at a time (no padding: left padding is
a path of its own on state-space models, which this column does not judge). Prints nothing.
"""

from __future__ import annotations

from pathlib import Path

DEPART = 1e-3
SPREAD = 10.0  # x the closest path's max |d|: a random tiny model's float32 rounding can pass 1e-3 by itself


def _forward_logprobs(model, ids, torch):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return torch.log_softmax(out.logits[0].double(), dim=-1)  # [T, V]; row t predicts token t+1


def _recurrent_logprobs(model, ids, torch):
    """Every position of `ids` through the cached one-token step (generate from the first token, each next
    token forced): the recurrent path over the prompt too. generate's `logits` are the raw ones, before
    the forcing processor."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, -float("inf"))
            forced[:, ids[input_ids.shape[1]]] = 0.0
            return forced

    with torch.no_grad():
        g = model.generate(
            torch.tensor([ids[:1]]),
            max_new_tokens=len(ids) - 1,
            min_new_tokens=len(ids) - 1,
            do_sample=False,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([Force()]),
            pad_token_id=model.config.pad_token_id,
        )
    return torch.stack([torch.log_softmax(lg[0].double(), -1)[t] for lg, t in zip(g.logits, ids[1:])])


def check_reference(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    try:
        try:  # torch's grouped_mm (the MoE experts' default kernel) has no float64: the gold runs them eagerly
            m64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager")
        except Exception:  # noqa: BLE001 - a model without experts takes no such choice
            m64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
        m64.eval()
        m32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        try:
            eager = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
            eager.eval()
            default_attn = getattr(m32.config, "_attn_implementation", None)
            if default_attn == "eager":
                eager = None  # one kernel only: nothing to compare
        except Exception:  # noqa: BLE001 - a model without a choice of attention kernel
            eager, default_attn = None, getattr(m32.config, "_attn_implementation", None)
        paths = {"decode": [], "recurrent": [], "teacher-forced": [], "eager": []}
        first: dict[str, tuple | None] = {}
        for pi, prompt in enumerate(prompts):
            with torch.no_grad():
                g = m32.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    use_cache=True,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=m32.config.pad_token_id,
                )
            new = g.sequences[0, len(prompt) :].tolist()
            ids = prompt + new
            gold = _forward_logprobs(m64, ids, torch)
            targets = torch.tensor(ids[1:])
            gold_tok = gold[:-1].gather(1, targets[:, None])[:, 0]
            dec = torch.stack([torch.log_softmax(lg[0].double(), -1)[t] for lg, t in zip(g.logits, new)])
            _add(paths, first, "decode", (dec - gold_tok[len(prompt) - 1 :]).abs(), len(prompt), pi)
            rec = _recurrent_logprobs(m32, ids, torch)
            _add(paths, first, "recurrent", (rec - gold_tok).abs(), 1, pi)
            for name, model in (("teacher-forced", m32), ("eager", eager)):
                if model is None:
                    continue
                lp = _forward_logprobs(model, ids, torch)[:-1].gather(1, targets[:, None])[:, 0]
                _add(paths, first, name, (lp - gold_tok).abs(), 1, pi)
    except Exception as e:  # noqa: BLE001 - a reference that cannot run this check: one line, the column says so
        return {"status": "reference cannot run", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    result = {
        name: {"max_abs": max(v) if v else None, "first_departure": first.get(name)} for name, v in paths.items() if v
    }
    # the model's own float32 rounding: the closest path to the gold; a path departs well past it
    floor = min([r["max_abs"] for r in result.values() if r["max_abs"] is not None] or [0.0])
    threshold = max(DEPART, SPREAD * floor)
    departing = [n for n, r in result.items() if r["max_abs"] is not None and r["max_abs"] > threshold]
    for r in result.values():
        if r["max_abs"] is None or r["max_abs"] <= threshold:
            r["first_departure"] = None  # past 1e-3 but within the model's own float32 rounding
    return {
        "status": "reference inconsistent" if departing else "reference consistent",
        "departing": departing,
        "paths": result,
        "depart_threshold": threshold,
        "float32_floor": floor,
        "gold": "float64 teacher-forced",
        "default_attention": default_attn,
        "n_prompts": len(prompts),
        "max_tokens": max_tokens,
    }


def _add(paths: dict, first: dict, name: str, d, start: int, prompt_index: int) -> None:
    """Record path `name`'s |d| (position `start` onwards) and its first position past DEPART."""
    values = d.tolist()
    paths[name].append(max(values) if values else 0.0)
    if first.get(name) is None:
        for i, v in enumerate(values):
            if v > DEPART:
                first[name] = {"prompt": prompt_index, "position": start + i}
                break
