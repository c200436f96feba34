"""RL dumps written the way each framework writes them, from one synthetic RL run with a known fault.

`make_run` draws a run: per step, RESPONSES responses (prompt + one model turn, or, for response
MULTI_TURN, two model turns around a tool output the model did not generate), rollout logprobs, and
trainer logprobs = rollout + bf16-sized noise. On FAULTY steps (every 7th) responses FAULTY_IDX get a
rollout lie in their last model turn from its 4th token on (a stale state read by the engine).

The writers follow each framework's writer code (cited per writer; snapshots in docs/rl.md): layout,
file names, key names, dtypes (float32 values as the frameworks' tolist() gives them), padding,
masks and step numbering. They share no code with `lpf.rl`: what they write is what a user's disk
holds. `expected_ids` is what `lpf rl analyze` must name for the faulty responses, per format.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

RESPONSES = 8
FAULTY_IDX = (1, 3)
MULTI_TURN = 3
PERIOD = 7
VOCAB = 256


@dataclass
class Turn:
    ids: list[int]
    rollout: np.ndarray  # float32
    trainer: np.ndarray  # float32


@dataclass
class Response:
    step: int
    index: int  # position in the step
    prompt: list[int]
    turns: list[Turn]
    tool: list[int] = field(default_factory=list)  # between turn 0 and turn 1
    prompt_trainer: np.ndarray = None  # the trainer's logprobs of prompt and tool tokens (unused by metrics)
    tool_trainer: np.ndarray = None
    faulty: bool = False

    def sequence(self) -> list[int]:
        out = list(self.prompt) + self.turns[0].ids
        if len(self.turns) > 1:
            out += self.tool + self.turns[1].ids
        return out

    def generated(self) -> list[bool]:
        """Per position of sequence(): True where the model generated the token."""
        g = [False] * len(self.prompt) + [True] * len(self.turns[0].ids)
        if len(self.turns) > 1:
            g += [False] * len(self.tool) + [True] * len(self.turns[1].ids)
        return g

    def aligned(self, which: str, fill: float) -> np.ndarray:
        """Per position of sequence(): the side's logprob where generated, `fill` elsewhere."""
        out = np.full(len(self.sequence()), fill, dtype=np.float32)
        at = np.flatnonzero(self.generated())
        out[at] = np.concatenate([getattr(t, which) for t in self.turns])
        return out

    def trainer_full(self) -> np.ndarray:
        """The trainer scores every position: its logprob of prompt and tool tokens too."""
        out = self.aligned("trainer", 0.0)
        gen = np.asarray(self.generated())
        out[~gen] = np.concatenate([self.prompt_trainer, self.tool_trainer])[: int((~gen).sum())]
        return out


def make_run(steps, faulty_steps, seed: int = 0) -> list[list[Response]]:
    rng = np.random.default_rng(seed)
    run = []
    for step in steps:
        out = []
        for i in range(RESPONSES):
            prompt = rng.integers(3, VOCAB, int(rng.integers(4, 8))).tolist()
            n_turns = 2 if i == MULTI_TURN else 1
            turns = []
            for _ in range(n_turns):
                n = int(rng.integers(8, 16))
                r = -rng.uniform(0.01, 3.0, n)
                t = np.minimum(r + rng.normal(0, 0.002, n), 0.0)
                turns.append(Turn(rng.integers(3, VOCAB, n).tolist(), r.astype(np.float32), t.astype(np.float32)))
            tool = rng.integers(3, VOCAB, 3).tolist() if n_turns > 1 else []
            resp = Response(
                step,
                i,
                prompt,
                turns,
                tool,
                prompt_trainer=-rng.uniform(0.1, 6.0, len(prompt)).astype(np.float32),
                tool_trainer=-rng.uniform(0.1, 6.0, len(tool)).astype(np.float32),
            )
            if step in faulty_steps and i in FAULTY_IDX:
                last = turns[-1]
                lie = last.rollout.copy()
                lie[3:] = lie[3:] - rng.uniform(1.0, 3.0, lie.size - 3).astype(np.float32)
                last.rollout = lie
                resp.faulty = True
            out.append(resp)
        run.append(out)
    return run


