"""lpf's own layout (what `lpf rl simulate` writes, and what any script can write): Parquet or JSONL,
one row per response, the record fields of `lpf.rl.dump` as columns (step, request_id or prompt_id +
rollout, response_token_ids, rollout_logprobs, trainer_logprobs, optional loss_mask and
prompt_token_ids, any scalar metadata such as state_slot_min / state_slot_max / state_slot_stride).
"""

from __future__ import annotations

from lpf.rl.formats.common import Ctx

NAME = "lpf"
REQUIRED = ("step", "response_token_ids", "rollout_logprobs", "trainer_logprobs")
LAYOUT = "lpf (response_token_ids, rollout_logprobs, trainer_logprobs)"
KINDS = ("parquet", "jsonl")
DETECT = 30  # after the frameworks' own layouts: their fields are more specific


def matches(keys: set[str]) -> bool:
    return {"response_token_ids", "rollout_logprobs"} <= keys or {"response_token_ids", "trainer_logprobs"} <= keys


def missing(keys: set[str]) -> list[str]:
    return [k for k in REQUIRED if k not in keys]


def convert(rec: dict, ctx: Ctx) -> list[dict]:
    return [rec]
