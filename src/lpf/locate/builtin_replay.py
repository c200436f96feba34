"""Replay one request of a built-in engine run with its original schedule, capturing its activations.

Contract: `replay(run, request_id, upto) -> EngineSide`. The run's own engine configuration (knobs
and drills, from the manifest) is rebuilt and the run's requests are added in arrival order, as the
adapter added them; the scheduler then runs step by step with the run's recorded output tokens fed
back as its samples, so it makes the same decisions (batches, budgets, state slots, KV blocks,
preemptions) the run made, which is checked against the run's trace step by step (`LpfError` at the
first step that differs: a resumed run, or one whose engine changed since). Of those steps, only the
ones the request's numbers depend on are computed (every one with prefix caching on: states restored
from checkpoints are not followed) (`depends.Dependencies.closure`: its own steps and
the steps whose state or KV writes it read, transitively), each with its whole original batch, with
an `EngineCapture` on the request's rows up to absolute position `upto` (the row that predicts the
located output token). The request's logprobs at its output positions are recomputed from the
engine's own LM head (the drills' too) and compared with what the run recorded (`check`), so a
replay that does not reproduce the run says so.

`EngineSide`: `acts` (ops.Activations), `steps` (the request's own steps: step, phase, slot, tokens,
where its state was read and by whom it was last written), counts of steps replayed and scheduled,
`check` (max |replayed - recorded| logprob over the output positions replayed), and `slot_stride`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pyarrow.compute as pc

from lpf.errors import LpfError
from lpf.locate.depends import Dependencies, Node
from lpf.locate.engine_capture import EngineCapture
from lpf.run.store import RunDir


@dataclass
class EngineSide:
    acts: object
    steps: list[dict] = field(default_factory=list)
    steps_replayed: int = 0
    steps_scheduled: int = 0
    check: dict = field(default_factory=dict)
    slot_stride: int | None = None
    seconds: float = 0.0
    description: dict = field(default_factory=dict)
    logits: dict = field(default_factory=dict)  # position -> the engine's float32 logits row (sampled rows)


def _run_requests(run: RunDir):
    from lpf.sampling import SamplingParams
    from lpf.workload import expand, read_normalized

    m = run.manifest
    sampling = SamplingParams.from_dict(m["sampling"])
    return expand(read_normalized(run.path / "workload.jsonl"), m["workload"]["n"], sampling), sampling


def _trace_by_step(run: RunDir) -> dict[int, dict[str, tuple]]:
    if not run.has("trace"):
        return {}
    t = run.read("trace", ["step", "request_id", "phase", "num_computed_tokens", "num_scheduled_tokens",
                           "state_slot", "preempted"])
    t = t.filter(pc.invert(pc.fill_null(t.column("preempted"), False)))
    out: dict[int, dict[str, tuple]] = {}
    for r in t.to_pylist():
        out.setdefault(r["step"], {})[r["request_id"]] = (r["phase"], r["num_computed_tokens"],
                                                          r["num_scheduled_tokens"], r["state_slot"])
    return out


def replay(run: RunDir, request_id: str, upto: int, on_step=None) -> EngineSide:
    import torch

    from lpf.adapters.builtin import BuiltinOptions
    from lpf.builtin.config import EngineConfig
    from lpf.builtin.faults import FaultSet
    from lpf.builtin.llm_engine import LLMEngine
    from lpf.builtin.request import Request
    from lpf.builtin.sched_output import Sample
    from lpf.model_specs import load_tokenizer, resolve_model

    t0 = time.monotonic()
    m = run.manifest
    options = BuiltinOptions.parse(m["engine"]["options"])
    model = resolve_model(m["model"]["spec"])
    requests, sampling = _run_requests(run)
    recorded = {r["request_id"]: r["output_token_ids"] or []
                for r in run.read("requests", ["request_id", "output_token_ids"]).to_pylist()}
    if request_id not in recorded:
        raise LpfError(f"request {request_id!r} is not in {run.path}")
    before = torch.get_num_threads()
    if options.threads > 0:
        torch.set_num_threads(options.threads)  # matmul splits follow the thread count: the run's own
    try:
        engine = LLMEngine(model.path, EngineConfig.of(options), FaultSet.parse(options.inject))
        eos = load_tokenizer(model).eos_token_id
        for r in requests:
            engine.add_request(Request(r.request_id, list(r.prompt_token_ids), sampling, r.max_tokens, r.seed, eos,
                                       seq=r.seq))
        schedule = _schedule(engine, run, request_id, upto, recorded, Sample)
        # prefix caching restores states from checkpoints the dependency analysis does not follow: every step
        every = bool(getattr(options, "enable_prefix_caching", False))
        side = _compute(engine, schedule, request_id, upto, m["engine"]["options"].get("dtype", "float32"), on_step,
                        every)
    finally:
        torch.set_num_threads(before)
    prompt_len = next(len(r.prompt_token_ids) for r in requests if r.request_id == request_id)
    side.check = _check(run, request_id, side, prompt_len)
    side.seconds = time.monotonic() - t0
    side.description = {"engine": "builtin", "drills": FaultSet.parse(options.inject).names(),
                        "schedule": "the run's trace, checked step by step"}
    return side


def _schedule(engine, run, request_id, upto, recorded, Sample) -> list:
    """Every SchedulerOutput up to the step that computes position `upto` of the request."""
    trace = _trace_by_step(run)
    sched, out = engine.scheduler, []
    while sched.has_unfinished():
        so = sched.schedule()
        want = trace.get(so.step, {} if trace else None)
        if want is not None and (want or so.scheduled):
            got = {s.request_id: (engine.runner.drills.phase(s), s.num_computed_tokens, s.num_scheduled_tokens,
                                  s.state_slot) for s in so.scheduled}
            if got != want:
                raise LpfError(f"the built-in engine does not replay this run's schedule at step {so.step} "
                               f"(the trace has {len(want)} requests there, the replay {len(got)}{_first_diff(want, got)}): "
                               f"a resumed run, or the engine changed since; locate needs one uninterrupted session")
        out.append(so)
        samples = {}
        for s in so.scheduled:
            if s.will_sample:
                toks = recorded.get(s.request_id) or []
                if s.output_position < len(toks):
                    samples[s.request_id] = Sample(toks[s.output_position], 0.0, [], [])
        sched.update(so, samples, {})
        done = any(s.request_id == request_id and s.num_computed_tokens + s.num_scheduled_tokens > upto
                   for s in so.scheduled)
        if done:
            return out
    raise LpfError(f"request {request_id}: the replayed schedule never computes position {upto}")


def _first_diff(want: dict, got: dict) -> str:
    for rid in sorted(set(want) | set(got)):
        if want.get(rid) != got.get(rid):
            return f"; {rid}: trace {want.get(rid)}, replay {got.get(rid)}"
    return ""


def _nodes(engine, so) -> list[Node]:
    drills, sc = engine.runner.drills, engine.runner.state_cache
    has_state = bool(engine.model.mamba_mixers())
    out = []
    for s in so.scheduled:
        phase = drills.phase(s)
        decode = phase == "decode"
        path = "decode" if decode else "prefill"
        reads = decode or drills.has_initial_state(s, phase)
        zero = s.state_slot * sc.slot_stride if drills.zero_new_slot(s) else None
        out.append(Node(so.step, s.request_id, decode, zero if has_state else None,
                        sc.base(s.state_slot, path) if has_state and reads else None,
                        sc.base(s.state_slot, path) if has_state else None,
                        s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens, tuple(s.block_table)))
    return out


def _compute(engine, schedule, request_id, upto, dtype, on_step, every: bool = False) -> EngineSide:
    nodes = [_nodes(engine, so) for so in schedule]
    deps = Dependencies(nodes, engine.runner.state_cache.slot_stride or 1, engine.config.block_size)
    own = [n.key for step in nodes for n in step if n.request_id == request_id]
    needed = deps.closure(own)
    steps = sorted({so.step for so in schedule} if every else {k[0] for k in needed})
    cap = EngineCapture(engine.model, request_id, dtype)
    side = EngineSide(cap.acts, steps_replayed=len(steps), steps_scheduled=len(schedule),
                      slot_stride=engine.runner.state_cache.slot_stride)
    hooks = cap.install()
    logits = {}
    try:
        for i, (so, step_nodes) in enumerate(zip(schedule, nodes)):
            if so.step not in steps:
                continue
            cap.hidden = cap.step_hidden = None
            engine.runner.execute(so, capture=cap)
            if cap.hidden is not None:
                _project(engine, so, cap, logits)
            for n in step_nodes:
                if n.request_id == request_id:
                    side.steps.append(_step_info(so, n, deps, engine.runner.drills, every))
            if on_step:
                on_step(i + 1, len(schedule))
    finally:
        hooks.remove()
    side.logits = logits
    return side


def _project(engine, so, cap, logits: dict) -> None:
    """The request's logits this step. Its sampled row goes through the LM head in the same matmul as
    the runner's (every sampling row of the step, in batch order: a matmul's rounding follows its
    shape), so its logprob is the run's to the bit; its other rows alone (they are compared with the
    reference, not with the run)."""
    import torch

    positions, rows = cap.hidden
    seqs, hidden = cap.step_hidden
    drills = engine.runner.drills
    sampling = [(m, s) for m, s in zip(seqs, so.scheduled) if s.will_sample]
    with torch.inference_mode():
        lg = drills.logits(engine.model, rows, batch_size=len(so.scheduled))
        for p, row in zip(positions, lg):
            cap.acts.put("logits", p, row.detach().to(torch.float64).cpu().numpy())
        at = next((i for i, (m, _) in enumerate(sampling) if m.request_id == cap.request_id), None)
        if at is not None:
            idx = torch.tensor([m.end - 1 for m, _ in sampling], device=hidden.device)
            batch = drills.logits(engine.model, hidden[idx], batch_size=len(so.scheduled))
            logits[sampling[at][0].num_computed + sampling[at][0].num_tokens - 1] = batch[at].detach().float().cpu()


def _step_info(so, n: Node, deps: Dependencies, drills, prefix_caching: bool = False) -> dict:
    s = next(x for x in so.scheduled if x.request_id == n.request_id)
    if prefix_caching:  # a state may come from a checkpoint slot: where it was read is not modelled here
        return {"step": so.step, "phase": drills.phase(s), "first_position": n.kv_start, "last_position": n.kv_end - 1,
                "num_tokens": n.kv_end - n.kv_start, "batch_size": len(so.scheduled), "state_slot": s.state_slot}
    writers = deps.state_writers(n)
    return {"step": so.step, "phase": drills.phase(s),
            "first_position": n.kv_start, "last_position": n.kv_end - 1, "num_tokens": n.kv_end - n.kv_start,
            "batch_size": len(so.scheduled), "state_slot": s.state_slot, "slot_zeroed": n.zeroes_slot is not None,
            "state_read_offset": n.state_read, "state_write_offset": n.state_write,
            "state_last_written_by": [None if w is None else {"step": w[0], "request_id": w[1]} for w in writers]}


def _check(run: RunDir, request_id: str, side: EngineSide, prompt_len: int) -> dict:
    """The replayed logprobs of the output tokens (the sampler's own float32 arithmetic) against the
    recorded ones."""
    import torch

    from lpf.torch_utils import logprob_rows

    t = run.read("tokens", ["request_id", "position", "token_id", "engine_logprob"])
    t = t.filter(pc.equal(t.column("request_id"), request_id)).to_pylist()
    diffs = []
    for r in t:
        row = side.logits.get(prompt_len + r["position"] - 1)
        if row is None or r["engine_logprob"] is None:
            continue
        lp = float(logprob_rows(row[None], torch.tensor([r["token_id"]]), 1)[0][0])
        diffs.append(abs(lp - r["engine_logprob"]))
    return {"positions": len(diffs), "max_abs_logprob_diff": max(diffs) if diffs else None}
