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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from lpf.core.errors import LpfError

DUMP_SCHEMA = pa.schema([
    ("step", pa.int64()), ("request_id", pa.string()), ("prompt_id", pa.string()), ("rollout", pa.int32()),
    ("prompt_token_ids", pa.list_(pa.int32())), ("response_token_ids", pa.list_(pa.int32())),
    ("rollout_logprobs", pa.list_(pa.float64())), ("trainer_logprobs", pa.list_(pa.float64())),
    ("finish_reason", pa.string()), ("state_slot_min", pa.int32()), ("state_slot_max", pa.int32()),
    ("state_slot_stride", pa.int64()),
])


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

    def __post_init__(self):
        for name in ("steps", "prompts", "rollouts", "max_tokens"):
            if getattr(self, name) < 1:
                raise LpfError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise LpfError(f"--temperature must be > 0 for RL-style sampling, got {self.temperature}")


def _noop(*_):
    pass


def simulate(spec: SimSpec, out: Path, on_start: Callable = _noop, tick: Callable = _noop) -> dict:
    """Run the loop and write the dump to `out`; returns the engine description and counts."""
    from lpf.adapters.builtin import BuiltinEngine, BuiltinOptions
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.pipeline import model_config
    from lpf.core.sampling import SamplingParams
    from lpf.core.workload import load_prompts

    options = BuiltinOptions.parse({**spec.engine, "inject": spec.inject})  # knobs and drills checked first
    model = resolve_model(spec.model)
    cfg = model_config(model)
    BuiltinEngine.check_model(cfg)
    tokenizer = load_tokenizer(model)
    prompts, _ = load_prompts(spec.workload, tokenizer, cfg.get("vocab_size", len(tokenizer)),
                              cfg.get("max_position_embeddings"))
    sampling = SamplingParams(temperature=spec.temperature, max_tokens=spec.max_tokens, seed=spec.seed,
                              logprobs=0)
    out = dump_path(Path(out))
    out.parent.mkdir(parents=True, exist_ok=True)

    import torch

    from lpf.builtin.llm_engine import LLMEngine
    from lpf.pipeline.reference import Rescorer

    engine = LLMEngine.from_options(model.path, options)
    rescorer = Rescorer(model, dtype="float32", topk=1)
    desc = engine.describe()
    stride = desc["state_slot_stride"]
    on_start(spec.steps, 0)
    rows, truth, seq = [], [], 0
    for step in range(1, spec.steps + 1):
        batch = []
        for p in range(spec.prompts):
            prompt = prompts[((step - 1) * spec.prompts + p) % len(prompts)]
            for r in range(spec.rollouts):
                batch.append((prompt, r, seq))
                seq += 1
        with torch.inference_mode():
            finished = _rollout(engine, batch, step, sampling, spec.max_tokens, tokenizer.eos_token_id)
        slots = _slots(engine.drain_trace())
        gt = engine.truth.drain()
        if gt is not None:
            truth.append(gt.append_column("train_step", pa.array([step] * gt.num_rows, pa.int64())))
        trainer = _trainer_logprobs(rescorer, finished)
        for req, prompt, r in finished:
            lo, hi = slots.get(req.request_id, (None, None))
            rows.append({"step": step, "request_id": req.request_id, "prompt_id": prompt.prompt_id, "rollout": r,
                         "prompt_token_ids": list(prompt.prompt_token_ids),
                         "response_token_ids": req.output_token_ids, "rollout_logprobs": req.logprobs,
                         "trainer_logprobs": trainer[req.request_id], "finish_reason": req.finish_reason,
                         "state_slot_min": lo, "state_slot_max": hi, "state_slot_stride": stride})
        tick(1)
    meta = {"engine": desc, "spec": asdict(spec), "n_state_slots": desc["num_state_slots"]}
    table = pa.Table.from_pylist(rows, schema=DUMP_SCHEMA.with_metadata({"lpf": json.dumps(meta)}))
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(out)
    if truth:
        pq.write_table(pa.concat_tables(truth), faults_path(out))
    return {"n_responses": len(rows), "cache": desc, "dump": str(out)}


def dump_path(out: Path) -> Path:
    """`--out x.parquet` is the dump file itself; any other `--out DIR` is a directory holding
    DIR/dump.parquet (and its ground truth), like every other lpf --out."""
    if out.suffix == ".parquet":
        if out.is_dir():
            raise LpfError(f"--out {out} is a directory; give a file name, or a directory without the .parquet suffix")
        return out
    if out.exists() and not out.is_dir():
        raise LpfError(f"--out {out} exists and is not a directory; give a directory, or a file name ending in .parquet")
    return out / "dump.parquet"


def faults_path(dump: Path) -> Path:
    return dump.with_name(dump.stem + ".faults.parquet")


def _rollout(engine, batch, step: int, sampling, max_tokens: int, eos: int | None) -> list:
    from lpf.builtin.request import Request
    from lpf.core.sampling import request_seed

    by_id = {}
    for prompt, r, seq in batch:
        rid = f"s{step}-{prompt.prompt_id}-r{r}"
        req = Request(rid, list(prompt.prompt_token_ids), sampling, prompt.max_tokens or max_tokens,
                      request_seed(sampling.seed, seq), eos, seq=seq)
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


def _trainer_logprobs(rescorer, finished) -> dict[str, list[float]]:
    from lpf.pipeline.reference import ScoreItem

    items = [ScoreItem(req.request_id, list(prompt.prompt_token_ids), req.output_token_ids)
             for req, prompt, _ in finished]
    out: dict[str, list[float]] = {it.request_id: [] for it in items}
    for table in rescorer.score(items):
        for rid, lp in zip(table.column("request_id").to_pylist(), table.column("ref_logprob").to_pylist()):
            out[rid].append(lp)  # positions arrive in order within a request
    return out
