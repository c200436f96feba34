"""The analyze stage: a rescored run's parts -> `summary.parquet` and `findings.json` (via `lpf.analysis`)."""

from __future__ import annotations

import pyarrow.parquet as pq

from lpf.analysis.findings import analyze
from lpf.analysis.thresholds import Thresholds
from lpf.errors import LpfError
from lpf.jsonsafe import finite
from lpf.pipeline.calibrate import calibration_for
from lpf.run.store import RunDir


def chunk_budget(manifest: dict) -> int | None:
    """The step's token budget when prompts could be split (chunked prefill not switched off), for
    placing chunk boundaries when there is no trace."""
    engine = manifest.get("engine") or {}
    opts = {**(engine.get("engine_args") or {}), **{k: v for k, v in (engine.get("options") or {}).items()
                                                     if v is not None}}
    budget = opts.get("max_num_batched_tokens")
    if opts.get("enable_chunked_prefill") is False or not isinstance(budget, int) or isinstance(budget, bool):
        return None
    return budget


def analyze_run(run: RunDir, thresholds: Thresholds) -> dict:
    m = run.manifest
    requests = run.read("requests")
    if requests.num_rows == 0:
        raise LpfError(f"{run.path} has no completed requests to analyze")
    trace = run.read("trace") if run.has("trace") else None  # engines without a trace: metadata only
    temperature = m["sampling"].get("temperature", 0) or 0
    reference = run.read("reference")
    calibration, cal_info = calibration_for(run, reference)
    prompt = (run.read("prompt_tokens"), run.read("prompt_reference")) if run.has("prompt_reference") else (None, None)
    summary, findings = analyze(requests, run.read("tokens"), reference, thresholds,
                                greedy=temperature == 0, trace=trace, engine_info=m.get("engine"),
                                temperature=temperature, calibration=calibration, calibration_info=cal_info,
                                prompt_tokens=prompt[0], prompt_reference=prompt[1], chunk_budget=chunk_budget(m))
    findings = {"run_id": m.get("run_id"), "engine": m["engine"].get("name"), "model": m["model"].get("spec"),
                "reference": (m.get("reference") or {}).get("spec"), **findings}
    findings["run_complete"] = m.get("status") == "complete"
    pq.write_table(summary, run.path / "summary.parquet")
    run.write_json("findings.json", finite(findings))
    return finite(findings)
