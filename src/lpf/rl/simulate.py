"""`lpf rl simulate`: an RL-style rollout loop on ONE persistent built-in engine, written as a dump.

Each training step hands the engine P prompts x N rollouts (sampled at temperature 1, as RL does),
runs it until they all finish, then scores the exact tokens with the reference rescorer in float32
(the "trainer" forward). The engine is built once and lives across steps, as a rollout worker's
does: its state-slot pool keeps sweeping upward through the slot ids from one step to the next,
so a fault that needs high slot ids (offset-wrap) bites every K ~ num_slots / (P * N) steps.
Prompts are drawn from the workload in order and cycled, a new batch each step like a dataloader.

Output (`dump_path`: `--out x.parquet` is the file, any other `--out DIR` a directory holding
DIR/dump.parquet): the `lpf` dump layout of `lpf.rl.dump` plus prompt_token_ids, finish_reason and the engine
metadata state_slot_min / state_slot_max (the slots the request ran in, from the engine trace) and
state_slot_stride. The engine description and the spec go to the Parquet key metadata "lpf"; fault
ground truth (which requests a drill corrupted) goes to a sibling `<stem>.faults.parquet` that
analysis never reads.

The trainer (`lpf.rl.trainer`) scores each step's sequences in micro-batches of at most
`micro_batch_tokens` padded tokens; every response carries micro_batch / micro_batch_size /
micro_batch_tokens, as a trainer's own layout would say it. RL-cause drills (`--drill`,
`lpf.rl.drills`) put back one mechanism each; `policy_drift` > 0 makes the policy change every
step (`lpf.rl.policy`): the engine gets the new weights before each step (LAG steps late under
stale-policy), each response carries policy_version (the step whose weights generated it), and the
trainer's weights of every step are written as checkpoints `<stem>.policy/step_{step}` (what
`lpf rl rescore` scores with). The ground truth of the causes, per response and token, goes to
`<stem>.causes.parquet` (`lpf.rl.sim_truth`), which analysis never reads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from lpf.core.errors import LpfError
from lpf.rl.drills import DEFAULT_DRIFT, RLDrills
from lpf.core.sampling import SamplingParams

DUMP_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("request_id", pa.string()),
        ("prompt_id", pa.string()),
        ("rollout", pa.int32()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("rollout_logprobs", pa.list_(pa.float64())),
        ("trainer_logprobs", pa.list_(pa.float64())),
        ("finish_reason", pa.string()),
        ("state_slot_min", pa.int32()),
        ("state_slot_max", pa.int32()),
        ("state_slot_stride", pa.int64()),
        ("micro_batch", pa.int32()),
        ("micro_batch_size", pa.int32()),
        ("micro_batch_tokens", pa.int32()),
        ("policy_version", pa.int32()),
    ]
)


@dataclass(frozen=True)
class SimSpec:
    steps: int = 20
    prompts: int = 1
    rollouts: int = 8
    inject: str = ""
    model: str = "zoo:hybrid"
    workload: str = "zoo:oracle"
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    engine: dict = field(default_factory=dict)  # EngineConfig knobs: cache_mb, max_num_seqs, ...
    drills: tuple[str, ...] = ()  # RL-cause drills (lpf.rl.drills)
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False
    policy_drift: float = 0.0  # relative weight change per step (0: the policy never changes)
    micro_batch_tokens: int = 96  # the trainer's micro-batch budget in padded tokens

    def __post_init__(self):
        for name in ("steps", "prompts", "rollouts", "max_tokens", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise LpfError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise LpfError(f"--temperature must be > 0 for RL-style sampling, got {self.temperature}")
        if not 0 <= self.policy_drift <= 0.1:
            raise LpfError(
                f"--policy-drift must be in 0..0.1 (relative weight change per step), got {self.policy_drift}"
            )
        drills = RLDrills.parse(list(self.drills))
        if drills.top_p is not None and self.top_p != 1.0:
            raise LpfError("--top-p and the processed-logprobs drill both set top-p; give one")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens)

    @property
    def rl_drills(self) -> RLDrills:
        return RLDrills.parse(list(self.drills))

    @property
    def drift(self) -> float:
        """The policy's drift per step: stale-policy needs a moving policy, so it brings a default."""
        if self.policy_drift == 0 and self.rl_drills.stale_lag is not None:
            return DEFAULT_DRIFT
        return self.policy_drift


