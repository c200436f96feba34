"""Running a conformance matrix: architecture x knob cell, each an audited run, each non-clean one attributed.

Contract: `run_matrix(out, head, plans, attribution, settings, on_start, tick) -> dict` runs every
`CellPlan` not yet complete into its run directory `out/cells/<arch>/<cell>` (create, generate with
prompt logprobs, rescore, calibrate when the cell's dtype is not the reference's, analyze, report),
and for every cell whose verdict is not clean runs the second engine (`attribution[(arch, dtype)]`,
HF `generate` at the cell's dtype: one run per architecture and dtype, shared by the cells) and
`lpf.views.diff` between the two: the cell's `attribution` says engine bug / second engine / reference
/ both; and `lpf locate` on the cell's worst request (`locate`: the first op that departs, its
sentence, a link to its page; vLLM's replay reuses the kept worker). It writes `out/conformance.json`
after every cell (atomically), so a rerun of the same
command skips complete cells and a crash loses at most the cell in flight. A cell the engine refuses
or cannot start is recorded with its one-line reason (status `not applicable`, `refused`, `engine
error`, or `not supported` when the engine's own message says this build lacks what the architecture
needs: `ENGINE_LIMITS`), never dropped.

Cells run in this process, a fresh engine per cell (vLLM: a new vllm.LLM in one kept worker process,
`adapters.vllm.kept_workers`), instead of one `lpf audit` process per cell as `lpf sweep` does: vLLM's
import and lpf's own start are paid once, which is what keeps the full matrix under 30 minutes
(docs/benchmarks.md has the measured cost per cell both ways).
The cell directories are ordinary run directories (`cells.cell_complete` decides completeness).

A cell at another dtype than the reference's is judged against the bfloat16 (float16) expectation: the
reference itself at that dtype, teacher-forced over the cell's tokens (outputs and prompts), is what an
honest implementation at that dtype deviates by. The analysis' thresholds are capped (divergent at
2.0), and on a random tiny model an honest bfloat16 forward exceeds the cap, so the row's `conformance`
compares distributions instead: the cell's p99 and max |d| (output and prompt positions) against
`EXPECT_FACTOR` x that expectation's own p99 and max on the same positions. Within that envelope the cell conforms
(`conformance` clean, with `expectation` saying so and by how much); beyond it, the analysis verdict
stands. That envelope is kept in the row (`expectation`) but no longer decides: the per-position
paired test against an ensemble of honest bf16 runs does (`judging.bf16_per_position`, the row's
`bf16_paired`: departs -> the analysis verdict, within -> clean). A float32 cell's `conformance` is its
verdict, except on llama.cpp, judged per token with its traced departures named
(`judging.judge_llamacpp`, the row's `engine_judgement`: clean when only those explain the verdict).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from lpf.experiments.conformance.grid import GridCell
from lpf.core.errors import LpfError
from lpf.experiments.cells import cell_complete, read_out_doc
from lpf.experiments.conformance.variants import variant_skip

EXPECT_FACTOR = 2.0
# An engine error whose message says the build cannot do this (a kernel only other platforms have, a
# dtype the CPU kernel insists on, Triton missing): the cell is `not supported`, not a bug found
ENGINE_LIMITS = (
    ("supported only for", "this build has no kernel for it"),
    ("requires BF16", "this build's kernel runs in bfloat16 only"),
    ("module 'triton' has no attribute", "it needs Triton, which this build lacks"),
)
SUSPECT_WORDS = {
    "A": "engine bug",
    "B": "second engine (HF generate) departs",
    "reference": "reference bug",
    "both": "both engines depart",
    "none": "no departure at this level",
}


class ReferenceCannotRun(LpfError):
    """A cell's calibration run failed: the reference does not run at the cell's dtype on this machine."""


@dataclass
class CellPlan:
    arch: dict  # the discovery entry
    cell: GridCell
    spec: object | None  # the cell's AuditSpec (lpf.pipeline.spec); None when the cell cannot run on this engine
    refused: str | None = None  # why not (an engine without the knob)


@dataclass
class Settings:
    attribution_level: str = "noise"  # a cell departs when its verdict is at least this
    locate: bool = True  # every cell that does not conform gets a locate line (lpf locate on its worst request)


def cell_dir(out: Path, arch: str, cell: str) -> Path:
    return Path(out) / "cells" / arch.removesuffix("ForCausalLM") / cell


def _audit(spec, dtype: str) -> dict:
    """An AuditSpec's cell: create (or reopen) -> generate -> rescore -> calibrate (other dtype) ->
    analyze -> report; its findings."""
    from lpf import pipeline

    out = Path(spec.run.out)
    if cell_complete(out):
        return json.loads((out / "findings.json").read_text())
    run = pipeline.open_audit(spec)
    if run.manifest.get("status") != "complete":
        pipeline.execute_run(run)
    why = pipeline.all_failed(run)
    if why:  # nothing to score (a bf16 cell's calibration would only say "no reference scores yet")
        raise LpfError(why)
    pipeline.rescore_run(run, settings=spec.rescore)
    if dtype != spec.rescore.dtype:
        try:
            pipeline.calibrate_run(run, spec.rescore.token_budget)
        except LpfError as e:  # the reference has no kernel for that dtype here: not the engine's fault
            raise ReferenceCannotRun(str(e)) from None
    findings = pipeline.analyze_run(run, spec.threshold_values(), spec.analysis.attribution)
    try:
        from lpf.report import write_report

        write_report(out)
    except Exception as e:  # noqa: BLE001 - a page that cannot be drawn never costs the findings
        findings["report_error"] = f"{type(e).__name__}: {e}"
    return findings


def expectation(cell: Path, findings: dict) -> dict | None:
    """The cell's |d| envelope against the reference itself at the cell's dtype (see the module doc):
    the reference model teacher-forced again at that dtype over the cell's tokens, output and prompt
    positions, compared with the reference's float32 scores. None when the cell has no reference."""
    import numpy as np
    import pyarrow as pa

    from lpf.analysis.metrics import percentiles
    from lpf.core.model_specs import resolve_model
    from lpf.pipeline import engine_dtype
    from lpf.pipeline.reference import Rescorer, ScoreItem
    from lpf.run.store import RunDir

    run = RunDir.open(cell)
    ref_info, dtype = run.manifest.get("reference") or {}, engine_dtype(run.manifest)
    if not ref_info or dtype not in ("bfloat16", "float16"):
        return None
    with_prompt = set(run.read("prompt_tokens", ["request_id"]).column("request_id").to_pylist())
    req = run.read("requests", ["request_id", "prompt_token_ids", "output_token_ids", "error"]).to_pylist()
    items = [
        ScoreItem(r["request_id"], r["prompt_token_ids"], r["output_token_ids"], r["request_id"] in with_prompt)
        for r in req
        if r["error"] is None and r["output_token_ids"]
    ]
    scored = list(Rescorer(resolve_model(ref_info["spec"]), dtype=dtype, topk=1).score_all(items))

    def floor(tables: list, table: str) -> dict:
        tables = [t for t in tables if t is not None and t.num_rows]
        if not tables or not run.has(table):
            return {}
        low = (
            pa.concat_tables(tables)
            .select(["request_id", "position", "ref_logprob"])
            .rename_columns(["request_id", "position", "low"])
        )
        j = low.join(run.read(table, ["request_id", "position", "ref_logprob"]), ["request_id", "position"])
        return percentiles(np.abs(j.column("low").to_numpy() - j.column("ref_logprob").to_numpy()))

    floors = {
        "output": floor([s.reference for s in scored], "reference"),
        "prompt": floor([s.prompt_reference for s in scored], "prompt_reference"),
    }
    sides = {
        "output": (findings.get("metrics") or {}).get("abs_logprob_diff") or {},
        "prompt": ((findings.get("prompt") or {}).get("metrics") or {}).get("abs_logprob_diff") or {},
    }
    ratios = {
        f"{side}_{q}": (m[q] / floors[side][q]) if m.get(q) is not None and floors[side].get(q) else None
        for side, m in sides.items()
        for q in ("p99", "max")
    }
    return {
        "source": f"the reference at {dtype}, teacher-forced over the cell's tokens",
        "floor": {side: {q: f.get(q) for q in ("p99", "max")} for side, f in floors.items()},
        "ratios": ratios,
        "factor": EXPECT_FACTOR,
        "within": within_expectation(ratios),
    }


