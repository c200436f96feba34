"""An RL run that lpf's engine did not make: transformers samples a hybrid model, a trainer pass scores it,
and two known rollout faults are put in at known steps. Shares no code with `lpf.rl`.

`generate(model_dir, ...)` returns rows in lpf's own layout (`rl_sim_native.write` turns them into
prime-rl / NeMo-RL / slime files, `write_verl` into verl's), one row per response:
- sampling: HF `generate` with `do_sample=True` at temperature 1 (top-k off, top-p 1 except where said),
  EOS not stopping (so every response has `max_tokens` tokens); rollout logprob = log_softmax of the
  scores the sampler drew from (`output_scores`: the logits after the processors), at the sampled token;
- trainer logprob: a teacher-forced float32 forward over prompt + response, log_softmax, the same token;
- NUCLEUS steps: the rollout samples at top-p TOP_P with HF's `TopPLogitsWarper` and reports the
  renormalised logprob (vLLM's `logprobs_mode=processed_logprobs`): d = trainer - rollout = log kept mass;
- GROWTH steps: the rollout's logits carry Gaussian noise whose sigma grows with the position
  (GROWTH_SLOPE x position nats: the first token comes from the prefill, each later one from a state
  rounded once more), what a recurrent state kept in a low precision does; the sampler draws from the
  noisy logits, as an engine draws from its own;
- the other steps are clean: rollout and trainer differ by float32 rounding (cached decode vs one pass).
`truth(rows)` says, per step, which cause it carries.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TOP_P = 0.9
GROWTH_SLOPE = 0.02
NUCLEUS = (3, 7, 11)
GROWTH = (5, 9)
STEPS = 12
PROMPTS, ROLLOUTS = 4, 4  # responses per step = PROMPTS x ROLLOUTS
PROMPT_LEN = 6
MAX_TOKENS = 16


def truth(step: int) -> str | None:
    return "processed_logprobs" if step in NUCLEUS else "position_growth" if step in GROWTH else None


def generate(model_dir: str, seed: int = 0, micro_batch: int = 4) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList
    from transformers.generation.logits_process import TopPLogitsWarper

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    model.generation_config.eos_token_id = None  # EOS must not stop a response: every one is MAX_TOKENS long

    class GrowingError(LogitsProcessor):
        def __init__(self, start: int):
            self.start = start

        def __call__(self, input_ids, scores):
            pos = input_ids.shape[1] - self.start
            return scores + GROWTH_SLOPE * pos * torch.randn_like(scores)

    gc = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=MAX_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=1,
        output_scores=True,
        return_dict_in_generate=True,
    )
    rows = []
    for step in range(1, STEPS + 1):
        prompts = rng.integers(3, vocab, (PROMPTS, PROMPT_LEN))
        ids = torch.as_tensor(np.repeat(prompts, ROLLOUTS, axis=0))
        procs = LogitsProcessorList()
        if step in GROWTH:
            procs.append(GrowingError(PROMPT_LEN))
        if step in NUCLEUS:
            procs.append(TopPLogitsWarper(TOP_P))
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, logits_processor=procs)
            seqs = out.sequences
            resp_ids = seqs[:, PROMPT_LEN:]
            scores = torch.stack(out.scores, dim=1).float()  # [B, T, V], what the sampler drew from
            rollout = torch.log_softmax(scores, -1).gather(-1, resp_ids[..., None])[..., 0]
            logits = model(seqs, attention_mask=torch.ones_like(seqs)).logits.float()
            trainer = torch.log_softmax(logits[:, PROMPT_LEN - 1 : -1], -1).gather(-1, resp_ids[..., None])[..., 0]
        for i in range(ids.shape[0]):
            rows.append(
                {
                    "step": step,
                    "request_id": f"s{step}-p{i // ROLLOUTS}-r{i % ROLLOUTS}",
                    "prompt_id": f"s{step}-p{i // ROLLOUTS}",
                    "rollout": i % ROLLOUTS,
                    "prompt_token_ids": prompts[i // ROLLOUTS].tolist(),
                    "response_token_ids": resp_ids[i].tolist(),
                    "rollout_logprobs": rollout[i].double().numpy().astype(np.float32).tolist(),
                    "trainer_logprobs": trainer[i].double().numpy().astype(np.float32).tolist(),
                    "micro_batch": i // micro_batch,
                }
            )
    return rows


def write_verl(rows: list[dict], root: Path) -> Path:
    """verl/trainer/ppo/ray_trainer.py _dump_generations: rollout_data_dir/<global_steps>.jsonl, with the
    DataProto fields a user adds (docs/rl.md): prompts left-padded, responses right-padded (pad 0),
    attention_mask over both, response_mask, rollout_log_probs (padding -1), old_log_probs (padding 0), uid."""
    root.mkdir(parents=True, exist_ok=True)
    steps: dict[int, list[dict]] = {}
    for r in rows:
        steps.setdefault(r["step"], []).append(r)
    for step, resps in steps.items():
        pw = max(len(r["prompt_token_ids"]) for r in resps)
        rw = max(len(r["response_token_ids"]) for r in resps)
        lines = []
        for r in resps:
            p, o = r["prompt_token_ids"], r["response_token_ids"]
            lines.append(
                {
                    "input": "<prompt>",
                    "output": "<response>",
                    "gts": "",
                    "score": 0.0,
                    "step": step,
                    "uid": r["prompt_id"],
                    "prompts": [0] * (pw - len(p)) + p,
                    "responses": o + [0] * (rw - len(o)),
                    "attention_mask": [0] * (pw - len(p)) + [1] * (len(p) + len(o)) + [0] * (rw - len(o)),
                    "response_mask": [1] * len(o) + [0] * (rw - len(o)),
                    "rollout_log_probs": [float(x) for x in r["rollout_logprobs"]] + [-1.0] * (rw - len(o)),
                    "old_log_probs": [float(x) for x in r["trainer_logprobs"]] + [0.0] * (rw - len(o)),
                }
            )
        (root / f"{step}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root