def _noop(*_):
    pass


def simulate(spec: SimSpec, out: Path, on_start: Callable = _noop, tick: Callable = _noop) -> dict:
    """Run the loop and write the dump to `out`; returns the engine description and counts."""
    from lpf.adapters.builtin import BuiltinEngine, BuiltinOptions
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.core.workload import load_prompts
    from lpf.pipeline import model_config

    drills = spec.rl_drills
    inject = ",".join(x for x in (spec.inject, "processed-logprobs" if drills.top_p is not None else "") if x)
    knobs = {**spec.engine, "inject": inject}
    if drills.state_dtype is not None:
        knobs["mamba_ssm_cache_dtype"] = drills.state_dtype
    options = BuiltinOptions.parse(knobs)  # knobs and drills checked first
    model = resolve_model(spec.model)
    cfg = model_config(model)
    BuiltinEngine.check_model(cfg)
    tokenizer = load_tokenizer(model)
    prompts, _ = load_prompts(
        spec.workload, tokenizer, cfg.get("vocab_size", len(tokenizer)), cfg.get("max_position_embeddings")
    )
    sampling = SamplingParams(
        temperature=spec.temperature,
        max_tokens=spec.max_tokens,
        seed=spec.seed,
        logprobs=0,
        top_p=drills.top_p if drills.top_p is not None else spec.top_p,
        top_k=spec.top_k,
        ignore_eos=spec.ignore_eos,
    )
    out = dump_path(Path(out))
    out.parent.mkdir(parents=True, exist_ok=True)

    import torch

    from lpf.builtin.llm_engine import LLMEngine
    from lpf.rl import sim_truth
    from lpf.rl.trainer import SimTrainer

    engine = LLMEngine.from_options(model.path, options)
    trainer = SimTrainer(model, spec.micro_batch_tokens, batch_variant=drills.micro_batch)
    policy, lag = None, drills.stale_lag or 0
    if spec.drift > 0:
        from lpf.rl.policy import PolicyDrift

        policy = PolicyDrift(model.path, spec.drift, spec.seed, trainer.state_keys())
        policy_dir = policy_path(out)
        policy.save(0, policy_dir)
    desc = engine.describe()
    stride = desc["state_slot_stride"]
    on_start(spec.steps, 0)
    rows, truth, causes, seq = [], [], [], 0
    eos = None if spec.ignore_eos else tokenizer.eos_token_id
    for step in range(1, spec.steps + 1):
        version = step
        if policy is not None:  # the weight sync before the rollouts: LAG steps late under stale-policy
            version = max(step - lag, 0)
            policy.load_into(engine.model, policy.weights(version), engine.model.rename_checkpoint_keys)
        batch = []
        for p in range(spec.prompts):
            prompt = prompts[((step - 1) * spec.prompts + p) % len(prompts)]
            for r in range(spec.rollouts):
                batch.append((prompt, r, seq))
                seq += 1
        with torch.inference_mode():
            finished = _rollout(engine, batch, step, sampling, spec.max_tokens, eos)
        slots = _slots(engine.drain_trace())
        gt = engine.truth.drain()
        if gt is not None:
            truth.append(gt.append_column("train_step", pa.array([step] * gt.num_rows, pa.int64())))
        trained = sim_truth.score_step(trainer, policy, step, version, finished)
        for req, prompt, r in finished:
            lo, hi = slots.get(req.request_id, (None, None))
            mb, size, tokens = trained.layout[req.request_id]
            rows.append(
                {
                    "step": step,
                    "request_id": req.request_id,
                    "prompt_id": prompt.prompt_id,
                    "rollout": r,
                    "prompt_token_ids": list(prompt.prompt_token_ids),
                    "response_token_ids": req.output_token_ids,
                    "rollout_logprobs": req.logprobs,
                    "trainer_logprobs": trained.reported[req.request_id],
                    "finish_reason": req.finish_reason,
                    "state_slot_min": lo,
                    "state_slot_max": hi,
                    "state_slot_stride": stride,
                    "micro_batch": mb,
                    "micro_batch_size": size,
                    "micro_batch_tokens": tokens,
                    "policy_version": version if policy is not None else None,
                }
            )
        causes.append(sim_truth.truth_rows(step, finished, trained, drills))
        if policy is not None:
            policy.save(step, policy_dir)
        tick(1)
    meta = {
        "engine": desc,
        "spec": asdict(spec),
        "n_state_slots": desc["num_state_slots"],
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k},
        "dtypes": {"rollout": options.dtype, "trainer": "float32"},
        "rl_drills": drills.names(),
    }
    if policy is not None:
        meta["policy"] = {"drift": spec.drift, "checkpoints": str(policy_dir / "step_{step}"), "lag": lag}
    table = pa.Table.from_pylist(rows, schema=DUMP_SCHEMA.with_metadata({"lpf": json.dumps(meta)}))
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(out)
    if truth:
        pq.write_table(pa.concat_tables(truth), faults_path(out))
    pq.write_table(pa.concat_tables(causes), causes_path(out))
    return {
        "n_responses": len(rows),
        "cache": desc,
        "dump": str(out),
        "rl_drills": drills.names(),
        "policy": meta.get("policy"),
    }


