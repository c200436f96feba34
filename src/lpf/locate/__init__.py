"""`lpf locate`: from a lying request to the first op of the forward pass that departs, and who is wrong.

Contract: `locate(run_path, request_id=None, position=None, out=None, trials=True, on_stage=None)
-> (document, out_dir)` writes `out_dir/locate.json` (default `RUN/locate/<request id>-o<position>`;
shape in docs/locate.md) and returns it as a dict. The target is `request_id` at output position
`position` (default: the worst flagged request of the run's findings and its first divergence; a
request's own first divergence when only the request is given). Its exact tokens up to the row that
predicts that output token are
- replayed through the engine under test with per-op capture: the built-in engine with the run's own
  schedule (`builtin_replay`), vLLM offline through lpf-vllm-trace on the run's workload
  (`vllm_replay`), the hf engine on its decode path alone; an HTTP engine is refused (`LpfError`,
  one line saying what would be needed);
- run through the reference teacher-forced with the same capture, and the reference on trial
  (`reference_side`: float64 gold, its decode path, its attention implementations);
- aligned op by op (`finding.judge`): the first op and position departing beyond its floor, a Mamba
  layer's input state, the verdict (engine, reference, both, nobody) with numbers.
`on_stage(text)` is told each stage as it starts. Modules: ops (names), engine_capture, hf_capture,
depends, replays (the engine side of each engine whose adapter names one in `locate_replay`; an engine
whose adapter says `server` is refused with what it would need), builtin_replay, vllm_replay +
vllm_names, reference_side, align, finding, target.
"""

from __future__ import annotations

import time
from pathlib import Path

from lpf.core.errors import LpfError

SCHEMA = 1


def locate(
    run_path, request_id: str | None = None, position: int | None = None, out=None, trials: bool = True, on_stage=None
) -> tuple[dict, Path]:
    from lpf.adapters import capability, engines_with
    from lpf.locate.target import choose_target
    from lpf.run.store import RunDir

    stage = on_stage or (lambda _s: None)
    t0 = time.monotonic()
    run = RunDir.open(run_path)
    engine_name = (run.manifest.get("engine") or {}).get("name")
    if capability(engine_name or "?", "server", False):
        raise LpfError(
            f"lpf locate needs the engine's activations op by op, and a {engine_name} server answers "
            f"over HTTP with tokens and logprobs only: it would need a capture hook inside its forward "
            f"pass (as lpf-vllm-trace has for vLLM); rerun the workload with --engine vllm or builtin "
            f"and locate that run"
        )
    if not capability(engine_name or "?", "locate_replay"):
        known = ", ".join(engines_with("locate_replay"))
        raise LpfError(f"lpf locate knows the {known} engines; this run's engine is {engine_name!r}")
    target = choose_target(run, request_id, position)
    ids, prompt_len = target["ids"], target["prompt_len"]
    # every row the engine computed for the request is captured (the last output token was sampled, never
    # fed); `target["row"]` is the one the analysis flagged
    upto = len(ids) - 2
    stage(f"engine: replaying {target['request_id']} ({engine_name})")
    engine = _engine_side(run, engine_name, target, upto)
    state_after = sorted(
        {s["first_position"] - 1 for s in engine.steps}
        | {s["last_position"] for s in engine.steps}
        | _step_positions(engine.acts)
    )
    from lpf.locate.reference_side import reference_side

    ref_path = Path((run.manifest.get("reference") or run.manifest["model"])["path"])
    if not ref_path.is_dir():
        from lpf.core.model_specs import resolve_model

        ref_path = resolve_model((run.manifest.get("reference") or run.manifest["model"])["spec"]).path
    # the reference runs over the whole request: the engine is compared up to its row, the reference's
    # own paths over every position (its decode path is only on trial where there are decode steps)
    ref = reference_side(
        ref_path, ids, prompt_len, [p for p in state_after if 0 <= p <= upto], trials=trials, on_stage=stage
    )
    from lpf.locate import align
    from lpf.locate.finding import judge

    stage("aligning op by op")
    for acts in (engine.acts, ref.tf, ref.gold, ref.decode, ref.eager):
        if acts is not None:
            align.add_scores(acts, ref.geometry)
    dtype = (run.manifest["engine"].get("options") or {}).get("dtype", "float32")
    dtype = "float32" if dtype in (None, "auto") else dtype
    judged = judge(engine.acts, ref, prompt_len, dtype, engine.steps or None, engine.slot_stride)
    doc = _document(run, target, engine, ref, judged, dtype, time.monotonic() - t0)
    if doc["replay"]["reproduces"] is False:  # said first: the activations compared are not the run's
        chk = engine.check
        doc["sentence"] = (
            f"The replay does not reproduce the run (its logprobs differ from the run's by up to "
            f"{chk['max_abs_logprob_diff']:.3g}), so what follows is not the run's computation: " + doc["sentence"]
        )
    out_dir = (
        Path(out)
        if out is not None
        else run.path / "locate" / f"{_safe(target['request_id'])}-o{target['output_position']}"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "locate.json", doc)
    return doc, out_dir


def _step_positions(acts) -> set[int]:
    """Positions the engine captured states at: a state_in at p needs the reference's state after
    p - 1, a state_out at p its state after p (engines without a step list, e.g. vLLM)."""
    out = set()
    for op in acts.order:
        if op.endswith("state_in"):
            out |= {p - 1 for p in acts.positions(op)}
        elif op.endswith("state_out"):
            out |= set(acts.positions(op))
    return out


def _engine_side(run, engine_name: str, target: dict, upto: int):
    """The request replayed through its engine, by the function the adapter names (`locate_replay`)."""
    import importlib

    from lpf.adapters import capability

    module, function = capability(engine_name, "locate_replay").split(":")
    return getattr(importlib.import_module(module), function)(run, target, upto)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:120]


def _write_json(path: Path, obj) -> None:
    import json
    import os

    from lpf.report.html import jsonable

    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(jsonable(obj), indent=2) + "\n")
    os.replace(tmp, path)


def _document(run, target, engine, ref, judged, dtype, seconds) -> dict:
    m = run.manifest
    return {
        "kind": "locate",
        "schema": SCHEMA,
        "run": str(run.path),
        "request_id": target["request_id"],
        "target": {
            k: target[k] for k in ("output_position", "row", "prompt_len", "why", "verdict", "max_abs_logprob_diff")
        },
        "engine": {
            "name": m["engine"].get("name"),
            "version": m["engine"].get("version"),
            "dtype": dtype,
            "model": m["model"].get("spec"),
            **engine.description,
        },
        "reference": {"spec": (m.get("reference") or m["model"]).get("spec"), **ref.description},
        "replay": {
            "steps_replayed": engine.steps_replayed,
            "steps_scheduled": engine.steps_scheduled,
            "check": engine.check,
            "reproduces": _reproduces(engine.check),
            "steps": engine.steps,
            "slot_stride": engine.slot_stride,
        },
        "located": judged["located"],
        "mamba": judged["mamba"],
        "input": judged["input"],
        "verdict": judged["verdict"],
        "sentence": judged["sentence"],
        "details": judged["details"],
        "trials": judged["trials"],
        "modules": judged["modules"],
        "grid": judged["grid"],
        "mismatched": judged["mismatched"],
        "seconds": {"total": seconds, "engine": engine.seconds, "reference": ref.seconds},
    }


def _reproduces(check: dict) -> bool | None:
    if not check or check.get("max_abs_logprob_diff") is None:
        return None
    return check["max_abs_logprob_diff"] <= 1e-5
