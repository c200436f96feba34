"""`lpf.audit`: `lpf audit` from Python: an `AuditSpec` (or its settings as keyword arguments) -> `Findings`.

The same stages as the command (`lpf.pipeline`: create the run, generate, rescore, analyze, report), without
the terminal: nothing is printed. Keyword arguments are the command's options by their Python names:
`engine`, `model`, `workload`, `out`, `n`, the sampling settings (`temperature`, `top_p`, `top_k`,
`max_tokens`, `seed`, `ignore_eos`, `logprobs`, `prompt_logprobs`), `engine_options` (the engine's knobs by
name; `inject="stale-state"` is `engine_options={"inject": ...}`), the reference's (`reference`,
`reference_dtype`, `reference_device`, `token_budget`), `declared` (what the engine runs where lpf cannot
read it: {"kv_cache_dtype", "flash_attention", "weight_quantization"}), `calibrate`, `attribution`, `thresholds`
({name: value}) and `rule` (the peer's rule beside lpf's verdicts, as in `lpf.compare`). `out` defaults to a
new temporary directory. Every setting is checked before anything is written; a bad one is an `LpfError`
(one line, as the command prints it), never a pydantic traceback.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from lpf.api.findings import Findings
from lpf.core.errors import LpfError

_SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "seed", "ignore_eos", "logprobs", "prompt_logprobs")
_RUN = ("engine", "model", "workload", "n", "part_size", "trace_dir", "declared")
_RESCORE = {
    "reference": "reference",
    "reference_dtype": "dtype",
    "reference_device": "device",
    "token_budget": "token_budget",
}
_ANALYSIS = ("calibrate", "attribution")


def build_spec(out: Path | str | None = None, **kw: Any):
    """An `AuditSpec` from `lpf.audit`'s keyword arguments (module docstring)."""
    from pydantic import ValidationError

    from lpf.core.sampling import SamplingParams
    from lpf.pipeline.rescore import RescoreSettings
    from lpf.pipeline.spec import AnalysisSpec, AuditSpec, RunSpec

    known = {*_SAMPLING, *_RUN, *_RESCORE, *_ANALYSIS, "engine_options", "inject", "thresholds"}
    unknown = sorted(set(kw) - known)
    if unknown:
        from lpf.core.errors import did_you_mean

        raise LpfError(f"lpf.audit: no setting {unknown[0]!r}{did_you_mean(unknown[0], known)}")
    options = dict(kw.pop("engine_options", None) or {})
    if kw.get("inject") is not None:
        options["inject"] = kw.pop("inject")
    kw.pop("inject", None)
    try:
        sampling = SamplingParams(**{k: kw[k] for k in _SAMPLING if k in kw})
        run = RunSpec(
            out=Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="lpf-audit-")) / "run",
            sampling=sampling,
            engine_options=options,
            **{k: kw[k] for k in _RUN if k in kw},
        )
        base = AuditSpec.model_fields["rescore"].default
        rescore = RescoreSettings(
            **{
                **{f: getattr(base, f) for f in ("reference", "dtype", "device", "token_budget")},
                **{v: kw[k] for k, v in _RESCORE.items() if k in kw},
            }
        )
        rescore.validate()
        return AuditSpec(
            run=run,
            rescore=rescore,
            analysis=AnalysisSpec(**{k: kw[k] for k in _ANALYSIS if k in kw}),
            thresholds=dict(kw.get("thresholds") or {}),
        )
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise LpfError(f"lpf.audit: {where + ': ' if where else ''}{first['msg']}") from None
    except TypeError as e:  # a dataclass setting of the wrong shape
        raise LpfError(f"lpf.audit: {e}") from None


def audit(spec=None, *, rule: str | None = None, **kw: Any) -> Findings:
    """Run an audit (an `AuditSpec`, or its settings as keyword arguments, not both) and return its findings.
    An interrupted audit's directory is finished when the same spec runs again (as `lpf audit --spec`)."""
    from lpf.analysis.peer_rule import RULES
    from lpf.api.compare import finish
    from lpf.pipeline import all_failed, calibrate_run, execute_run, open_audit, rescore_run
    from lpf.pipeline.spec import AuditSpec

    if rule is not None and rule not in RULES:
        raise LpfError(f"rule={rule!r}: choose from {', '.join(RULES)}")
    if spec is not None and kw:
        raise LpfError(f"lpf.audit: an AuditSpec holds every setting: drop {sorted(kw)[0]}")
    if spec is None:
        spec = build_spec(**kw)
    elif not isinstance(spec, AuditSpec):
        raise LpfError(f"lpf.audit: spec must be an AuditSpec, got {type(spec).__name__}")
    run = open_audit(spec)
    if run.manifest.get("status") != "complete":
        execute_run(run)
        if run.manifest.get("trace_dir"):
            from lpf.pipeline import join_trace

            join_trace(run, run.manifest["trace_dir"])
    why = all_failed(run)
    if why:
        raise LpfError(f"nothing could be audited: {why}")
    rescore_run(run, settings=spec.rescore)
    if spec.analysis.calibrate:
        calibrate_run(run, spec.rescore.token_budget, device=spec.rescore.device)
    return finish(run, spec.threshold_values(), attribution=spec.analysis.attribution, rule=rule)