def floats(a) -> list:
    """float32 values as tolist() gives them, non-finite as null (prime-rl's _json_float)."""
    return [v if math.isfinite(v) else None for v in np.asarray(a, dtype=np.float32).tolist()]


def _jsonl(path: Path, records: list[dict], **kw) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, **kw) + "\n" for r in records))


# -- prime-rl -----------------------------------------------------------------------------------------
PRIME_RANKS = 2


def prime_rl_place(resp: Response) -> tuple[int, int]:
    """(rank, export_sequence_idx): responses alternate over the ranks, in order within a rank."""
    return resp.index % PRIME_RANKS, resp.index // PRIME_RANKS


def write_prime_rl(run, root: Path) -> Path:
    """src/prime_rl/trainer/rl/token_export.py (TokenExporter.export / _export_columns) and train.py:
    token_exports/step_<step>/rank_<rank>.jsonl, compact JSON, one line per packed sequence, a STABLE
    marker per step directory once every rank flushed. trainer_logprobs are shifted right (position 0
    holds log(1/vocab)); inference_logprobs are 0 outside completions; the loss-derived columns are
    computed at every position in float32, as the exporter does."""
    out = root / "token_exports"
    for step_resps in run:
        step = step_resps[0].step
        by_rank: dict[int, list[dict]] = {}
        for resp in step_resps:
            rank, seq = prime_rl_place(resp)
            ids = resp.sequence()
            n = len(ids)
            inf = resp.aligned("rollout", 0.0)
            tr = resp.trainer_full()
            tr[0] = np.float32(math.log(1.0 / VOCAB))
            lr = tr - inf
            ratio = np.exp(lr)
            mkl = ratio - lr - np.float32(1.0)
            delta = np.exp(tr) - np.exp(inf)
            loss = resp.generated()
            adv = 0.5 if resp.index % 2 else -0.5
            hi, lo = delta > 0.2, delta < -0.2
            masked = [bool(m and (h if adv > 0 else lw)) for m, h, lw in zip(loss, hi, lo)]
            by_rank.setdefault(rank, []).append(
                {
                    "schema_version": 1,
                    "step": step,
                    "rank": rank,
                    "micro_step": seq // 2,
                    "micro_sequence_idx": seq % 2,
                    "export_sequence_idx": seq,
                    "env_name": "math",
                    "token_ids": ids,
                    "position_ids": list(range(n)),
                    "loss_mask": loss,
                    "advantages": [adv] * n,
                    "inference_logprobs": floats(inf),
                    "trainer_logprobs": floats(tr),
                    "entropy": floats(np.full(n, 1.3)),
                    "mismatch_kl": floats(mkl),
                    "log_importance_ratio": floats(lr),
                    "importance_ratio": floats(ratio),
                    "prob_delta": floats(delta),
                    "is_masked": masked,
                    "is_masked_high": [m and adv > 0 for m in masked],
                    "is_masked_low": [m and adv < 0 for m in masked],
                    "rl_weights": [None] * n,
                    "ce_weights": [None] * n,
                    "ref_kl_weights": [None] * n,
                }
            )
        for rank, recs in by_rank.items():
            _jsonl(out / f"step_{step}" / f"rank_{rank}.jsonl", recs, separators=(",", ":"), allow_nan=False)
        (out / f"step_{step}" / "STABLE").touch()
    return out


def prime_rl_ids(resp: Response) -> list[str]:
    rank, seq = prime_rl_place(resp)
    if len(resp.turns) == 1:
        return [f"rank_{rank}/seq_{seq}"]
    return [f"rank_{rank}/seq_{seq}/span_{k}" for k in range(len(resp.turns))]


def prime_rl_faulty_ids(resp: Response) -> list[str]:
    return prime_rl_ids(resp)[-1:]  # the lie is in the last model turn: its span


# -- NeMo-RL -------------------------------------------------------------------------------------------
NEMO_SKIPPED_IDX = 7  # sample_loss_mask 0 on every step: NeMo-RL leaves it out