def within_expectation(ratios: dict) -> bool:
    """A bf16 cell conforms when every measured ratio is within EXPECT_FACTOR and the output p99 was
    measured at all: an expectation that could not be measured (no reference rows, a zero floor) says
    nothing, so the cell keeps its analysis verdict."""
    return ratios.get("output_p99") is not None and all(r is None or r <= EXPECT_FACTOR for r in ratios.values())


def engine_limitation(error: str | None) -> str | None:
    """Why the engine build cannot run the cell, when its error says so (`ENGINE_LIMITS`); else None."""
    for needle, why in ENGINE_LIMITS:
        if error and needle in error:
            return why
    return None


def _first(flagged: list[dict], key: str):
    values = [f[key] for f in flagged if f.get(key) is not None]
    return min(values) if values else None


def cell_row(
    plan: CellPlan, out: Path, findings: dict | None, status: str, error: str | None, seconds: float | None
) -> dict:
    arch, cell = plan.arch, plan.cell
    d = cell_dir(out, arch["architecture"], cell.name)
    row = {
        "architecture": arch["architecture"],
        "model_type": arch.get("model_type"),
        "cell": cell.name,
        "dtype": cell.dtype,
        "stresses": cell.stresses,
        "status": status,
        "error": error,
        "seconds": seconds,
        "run_dir": os.path.relpath(d, out),
    }
    if arch.get("variant"):  # a config variant's row: which architecture, which fields differ (plan.py)
        row["variant_of"], row["variant"] = arch.get("variant_of"), arch["variant"]
    if findings is None:
        return row
    p = findings.get("prompt") or {}
    hyp = (findings.get("hypotheses") or [{}])[0]
    report = d / "report.html"
    row.update(
        {
            "verdict": findings.get("verdict"),
            "counts": findings.get("counts"),
            "n_requests": findings.get("n_requests"),
            "errors": findings.get("errors"),
            "max_abs_output": ((findings.get("metrics") or {}).get("abs_logprob_diff") or {}).get("max"),
            "first_divergence": _first(findings.get("flagged") or [], "first_divergence"),
            "prompt_verdict": p.get("verdict"),
            "prompt_counts": p.get("counts"),
            "max_abs_prompt": ((p.get("metrics") or {}).get("abs_logprob_diff") or {}).get("max"),
            "prompt_first_departure": _first(p.get("flagged") or [], "first_departure"),
            "prompt_shape": (p.get("shape") or {}).get("sentence"),
            "thresholds_source": (findings.get("thresholds") or {}).get("source"),
            "top_hypothesis": hyp.get("sentence") if findings.get("verdict") not in ("clean", None) else None,
            "link": os.path.relpath(report, out) if report.is_file() else None,
            "report_error": findings.get("report_error"),
        }
    )
    exp = expectation(d, findings) if cell.dtype != "float32" else None
    row["expectation"] = exp  # the old envelope, reported beside the paired test for one release
    row["conformance"] = "clean" if exp is not None and exp["within"] else row["verdict"]
    if cell.dtype != "float32":
        from lpf.experiments.conformance.judging import bf16_per_position

        row["bf16_paired"] = bf16_per_position(d)
        if (row["bf16_paired"] or {}).get("result") is not None:  # the per-position test decides
            row["conformance"] = row["verdict"] if row["bf16_paired"]["departs"] else "clean"
    if plan.spec is not None and plan.spec.run.engine == "llamacpp" and cell.dtype == "float32":
        from lpf.experiments.conformance.judging import judge_llamacpp

        row["engine_judgement"] = judge_llamacpp(d, findings, plan.spec.run.model)
        if row["engine_judgement"]["conformance"] == "clean":
            row["conformance"] = "clean"
    return row