def dump_path(out: Path) -> Path:
    """`--out x.parquet` is the dump file itself; any other `--out DIR` is a directory holding
    DIR/dump.parquet (and its ground truth), like every other lpf --out."""
    if out.suffix == ".parquet":
        if out.is_dir():
            raise LpfError(f"--out {out} is a directory; give a file name, or a directory without the .parquet suffix")
        return out
    if out.exists() and not out.is_dir():
        raise LpfError(
            f"--out {out} exists and is not a directory; give a directory, or a file name ending in .parquet"
        )
    return out / "dump.parquet"


def faults_path(dump: Path) -> Path:
    return dump.with_name(dump.stem + ".faults.parquet")


def causes_path(dump: Path) -> Path:
    """The RL-cause ground truth beside the dump (no dump layout: readers ignore it)."""
    return dump.with_name(dump.stem + ".causes.parquet")


def policy_path(dump: Path) -> Path:
    return dump.with_name(dump.stem + ".policy")


def _rollout(engine, batch, step: int, sampling, max_tokens: int, eos: int | None) -> list:
    from lpf.builtin.request import Request
    from lpf.core.sampling import request_seed

    by_id = {}
    for prompt, r, seq in batch:
        rid = f"s{step}-{prompt.prompt_id}-r{r}"
        req = Request(
            rid,
            list(prompt.prompt_token_ids),
            sampling,
            prompt.max_tokens or max_tokens,
            request_seed(sampling.seed, seq),
            eos,
            seq=seq,
        )
        rejected = engine.add_request(req)
        if rejected is not None:
            raise LpfError(f"step {step}: {rejected.error}")
        by_id[rid] = (prompt, r)
    done = []
    while engine.has_unfinished():
        for req in engine.step():
            done.append((req, *by_id[req.request_id]))
    return done


def _slots(trace: pa.Table | None) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    if trace is None:
        return out
    for rid, slot in zip(trace.column("request_id").to_pylist(), trace.column("state_slot").to_pylist()):
        if slot is None:
            continue
        lo, hi = out.get(rid, (slot, slot))
        out[rid] = (min(lo, slot), max(hi, slot))
    return out