def write_nemo_rl(run, root: Path) -> Path:
    """nemo_rl/algorithms/grpo.py (Logging) + nemo_rl/utils/logger.py log_batched_dict_as_jsonl:
    train_data_step{N}.jsonl (N counts from 1), every key sliced with a batch dimension of 1, plus
    idx. Sequences right-padded (pad id 0) to the step's widest; generation_logprobs 0 outside
    generated tokens; prev_logprobs with a 0 prepended at position 0 and the policy's (meaningless)
    logprobs on padding."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for step_resps in run:
        step = step_resps[0].step
        width = max(len(r.sequence()) for r in step_resps)
        recs = []
        for resp in step_resps:
            ids = resp.sequence()
            n, pad = len(ids), width - len(ids)
            gen = np.concatenate([resp.aligned("rollout", 0.0), np.zeros(pad, np.float32)])
            prev = np.concatenate([resp.trainer_full(), -rng.uniform(0.1, 9.0, pad).astype(np.float32)])
            prev[0] = 0.0
            recs.append(
                {
                    "content": [["<user turn>", "<assistant turn>"]],
                    "rewards": [float(resp.index % 2)],
                    "input_lengths": [n],
                    "token_ids": [ids + [0] * pad],
                    "token_loss_mask": [[int(g) for g in resp.generated()] + [0] * pad],
                    "sample_loss_mask": [0 if resp.index == NEMO_SKIPPED_IDX else 1],
                    "advantages": [[0.25] * width],
                    "generation_logprobs": [floats(gen)],
                    "prev_logprobs": [floats(prev)],
                    "idx": resp.index,
                }
            )
        _jsonl(root / f"train_data_step{step}.jsonl", recs, default=str)
    return root


# -- slime ---------------------------------------------------------------------------------------------
SLIME_SIBLING = (6, 7)  # a compact rollout: two training samples of one rollout execution (shared rollout id)


def slime_rollout_ids() -> list[int]:
    ids = list(range(RESPONSES))
    ids[SLIME_SIBLING[1]] = ids[SLIME_SIBLING[0]]
    return ids


def slime_index(resp: Response) -> int:
    return resp.step * RESPONSES + resp.index


def write_slime(run, root: Path) -> Path:
    """slime/observability/rollout_data_utils.py save_debug_rollout_data ({"rollout_id", "samples":
    [Sample.to_dict()]}) and slime/observability/train_data_utils.py _build_dump_payload (format 2:
    samples sorted by rollout_position, per-sample tensors as the actor holds them: tokens long,
    loss_masks int, log-probs float32), at `--dump-details DIR`: DIR/rollout_data/{id}.pt and
    DIR/train_data/{id}.pt, rollout ids from 0. slime/ray/rollout.py gives rollout_mask_sums (the
    loss-mask total of a sample's whole rollout) and assigns unset rollout ids in order."""
    import torch

    (root / "rollout_data").mkdir(parents=True, exist_ok=True)
    (root / "train_data").mkdir(parents=True, exist_ok=True)
    rids = slime_rollout_ids()
    for step_resps in run:
        rid = step_resps[0].step
        masks = [[int(g) for g in r.generated()[len(r.prompt) :]] for r in step_resps]
        totals: dict[int, int] = {}
        for k, m in zip(rids, masks):
            totals[k] = totals.get(k, 0) + sum(m)
        rollout, train = [], []
        for pos, (resp, mask) in enumerate(zip(step_resps, masks)):
            ids = resp.sequence()
            n = len(ids) - len(resp.prompt)
            rlp = resp.aligned("rollout", 0.0)[len(resp.prompt) :]  # tool tokens: 0.0, as append_response_tokens
            tlp = resp.trainer_full()[len(resp.prompt) :]
            rollout.append(
                {
                    "group_index": rid * 2 + resp.index // 4,
                    "index": slime_index(resp),
                    "rollout_id": rids[resp.index] if resp.index in SLIME_SIBLING else None,
                    "prompt": "<prompt>",
                    "tokens": ids,
                    "multimodal_inputs": None,
                    "multimodal_train_inputs": None,
                    "multimodal_train_input_id": None,
                    "apply_chat_template_kwargs": {},
                    "response": "<response>",
                    "response_length": n,
                    "label": "7",
                    "reward": float(resp.index % 2),
                    "loss_mask": mask,
                    "weight_versions": ["0"],
                    "rollout_log_probs": [float(v) for v in rlp],
                    "rollout_top_p_token_ids": None,
                    "rollout_top_p_token_offsets": None,
                    "rollout_routed_experts": None,
                    "remove_sample": False,
                    "teacher_log_probs": None,
                    "status": "completed",
                    "metadata": {},
                    "generate_function_path": None,
                    "custom_rm_path": None,
                    "train_metadata": None,
                    "session_id": None,
                    "non_generation_time": 0.0,
                    "spec_info": {
                        "spec_accept_token_num": 0,
                        "spec_draft_token_num": 0,
                        "spec_verify_ct": 0,
                        "completion_token_num": n,
                    },
                    "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": len(resp.prompt)},
                }
            )
            train.append(
                {
                    "data_parallel_rank": 0,
                    "sample_index": slime_index(resp),
                    "rollout_position": pos,
                    "tokens": torch.tensor(ids, dtype=torch.long),
                    "response_lengths": n,
                    "total_lengths": len(ids),
                    "rewards": float(resp.index % 2),
                    "truncated": 0,
                    "rollout_ids": rids[resp.index],
                    "loss_masks": torch.tensor(mask, dtype=torch.int),
                    "rollout_mask_sums": torch.tensor(float(totals[rids[resp.index]]), dtype=torch.float32),
                    "rollout_log_probs": torch.tensor(rlp, dtype=torch.float32),
                    "log_probs": torch.tensor(tlp, dtype=torch.float32),
                    "advantages": torch.full((n,), 0.25),
                    "returns": torch.full((n,), 0.25),
                }
            )
        torch.save({"rollout_id": rid, "samples": rollout}, root / "rollout_data" / f"{rid}.pt")
        layout = [
            {
                "rank": 0,
                "data_parallel_rank": 0,
                "sample_indices": [s["sample_index"] for s in train],
                "partition": list(range(len(train))),
                "micro_batch_indices": [list(range(len(train)))],
                "num_microbatches": [1],
                "global_batch_sizes": [len(set(rids))],
            }
        ]
        torch.save(
            {
                "format_version": 2,
                "rollout_id": rid,
                "rank": 0,
                "samples": train,
                "dp_shards": layout,
                "raw_reward": [float(r.index % 2) for r in step_resps],
            },
            root / "train_data" / f"{rid}.pt",
        )
    return root


