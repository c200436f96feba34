"""The analyze stage: a rescored run's parts -> `summary.parquet` and `findings.json` (via `lpf.analysis`).

It hands analysis the expected-floor table shipped with the package (`lpf/analysis/floors.json`,
read here so analysis does no I/O) and what the manifest says about the dtype pair, the reference
model and the sampling, from which the run-level test gets its floor.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

import pyarrow.parquet as pq

from lpf.analysis.findings import analyze
from lpf.analysis.thresholds import Thresholds
from lpf.errors import LpfError
from lpf.jsonsafe import finite
from lpf.pipeline.calibrate import calibration_for, engine_dtype
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
    ref = m.get("reference") or {}
    run_info = {"engine_dtype": engine_dtype(m), "reference_dtype": ref.get("dtype"), "model": ref.get("spec"),
                "sampling": m["sampling"]}
    summary, findings = analyze(requests, run.read("tokens"), reference, thresholds,
                                greedy=temperature == 0, trace=trace, engine_info=m.get("engine"),
                                temperature=temperature, calibration=calibration, calibration_info=cal_info,
                                floor_table=floor_table(), run_info=run_info)
    findings = {"run_id": m.get("run_id"), "engine": m["engine"].get("name"), "model": m["model"].get("spec"),
                "reference": (m.get("reference") or {}).get("spec"), **findings}
    findings["run_complete"] = m.get("status") == "complete"
    pq.write_table(summary, run.path / "summary.parquet")
    run.write_json("findings.json", finite(findings))
    return finite(findings)


@lru_cache(maxsize=1)
def floor_table() -> dict:
    """The expected-floor table measured by scripts/measure_floors.py (see docs/verdicts-and-metrics.md)."""
    return json.loads(resources.files("lpf.analysis").joinpath("floors.json").read_text())
