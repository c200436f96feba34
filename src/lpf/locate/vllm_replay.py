"""Replay one request of a vLLM run offline with lpf-vllm-trace capturing its activations.

Contract: `replay(run, request_id, upto) -> builtin_replay.EngineSide`. The run's own workload (every
request, in arrival order: the same batches and budgets, as far as vLLM schedules deterministically;
a shrink minimum is a run of its own, so locating that run replays the minimum) is sent again through
`lpf.adapters.vllm.VLLMEngine` with the run's engine options plus `capture` (a spec from
`vllm_names.capture_spec`: the request's rows up to absolute position `upto`, op by op, named as
the reference names them). The plugin's capture (`capture-<pid>.json` + `.npz`) becomes an
`ops.Activations`; the request's own steps come from the replay's trace; `check` compares the
replayed request's output tokens and logprobs with the run's. `LpfError` when the plugin captured
nothing (with its reason: the trace off or refused, a vLLM version it does not know).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from lpf.core.errors import LpfError
from lpf.locate.builtin_replay import EngineSide
from lpf.locate.builtin_schedule import _run_requests
from lpf.locate.ops import Activations
from lpf.locate.vllm_names import capture_spec


def replay(run, request_id: str, upto: int) -> EngineSide:
    from lpf.adapters.vllm import VLLMEngine, VLLMOptions
    from lpf.core.model_specs import resolve_model

    t0 = time.monotonic()
    m = run.manifest
    requests, sampling = _run_requests(run)
    if request_id not in {r.request_id for r in requests}:
        raise LpfError(f"request {request_id!r} is not in {run.path}'s workload")
    options = dict(m["engine"].get("options") or {})
    if options.get("trace") is False:
        options["trace"] = True  # the capture travels with the trace plugin
    with tempfile.TemporaryDirectory(prefix="lpf-locate-") as tmp:
        spec_path = Path(tmp) / "capture.json"
        spec = capture_spec(request_id, upto, str(Path(tmp) / "out"), m["model"].get("architecture"))
        spec_path.write_text(json.dumps(spec))
        options.update(capture=str(spec_path), trace_dir=None)
        engine = VLLMEngine(resolve_model(m["model"]["spec"]), sampling, VLLMOptions.parse(options))
        got = None
        try:
            for c in engine.generate(requests):
                if c.request_id == request_id:
                    got = c
            tables = engine.side_tables()
            status = engine.trace_status or {}
        finally:
            engine.close()
        acts = _read_capture(Path(tmp) / "out", request_id, status)
    side = EngineSide(
        acts,
        description={
            "engine": "vllm",
            "schedule": "the run's workload sent again to vLLM offline (its own scheduler decides)",
        },
    )
    side.steps = _steps(tables.get("trace"), request_id)
    side.check = _check(run, request_id, got)
    prompt_len = next(len(r.prompt_token_ids) for r in requests if r.request_id == request_id)
    fed = side.check.get("first_other_token")
    if fed is not None and fed <= upto - prompt_len:
        raise LpfError(
            f"the replay of {request_id} sampled another token than the run at output position {fed}: "
            f"vLLM did not reproduce the run, so its activations are not the run's (rerun the audit and locate it)"
        )
    side.seconds = time.monotonic() - t0
    return side


def _read_capture(out: Path, request_id: str, status: dict) -> Activations:
    files = sorted(out.glob("capture-*.json"))
    why = (status.get("capture") or {}).get("why") or status.get("why")
    if not files:
        raise LpfError(
            f"lpf-vllm-trace captured nothing for {request_id}"
            + (f": {why}" if why else " (is the plugin installed in vLLM's Python? `make vllm`)")
        )
    acts = Activations("engine", "float32")
    for f in files:
        index = json.loads(f.read_text())
        entry = (index.get("requests") or {}).get(request_id)
        if not entry:
            continue
        arrays = np.load(f.with_suffix(".npz"))
        for op, pos, key in entry["entries"]:
            acts.put(op, pos, arrays[key])
        acts.order = list(entry["order"])
    if not acts.order:
        raise LpfError(f"lpf-vllm-trace captured no row of {request_id}" + (f": {why}" if why else ""))
    return acts


def _steps(trace, request_id: str) -> list[dict]:
    if trace is None:
        return []
    t = trace.filter(pc.equal(trace.column("request_id"), request_id)).to_pylist()
    out = []
    for r in sorted(t, key=lambda r: r["step"]):
        if r.get("preempted"):
            continue
        first = r["num_computed_tokens"]
        out.append(
            {
                "step": r["step"],
                "phase": r["phase"],
                "first_position": first,
                "last_position": first + r["num_scheduled_tokens"] - 1,
                "num_tokens": r["num_scheduled_tokens"],
                "batch_size": r["batch_size"],
                "state_slot": r["state_slot"],
            }
        )
    return out


def _check(run, request_id: str, got) -> dict:
    if got is None or got.error:
        return {"positions": 0, "max_abs_logprob_diff": None, "error": None if got is None else got.error}
    t = run.read("tokens", ["request_id", "position", "token_id", "engine_logprob"])
    rows = sorted(t.filter(pc.equal(t.column("request_id"), request_id)).to_pylist(), key=lambda r: r["position"])
    diffs, other = [], None
    for r in rows:
        p = r["position"]
        if p >= len(got.output_token_ids):
            break
        if other is None and got.output_token_ids[p] != r["token_id"]:
            other = p
        if other is None and got.logprobs[p] is not None and r["engine_logprob"] is not None:
            diffs.append(abs(got.logprobs[p] - r["engine_logprob"]))
    return {"positions": len(diffs), "max_abs_logprob_diff": max(diffs) if diffs else None, "first_other_token": other}
