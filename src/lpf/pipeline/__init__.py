"""The stages of an audit, each reading and writing a run directory: run -> rescore [-> calibrate] -> analyze.

  spec.py       AuditSpec (run, rescore, analysis, thresholds): everything one audit needs, to and from JSON
  generate.py   create_run (validate, then create the directory), open_audit, execute_run (commit parts)
  rescore.py    rescore_run: the teacher-forced reference over every completed request
  calibrate.py  calibrate_run: the reference again at the engine's dtype (the floor it cannot move)
  trace.py      join_trace: a vLLM server's lpf-vllm-trace rows joined to the run; trace_summary
  analyze.py    analyze_run: summary.parquet and findings.json
  callbacks.py  the progress callbacks every stage takes
The spec (pydantic) is imported from lpf.pipeline.spec, not from here: the package itself stays
importable where only torch, transformers, pyarrow and numpy are (the rescorer on a bare GPU machine).
Progress is reported through `on_start(total, done)` / `tick(n)` callbacks: nothing here draws.
"""

from lpf.pipeline.analyze import analyze_run
from lpf.pipeline.calibrate import calibrate_run, engine_dtype
from lpf.pipeline.generate import (
    all_failed,
    create_run,
    execute_run,
    failed_requests,
    model_config,
    open_audit,
    pending_requests,
)
from lpf.pipeline.rescore import rescore_run
from lpf.pipeline.trace import join_trace, trace_summary

__all__ = [
    "all_failed",
    "failed_requests",
    "analyze_run",
    "calibrate_run",
    "create_run",
    "engine_dtype",
    "execute_run",
    "join_trace",
    "model_config",
    "open_audit",
    "pending_requests",
    "rescore_run",
    "trace_summary",
]
