"""verl: the `trainer.rollout_data_dir` JSONL carrying the DataProto's per-token fields.

Follows verl/trainer/ppo/ray_trainer.py (`_log_rollout_data` -> `_dump_generations`, volcengine/verl
@ b178a3cd): one `<global_steps>.jsonl` per step, one line per sample with input / output / gts /
score / step and every per-sample entry of `reward_extra_infos_dict`. The stock dump is text only
and verl has no option that adds token ids or logprobs to it; a user adds, per sample, the DataProto
fields `responses` (right-padded response ids), `response_mask` (or `attention_mask`, whose last
len(responses) entries are the response part), `rollout_log_probs` (written by the rollout only with
`actor_rollout_ref.rollout.calculate_log_probs=True`), `old_log_probs` (the actor's recomputation),
optionally `prompts` (left-padded prompt ids: with `attention_mask`, what `lpf rl rescore` needs)
and `uid` (the GRPO group). verl's own metrics mask with the same response_mask
(verl/utils/debug/metrics.py `calculate_debug_metrics`).

Identity: `request_id` when the row has one, else the line in its step file (`line_N`).
"""

from __future__ import annotations

from lpf.rl.formats.common import BadRow, Ctx

NAME = "verl"
REQUIRED = ("responses", "response_mask", "rollout_log_probs", "old_log_probs")
LAYOUT = "verl rollout_data_dir with per-token fields"
KINDS = ("parquet", "jsonl")
DETECT = 40  # last: one of its fields is enough
_DATA = (
    "responses",
    "response_mask",
    "attention_mask",
    "rollout_log_probs",
    "old_log_probs",
    "input",
    "output",
    "prompts",
    "input_ids",
    "position_ids",
    "global_steps",
)
TEXT_ONLY = (
    "this looks like verl's text-only rollout_data_dir dump (input/output/score/step): no logprobs; verl writes no "
    "token ids or logprobs there and has no option to; set actor_rollout_ref.rollout.calculate_log_probs=True "
    "and add the per-sample DataProto fields responses, response_mask, rollout_log_probs and old_log_probs "
    "(and prompts, attention_mask for lpf rl rescore) to the reward_extra_infos_dict that _dump_generations "
    "writes (docs/rl.md, verl)"
)


def matches(keys: set[str]) -> bool:
    return bool({"responses", "rollout_log_probs", "old_log_probs"} & keys)


def text_only(keys: set[str]) -> bool:
    return {"input", "output"} <= keys and not matches(keys)


def refuse(keys: set[str]) -> str | None:
    """Why a dump of verl's stock, text-only layout cannot be read (None for any other)."""
    return TEXT_ONLY if text_only(keys) else None


def missing(keys: set[str]) -> list[str]:
    out = [k for k in ("responses", "rollout_log_probs", "old_log_probs") if k not in keys]
    if not {"response_mask", "attention_mask"} & keys:
        out.append("response_mask (or attention_mask)")
    return out


def convert(rec: dict, ctx: Ctx) -> list[dict]:
    for k in ("responses", "rollout_log_probs", "old_log_probs"):
        if rec.get(k) is None:
            raise BadRow(f"missing {k}")
    ids, rlp, olp = rec["responses"], rec["rollout_log_probs"], rec["old_log_probs"]
    if not all(isinstance(v, list) for v in (ids, rlp, olp)):
        raise BadRow("responses / rollout_log_probs / old_log_probs must be lists")
    width = len(ids)
    attn = rec.get("attention_mask")
    if rec.get("response_mask") is not None:
        mask = rec["response_mask"]
    elif attn is not None:
        mask = attn[-width:] if width else []  # verl: prompt part first, response part last
    else:
        raise BadRow("missing response_mask (or attention_mask)")
    if not isinstance(mask, list):
        raise BadRow("response_mask must be a list")
    if not len(mask) == len(rlp) == len(olp) == width:
        raise BadRow(
            f"length mismatch: responses {width}, response_mask {len(mask)}, "
            f"rollout_log_probs {len(rlp)}, old_log_probs {len(olp)}"
        )
    on = [i for i, m in enumerate(mask) if m]
    end = on[-1] + 1 if on else 0  # strip right padding; inner zeros (tool output) stay masked
    step = rec.get("step", rec.get("global_steps"))
    if step is None and ctx.file.stem.isdigit():  # rollout_data_dir names its files <global_steps>.jsonl
        step = int(ctx.file.stem)
    out = {k: v for k, v in rec.items() if k not in _DATA}
    out.update(
        step=step,
        response_token_ids=ids[:end],
        rollout_logprobs=rlp[:end],
        trainer_logprobs=olp[:end],
        loss_mask=[1 if m else 0 for m in mask[:end]],
    )
    prompt = _prompt(rec, attn, width)
    if prompt is not None:
        out["prompt_token_ids"] = prompt
    if "uid" in rec and "prompt_id" not in rec:
        out["prompt_id"] = str(rec["uid"])
    if out.get("request_id") is None and (out.get("prompt_id") is None or out.get("rollout") is None):
        out["request_id"] = f"line_{ctx.row}"
    return [out]


def _prompt(rec: dict, attn, width: int):
    if rec.get("prompt_token_ids") is not None:
        return rec["prompt_token_ids"]
    prompts = rec.get("prompts")
    if not isinstance(prompts, list):
        return None
    if isinstance(attn, list) and len(attn) == len(prompts) + width:  # left padding: keep the attended part
        return [t for t, m in zip(prompts, attn[: len(prompts)]) if m]
    return None
