"""The analyze stage: a rescored run's parts -> `summary.parquet` and `findings.json` (via `lpf.analysis`)."""

from __future__ import annotations

import pyarrow.parquet as pq

from lpf.analysis.findings import analyze
from lpf.analysis.thresholds import Thresholds
from lpf.errors import LpfError
from lpf.jsonsafe import finite
from lpf.pipeline.calibrate import calibration_for
from lpf.pipeline.trace import engine_info, trace_summary
from lpf.run.store import RunDir


def analyze_run(run: RunDir, thresholds: Thresholds) -> dict:
    m = run.manifest
    requests = run.read("requests")
    if requests.num_rows == 0:
        raise LpfError(f"{run.path} has no completed requests to analyze")
    trace = run.read("trace") if run.has("trace") else None  # engines without a trace: metadata only
    temperature = m["sampling"].get("temperature", 0) or 0
    reference = run.read("reference")
    calibration, cal_info = calibration_for(run, reference)
    summary, findings = analyze(requests, run.read("tokens"), reference, thresholds,
                                greedy=temperature == 0, trace=trace, engine_info=engine_info(run),
                                temperature=temperature, calibration=calibration, calibration_info=cal_info)
    findings = {"run_id": m.get("run_id"), "engine": m["engine"].get("name"), "model": m["model"].get("spec"),
                "reference": (m.get("reference") or {}).get("spec"), **findings}
    findings["run_complete"] = m.get("status") == "complete"
    findings["trace"] = trace_summary(run)
    pq.write_table(summary, run.path / "summary.parquet")
    run.write_json("findings.json", finite(findings))
    return finite(findings)
