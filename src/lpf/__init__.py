"""logprob-forensics: re-score an inference engine's exact tokens with a reference model and find the lies.

Where things are (imports run down this list: a package never imports one above it, but core resolves
`zoo:` specs through zoo/registry, lazily):
  pytest_plugin/  the pytest plugin (entry point `pytest11`): the `lpf_reference` fixture, failed checks'
                run directories attached to the test's report
  cli/          the command line: one module per command group, `common` + `render` shared
                (__main__: `python -m lpf`, the same command line)
  experiments/  many audits and what they show: cells (a spec in its own process), sweep, repeat,
                shrink/, conformance/; handed AuditSpecs, never argv
  locate/       `lpf locate`: one request replayed with per-op capture, aligned op by op against the
                reference (and the reference against itself): the first op that departs, whose fault
  views/        reading finished directories for people: query (SQL), inspect (one request), diff (two runs)
  watch/        `lpf watch`: a proxy in front of a live server, sampled requests recorded and re-scored
                in windows (proxy, upstream, recorder, scorer, supervisor, retention, metrics)
  serve/        `lpf serve`: HTTP over the built-in engine    rl/   RL rollout-vs-trainer dumps, rl simulate
  api/          the Python API below: lpf.audit, lpf.compare, Findings (on the pipeline, beside the CLI)
  report/       report.html for every directory kind
  pipeline/     spec (AuditSpec: everything one audit needs), the stages run -> rescore -> calibrate ->
                analyze over a run directory, and the reference (the teacher-forced HF rescorer)
  adapters/     the engines under test behind one interface: builtin, hf, vllm, openai, sglang
  builtin/      the built-in engine itself (scheduler, caches, runner, drills, its model implementations)
  analysis/     pure functions over Arrow tables: metrics, verdicts, shape, hypotheses, findings
  run/          the run directory: schema, crash-safe store
  zoo/          bundled trained checkpoints, the tokenizer, task generators and workloads
  core/         foundations: errors, sampling, workload, model_specs, knobs (roles on Options fields),
                devices, torch_utils, jsonsafe
Importing `lpf` is cheap: no torch, no transformers. Heavy modules load when a command needs them.

The Python API (docs/engine-ci.md), loaded on first use:
  lpf.audit(spec=None, **settings) -> Findings       an `lpf audit` (AuditSpec, or the options as keywords)
  lpf.compare(outputs, reference, dtype, rule) -> Findings
                                                     outputs your engine produced, judged against the reference
  lpf.Reference(model, dtype)                        the reference loaded once; .compare(outputs, ...)
  lpf.Findings, lpf.FindingsCheckFailed              findings.check(fail_on="divergent") raises the latter
  lpf.AuditSpec, lpf.LpfError                        the spec `lpf audit --spec` reads; every user error
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "audit": "lpf.api.audit",
    "compare": "lpf.api.compare",
    "Reference": "lpf.api.compare",
    "Findings": "lpf.api.findings",
    "FindingsCheckFailed": "lpf.api.findings",
    "AuditSpec": "lpf.pipeline.spec",
    "LpfError": "lpf.core.errors",
}
__all__ = ["__version__", "audit", "compare", "Reference", "Findings", "FindingsCheckFailed", "AuditSpec", "LpfError"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lpf' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})