def _attribute(row: dict, plan: CellPlan, hf_spec, out: Path, settings: Settings, hf_done: dict) -> None:
    """Run (once per architecture and dtype) the second engine and diff it against the cell."""
    from lpf.analysis.levels import at_or_above
    from lpf.views.diff import diff_runs

    if not at_or_above(row.get("conformance"), settings.attribution_level) or hf_spec is None:
        return
    key = str(hf_spec.run.out)
    if key not in hf_done:
        try:
            f = _audit(hf_spec, plan.cell.dtype)
            hf_done[key] = {"ok": True, "verdict": f.get("verdict")}
        except LpfError as e:
            hf_done[key] = {"ok": False, "error": str(e)}
    hf = hf_done[key]
    attribution = {
        "second_engine": "hf",
        "second_run_dir": os.path.relpath(key, out),
        "second_verdict": hf.get("verdict"),
    }
    if not hf["ok"]:
        row["attribution"] = {**attribution, "suspect": None, "error": hf["error"]}
        return
    cell = out / row["run_dir"]
    _, doc = diff_runs(cell, Path(key), settings.attribution_level)
    (cell / "diff.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    row["attribution"] = {
        **attribution,
        "suspect": doc["suspect"],
        "says": SUSPECT_WORDS[doc["suspect"]],
        "sentence": doc["sentence"],
        "counts": doc["counts"],
        "level": doc["level"],
        "diff": os.path.relpath(cell / "diff.json", out),
    }