# -- verl ----------------------------------------------------------------------------------------------
def write_verl(run, root: Path) -> Path:
    """verl/trainer/ppo/ray_trainer.py _dump_generations: rollout_data_dir/<global_steps>.jsonl
    (steps from 1), input/output/gts/score/step per line, plus the DataProto fields a user adds to
    the dumped extra infos: prompts left-padded and responses right-padded (pad id 0), attention_mask
    over both, response_mask (0 on tool output and padding), rollout_log_probs (tool tokens 0, padding
    -1), old_log_probs (padding 0) and uid (the GRPO group)."""
    root.mkdir(parents=True, exist_ok=True)
    for step_resps in run:
        step = step_resps[0].step
        pw = max(len(r.prompt) for r in step_resps)
        rw = max(len(r.sequence()) - len(r.prompt) for r in step_resps)
        lines = []
        for resp in step_resps:
            body = resp.sequence()[len(resp.prompt) :]
            n = len(body)
            gen = [int(g) for g in resp.generated()[len(resp.prompt) :]]
            rlp = resp.aligned("rollout", 0.0)[len(resp.prompt) :]
            tlp = resp.trainer_full()[len(resp.prompt) :]
            lines.append(
                {
                    "input": "<prompt>",
                    "output": "<response>",
                    "gts": "7",
                    "score": float(resp.index % 2),
                    "step": step,
                    "uid": f"u{step}-{resp.index // 4}",
                    "prompts": [0] * (pw - len(resp.prompt)) + resp.prompt,
                    "responses": body + [0] * (rw - n),
                    "attention_mask": [0] * (pw - len(resp.prompt)) + [1] * (len(resp.prompt) + n) + [0] * (rw - n),
                    "response_mask": gen + [0] * (rw - n),
                    "rollout_log_probs": floats(rlp) + [-1.0] * (rw - n),
                    "old_log_probs": floats(tlp) + [0.0] * (rw - n),
                }
            )
        (root / f"{step}.jsonl").write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n")
    return root
