"""One `lpf shrink`: from a run and its flagged request to DIR with the minimal reproducer.

Contract:
- `prepare(run_dir, request_id) -> Plan`: reads the source run, picks the target (the given
  flagged request, or the worst one) and builds its signature from the run's own findings and
  tables, all before anything runs; every problem is an `LpfError` in one line. A run with nothing
  flagged whose requests failed with an exception is shrunk on that crash (`Plan.crash`: its type
  and innermost frame, `crash.py`; the search is `crash_search.CrashShrink`).
- `run(plan, out, tries, need, budget, on_event) -> dict`: opens (or resumes) the
  shrink state in `out` (then `on_event({"type": "begin", ...})`), runs the search (`search.Shrink`), writes the reproducer's files
  (`repro.write_outputs`) when there is a minimum, and returns the shrink.json document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lpf.core.errors import LpfError
from lpf.experiments.shrink.config import Source
from lpf.experiments.shrink.crash import Crash
from lpf.experiments.shrink.signature import Signature, mechanism_hypothesis, signature_of, target_feature


@dataclass
class Plan:
    source: Source
    target: dict  # the target's summary row
    signature: Signature
    note: str | None  # why the top mechanism is not part of the signature, when it is not
    crash: Crash | None = None  # the run crashed: the exception and its frame are the signature


def prepare(run_dir: Path, request_id: str | None) -> Plan:
    source = Source.open(run_dir)
    try:
        target = source.target(request_id)
    except LpfError:
        # nothing flagged (or the request named is not): a run whose requests failed with an
        # exception is shrunk on the crash instead
        found = source.crash(request_id)
        if found is None:
            raise
        crash, n_failed, rid = found
        target = next(r for r in source.summary if r["request_id"] == rid)
        note = (
            f"nothing was flagged: {n_failed}/{len(source.summary)} requests failed with this crash; a candidate "
            f"reproduces when any of its requests fails with the same exception from the same frame"
        )
        return Plan(source, target, Signature("error", "crash"), note, crash)
    hypothesis = mechanism_hypothesis(source.findings.get("hypotheses"))
    value = None
    if hypothesis is not None:
        from lpf.analysis.thresholds import Thresholds
        from lpf.experiments.shrink.judge import summary_for
        from lpf.run.store import RunDir

        run = RunDir(source.path, source.manifest)
        tokens = reference = None
        if hypothesis["feature"] in ("crossed_wires", "tempered_logprobs"):
            tokens, reference = run.read("tokens"), run.read("reference")
        value = target_feature(
            hypothesis["feature"],
            target["seq"],
            run.read("requests"),
            run.read("trace") if run.has("trace") else None,
            source.manifest.get("engine"),
            tokens,
            reference,
            source.manifest["sampling"].get("temperature") or 0.0,
            Thresholds().with_overrides(source.thresholds()),
            summary_for(source.path, hypothesis["feature"]),
        )
    signature, note = signature_of(target, hypothesis, value)
    return Plan(source, target, signature, note)


def run(
    plan: Plan, out: Path, tries: int, need: int, budget: int, on_event: Callable[[dict], None] = lambda e: None
) -> dict:
    from lpf.experiments.shrink.judge import BudgetSpent, Judge
    from lpf.experiments.shrink.repro import locate_offer, write_outputs
    from lpf.experiments.shrink.crash_search import CrashShrink
    from lpf.experiments.shrink.search import Shrink
    from lpf.experiments.shrink.state import State

    if budget < 1:
        raise LpfError(f"--budget-runs must be >= 1, got {budget}")
    if tries < 1 or not 1 <= need <= tries:
        raise LpfError(f"--tries must be >= 1 and --need between 1 and --tries, got --tries {tries} --need {need}")
    source, t = plan.source, plan.target
    original = source.original()
    m = source.manifest
    identity = {"source_run_id": m.get("run_id"), "target": t["request_id"], "tries": tries, "need": need}
    header = {
        "source_run": str(source.path.resolve()),
        "engine": {"name": m["engine"]["name"], "version": m["engine"].get("version")},
        "model": m["model"].get("spec"),
        "target_row": t,
        "signature": plan.signature.to_dict(),
        "signature_description": plan.crash.describe() if plan.crash else plan.signature.describe(),
        "crash": plan.crash.to_dict() if plan.crash else None,
        "signature_note": plan.note,
        "original": {
            "config": source.to_json(original),
            "size": list(source.size(original)),
            "description": source.describe_size(original),
        },
    }
    state = State.open(out, identity, header, budget)
    on_event(
        {
            "type": "begin",
            "out": str(out),
            "target": t["request_id"],
            "signature": header["signature_description"],
            "budget": budget,
            "tries": tries,
            "need": need,
            "resumed": bool(state.doc["candidates"]),
        }
    )

    def charge(name: str) -> None:
        if not state.charge(name, state.doc["budget_runs"]):
            raise BudgetSpent

    judge = Judge(
        out,
        source,
        plan.signature,
        t["seq"],
        tries,
        need,
        charge,
        deterministic=state.doc.get("deterministic"),
        crash=plan.crash,
    )
    state.set(status="running")
    from lpf.experiments.kept_cells import kept_cells

    search = CrashShrink if plan.crash else Shrink
    with kept_cells():  # the candidates fork one process that imported torch once
        doc = search(source, t["seq"], judge, state, on_event).run()
    if doc.get("minimal"):
        written = write_outputs(out, source, doc)
        # a crash has no first divergence for `lpf locate` to find the birth of
        state.set(files=[p.name for p in written], locate=None if plan.crash else locate_offer(out, doc))
    return state.doc