def _locate(row: dict, out: Path) -> None:
    """The locate line of a cell that does not conform: `lpf locate` on its worst request (the first op
    that departs, whose fault), its locate.json and report page inside the cell directory."""
    from lpf.locate import locate
    from lpf.report import write_report

    cell = out / row["run_dir"]
    try:
        doc, where = locate(cell)
    except LpfError as e:
        row["locate"] = {"error": str(e)}
        return
    try:
        write_report(where)
    except LpfError:
        pass
    loc = doc.get("located") or {}
    row["locate"] = {
        "request_id": doc["request_id"],
        "suspect": doc["verdict"]["suspect"],
        "op": loc.get("op"),
        "token": loc.get("token"),
        "sentence": doc["sentence"],
        "link": os.path.relpath(where / "report.html", out),
        "dir": os.path.relpath(where, out),
    }


def write_doc(out: Path, doc: dict) -> None:
    tmp = out / ".tmp-conformance.json"
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(out / "conformance.json")


def check_out(out: Path, spec: dict) -> None:
    """Refuses an --out that holds anything but this same conformance run (rerun = resume)."""
    old = read_out_doc(out, "conformance.json")
    if old is not None:
        if old.get("spec") != spec:
            raise LpfError(f"{out} holds a different conformance run ({old.get('spec')}): choose another --out")
    elif Path(out).exists() and any(p.name not in ("workload.jsonl", "variants") for p in Path(out).iterdir()):
        raise LpfError(f"{out} exists, is not empty and holds no conformance.json: choose another --out")


def run_matrix(
    out: Path,
    head: dict,
    plans: list[CellPlan],
    attribution: dict,
    settings: Settings,
    on_start=lambda total, done: None,
    tick=lambda n: None,
) -> dict:
    """`head`: the document's fixed part (spec, engine, architectures); `attribution`: {(arch, dtype): hf RunSpec}."""
    out = Path(out)
    check_out(out, head["spec"])
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    doc = {**head, "kind": "conformance", "complete": False, "cells": rows}
    write_doc(out, doc)
    on_start(len(plans), 0)
    hf_done: dict = {}
    started = time.monotonic()
    from lpf.adapters.vllm import kept_workers

    with kept_workers():  # one vLLM process for the whole matrix, a fresh engine per cell
        _run_cells(out, doc, rows, plans, attribution, settings, hf_done, started, tick)
    return doc


def _run_cells(out, doc, rows, plans, attribution, settings, hf_done, started, tick) -> None:
    try:
        for plan in plans:
            t0 = time.monotonic()
            findings, status, error = None, "ok", None
            skip = variant_skip(plan.arch, rows)
            if skip:
                status, error = "not applicable", skip
            elif plan.spec is None:
                status, error = "not applicable", plan.refused
            else:
                try:
                    findings = _audit(plan.spec, plan.cell.dtype)
                    if findings.get("errors") and findings.get("errors") == findings.get("n_requests"):
                        status, error = "engine error", "every request failed (see the cell's requests)"
                except ReferenceCannotRun as e:
                    status, error = "reference cannot run", str(e)
                except LpfError as e:
                    status, error = (
                        ("refused" if not (Path(plan.spec.run.out) / "manifest.json").is_file() else "engine error"),
                        str(e),
                    )
                except Exception as e:  # noqa: BLE001 - a bug in lpf: said in the matrix, the other cells still run
                    import traceback

                    traceback.print_exc()
                    status, error = "lpf error", f"{type(e).__name__}: {e} (a bug in lpf, please report it)"
            if status == "engine error" and engine_limitation(error):
                status, error = "not supported", f"{engine_limitation(error)}: {error}"
            row = cell_row(plan, out, findings, status, error, round(time.monotonic() - t0, 1))
            if findings is not None and status == "ok":
                try:
                    _attribute(
                        row, plan, attribution.get((plan.arch["architecture"], plan.cell.dtype)), out, settings, hf_done
                    )
                except LpfError as e:
                    row["attribution"] = {"suspect": None, "error": str(e)}
                if settings.locate and row.get("conformance") not in ("clean", None):
                    _locate(row, out)
            rows.append(row)
            doc["elapsed_s"] = round(time.monotonic() - started, 1)
            write_doc(out, doc)
            tick(1)
        doc["complete"] = True
    finally:
        doc["elapsed_s"] = round(time.monotonic() - started, 1)
        write_doc(out, doc)
