"""Replay one request of a built-in engine run with its original schedule, capturing its activations.

Contract: `replay(run, request_id, upto) -> EngineSide`. The run's schedule is replayed
(`builtin_schedule.replay_schedule`: the run's own adapter, knobs and drills, its recorded tokens fed
back as the samples, checked against its trace step by step) up to the step that computes absolute
position `upto` of the request. Of those steps only the ones the request's numbers depend on are
computed (`depends.Dependencies.closure`: its own steps and the steps whose state or KV writes it
read, transitively; with prefix caching on every step, as it is scheduled: states restored from
checkpoints are not followed), each with its whole original batch, with an `EngineCapture` on the
request's rows. The request's own numbers are the run's to the bit on a dense model; with MoE layers a
pruned step's other requests (not recomputed from their own history) route their tokens differently,
so an expert's matmul may round the request's rows differently (measured: <= 4e-6 in a logprob). The request's logprobs at its output positions are recomputed from the
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


def replay(run: RunDir, request_id: str, upto: int, on_step=None) -> EngineSide:
    import torch

    from lpf.builtin.faults import FaultSet
    from lpf.locate.builtin_schedule import prompt_len, replay_schedule

    t0 = time.monotonic()
    m = run.manifest
    options = m["engine"]["options"]
    dtype = options.get("dtype", "float32")
    # prefix caching restores states from checkpoints the dependency analysis does not follow: every step
    # is computed, in the scheduling pass itself (the cache's checkpoints follow what the runner writes)
    every = bool(options.get("enable_prefix_caching"))
    live: dict = {}

    def compute(so, real, adapter):
        if "cap" not in live:  # the first step: the capture goes on the adapter's model
            live.update(cap=EngineCapture(adapter.engine.model, request_id, dtype), logits={})
            live["hooks"] = live["cap"].install()
        return _execute(adapter.engine, so, real, live["cap"], live["logits"])

    try:
        adapter, schedule = replay_schedule(run, request_id, upto, compute=compute if every else None)
    finally:
        if "hooks" in live:
            live["hooks"].remove()
    before = torch.get_num_threads()
    threads = int(options.get("threads", 1) or 0)
    if threads > 0:
        torch.set_num_threads(threads)  # matmul splits follow the thread count: the run's own
    try:
        side = _compute(adapter.engine, schedule, request_id, dtype, on_step, every, live)
    finally:
        torch.set_num_threads(before)
    side.check = _check(run, request_id, side, prompt_len(run, request_id))
    side.seconds = time.monotonic() - t0
    side.description = {
        "engine": "builtin",
        "drills": FaultSet.parse(options.get("inject") or "").names(),
        "schedule": "the run's own, replayed through its adapter and checked against its trace "
        "step by step" + ("; every step computed (prefix caching)" if every else ""),
    }
    return side


def _nodes(engine, so) -> list[Node]:
    drills, sc = engine.runner.drills, engine.runner.state_cache
    has_state = bool(engine.model.mamba_mixers())
    out = []
    for s in so.scheduled:
        phase = drills.phase(s)
        decode = phase == "decode"
        path = "decode" if decode else "prefill"
        # a chunk reads its slot when it continues from it, or (stale-conv-on-reuse) takes its conv from it
        conv_reads = getattr(drills, "conv_reads_slot", lambda _phase: False)(phase)
        reads = decode or drills.has_initial_state(s, phase) or conv_reads
        zero = s.state_slot * sc.slot_stride if drills.zero_new_slot(s) else None
        out.append(
            Node(
                so.step,
                s.request_id,
                decode,
                zero if has_state else None,
                sc.base(s.state_slot, path) if has_state and reads else None,
                sc.base(s.state_slot, path) if has_state else None,
                s.num_computed_tokens,
                s.num_computed_tokens + s.num_scheduled_tokens,
                tuple(s.block_table),
            )
        )
    return out


def _execute(engine, so, real, cap, logits):
    """One step computed with the capture on (the request's logits projected as the runner does)."""
    cap.hidden = cap.step_hidden = None
    result = real(so, capture=cap)
    if cap.hidden is not None:
        _project(engine, so, cap, logits)
    return result


def _compute(engine, schedule, request_id, dtype, on_step, every: bool, live: dict) -> EngineSide:
    nodes = [_nodes(engine, so) for so in schedule]
    deps = Dependencies(nodes, engine.runner.state_cache.slot_stride or 1, engine.config.block_size)
    if every:  # computed while scheduling
        cap, logits, steps = live["cap"], live["logits"], sorted({so.step for so in schedule})
    else:
        cap, logits = EngineCapture(engine.model, request_id, dtype), {}
        steps = sorted(
            {k[0] for k in deps.closure([n.key for step in nodes for n in step if n.request_id == request_id])}
        )
        hooks = cap.install()
        try:
            for i, so in enumerate(schedule):
                if so.step in steps:
                    _execute(engine, so, engine.runner.execute, cap, logits)
                if on_step:
                    on_step(i + 1, len(schedule))
        finally:
            hooks.remove()
    side = EngineSide(
        cap.acts,
        steps_replayed=len(steps),
        steps_scheduled=len(schedule),
        slot_stride=engine.runner.state_cache.slot_stride,
        logits=logits,
    )
    for so, step_nodes in zip(schedule, nodes):
        for n in step_nodes:
            if n.request_id == request_id:
                side.steps.append(_step_info(so, n, deps, engine.runner.drills, every))
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
    info = {
        "step": so.step,
        "phase": drills.phase(s),
        "first_position": n.kv_start,
        "last_position": n.kv_end - 1,
        "num_tokens": n.kv_end - n.kv_start,
        "batch_size": len(so.scheduled),
        "state_slot": s.state_slot,
    }
    if prefix_caching:  # a state may come from a checkpoint slot: where it was read is not modelled here
        return info
    writers = deps.state_writers(n)
    return {
        **info,
        "slot_zeroed": n.zeroes_slot is not None,
        "state_read_offset": n.state_read,
        "state_write_offset": n.state_write,
        "state_last_written_by": [None if w is None else {"step": w[0], "request_id": w[1]} for w in writers],
    }


def _check(run: RunDir, request_id: str, side: EngineSide, prompt_len: int) -> dict:
    """The replayed logprobs of the output tokens (the sampler's own float32 arithmetic) against the
    recorded ones."""
    import torch

    from lpf.core.torch_utils import logprob_rows

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
