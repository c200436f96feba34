"""The built-in engine's schedule of a run, replayed without computing it (or computing every step).

Contract: `replay_schedule(run, request_id, upto, compute=None) -> (adapter, schedule)`. The run's own
adapter (`lpf.adapters.builtin.BuiltinEngine`, the manifest's knobs and drills) is rebuilt and its
`generate` driven over the run's requests, so every client-side decision is the run's too (arrival
order, a cancel-and-resend client's aborts and resends). Its runner's `execute` is replaced: each
step's SchedulerOutput (as the runner saw it, after in-flight cancels) is kept, and the step answers
with the run's recorded tokens as its samples (an attempt `ID~attemptN` samples as `ID` did), so
the scheduler makes the same decisions it made in the run. With `compute` (a callable taking the
SchedulerOutput, the runner's real `execute` and the adapter, returning its StepResult) every step is also
computed (prefix caching: the cache's checkpoints follow what the runner writes), the recorded tokens
still replacing its samples. It stops at the step after the one that computes position `upto` of
`request_id`. The engine's own trace of the replay is checked against the run's trace step by step:
`LpfError` at the first step that differs (a resumed run, an engine changed since).
"""

from __future__ import annotations

from dataclasses import replace

import pyarrow.compute as pc

from lpf.core.errors import LpfError


class _Done(Exception):
    """The request's last row of interest was computed: the replay stops."""


def _run_requests(run):
    from lpf.core.sampling import SamplingParams
    from lpf.core.workload import expand, read_normalized

    m = run.manifest
    sampling = SamplingParams.from_dict(m["sampling"])
    return expand(read_normalized(run.path / "workload.jsonl"), m["workload"]["n"], sampling), sampling


def _rows_by_step(table) -> dict[int, set]:
    if table is None:
        return {}
    cols = ["step", "request_id", "phase", "num_computed_tokens", "num_scheduled_tokens", "state_slot", "preempted"]
    out: dict[int, set] = {}
    for r in table.select(cols).to_pylist():
        out.setdefault(r["step"], set()).add(tuple(r[c] for c in cols[1:]))
    return out


def replay_schedule(run, request_id: str, upto: int, compute=None):
    from lpf.adapters.builtin import BuiltinEngine, BuiltinOptions
    from lpf.builtin.sched_output import PromptRows, Sample, StepResult
    from lpf.core.model_specs import resolve_model

    m = run.manifest
    requests, sampling = _run_requests(run)
    recorded = {
        r["request_id"]: r["output_token_ids"] or []
        for r in run.read("requests", ["request_id", "output_token_ids"]).to_pylist()
    }
    if request_id not in recorded:
        raise LpfError(f"request {request_id!r} is not in {run.path}")
    adapter = BuiltinEngine(resolve_model(m["model"]["spec"]), sampling, BuiltinOptions.parse(m["engine"]["options"]))
    runner, drills = adapter.engine.runner, adapter.engine.runner.drills
    real, schedule, state = runner.execute, [], {"done": False}

    def samples(so) -> dict:
        out = {}
        for s in so.scheduled:
            toks = recorded.get(s.request_id.split("~attempt")[0]) or []
            if s.will_sample and s.output_position < len(toks):
                out[s.request_id] = Sample(toks[s.output_position], 0.0, [], [])
        return out

    def execute(so, capture=None):
        if state["done"]:
            raise _Done
        schedule.append(so)
        state["done"] = any(
            s.request_id == request_id and s.num_computed_tokens + s.num_scheduled_tokens > upto for s in so.scheduled
        )
        if compute is not None:
            return replace(compute(so, real, adapter), samples=samples(so))
        rows = {
            s.request_id: PromptRows(
                s.num_computed_tokens + 1,
                [0.0] * len(s.prompt_targets),
                [1] * len(s.prompt_targets),
                [[]] * len(s.prompt_targets),
                [[]] * len(s.prompt_targets),
            )
            for s in so.scheduled
            if s.prompt_targets
        }
        return StepResult({s.request_id: drills.phase(s) for s in so.scheduled}, samples(so), rows)

    runner.execute = execute
    try:
        for _ in adapter.generate(requests):
            pass
    except _Done:
        pass
    finally:
        runner.execute = real
    if not state["done"]:
        raise LpfError(f"request {request_id}: the replayed schedule never computes position {upto}")
    _check_trace(run, adapter.engine.drain_trace(), schedule)
    return adapter, schedule


def _check_trace(run, replayed, schedule) -> None:
    if not run.has("trace"):
        return
    want = _rows_by_step(run.read("trace"))
    got = _rows_by_step(replayed)
    for so in schedule:
        w, g = want.get(so.step, set()), got.get(so.step, set())
        if w != g:
            diff = sorted(w ^ g, key=str)[:2]
            raise LpfError(
                f"the built-in engine does not replay this run's schedule at step {so.step} (the trace has "
                f"{len(w)} rows there, the replay {len(g)}; differing: {diff}): a resumed run, or the engine "
                f"changed since; locate needs one uninterrupted session"
            )


def prompt_len(run, request_id: str) -> int:
    rows = run.read("requests", ["request_id", "prompt_token_ids"])
    rows = rows.filter(pc.equal(rows.column("request_id"), request_id)).to_pylist()
    return len(rows[0]["prompt_token_ids"])
