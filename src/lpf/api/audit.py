"""`lpf.audit`: `lpf audit` from Python: an `AuditSpec` (or its settings as keyword arguments) -> `Findings`.

The same stages as the command (`lpf.pipeline`: create the run, generate, rescore, analyze, report), without
the terminal: nothing is printed. Keyword arguments are every `lpf audit` option by its Python name
(`lpf.pipeline.audit_options.AuditOptions`, built into a spec by the command's own builder, engine hooks
included): `engine`, `model`, `workload`, `out`, `n`, `limit` (the first N prompts), the sampling settings
(`temperature`, `top_p`, `top_k`, `max_tokens`, `seed`, `ignore_eos`, `logprobs`, `prompt_logprobs`), the
engine's knobs (`engine_option=["KEY=VALUE"]` as -E, each named knob flag by its name: `inject=...`,
`max_num_seqs=...`, or `engine_options={knob: value}`), `trace_dir`, `part_size`, the reference's and
executor's (`reference`, `reference_dtype`, `reference_device`, `token_budget`, `executor`, `ray_address`,
`actors`, `gpus_per_actor`), `calibrate`, `attribution`, `threshold` (["NAME=VALUE"]) or `thresholds`
({name: value}), and `rule` (the peer's rule beside lpf's verdicts, as in `lpf.compare`). `--json`,
`--fail-on` and `--spec` belong to the terminal: the returned `Findings`, `Findings.check(fail_on=...)` and
`lpf.audit(spec)`. `out` defaults to a new temporary directory. Every setting is checked before anything is
written; a bad one is an `LpfError` (one line), never a pydantic traceback.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from lpf.api.findings import Findings
from lpf.core.errors import LpfError


def build_spec(out: Path | str | None = None, **kw: Any):
    """An `AuditSpec` from `lpf.audit`'s keyword arguments (module docstring): `AuditOptions` and
    `lpf.pipeline.audit_options.build_spec`, the command line's own builder."""
    from pydantic import ValidationError

    from lpf.pipeline.audit_options import AuditOptions, build_spec, knob_flags, options_error

    known = (set(AuditOptions.model_fields) | set(knob_flags())) - {"out"}
    unknown = sorted(set(kw) - known)
    if unknown:
        from lpf.core.errors import did_you_mean

        raise LpfError(f"lpf.audit: no setting {unknown[0]!r}{did_you_mean(unknown[0], known)}")
    try:
        options = AuditOptions.model_validate({**kw, "out": out})
        return build_spec(options, lambda: Path(tempfile.mkdtemp(prefix="lpf-audit-")) / "run")
    except ValidationError as e:
        raise LpfError(f"lpf.audit: {options_error(e, 'keyword')}") from None


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
    from lpf.pipeline.reference_vllm import kept
    from lpf.pipeline.reference_vllm_self import held

    with held(spec.rescore.reference):  # a self-reference on the vllm engine re-scores in the run's own engine
        if run.manifest.get("status") != "complete":
            execute_run(run)
            if run.manifest.get("trace_dir"):
                from lpf.pipeline import join_trace

                join_trace(run, run.manifest["trace_dir"])
        why = all_failed(run)
        if why:
            raise LpfError(f"nothing could be audited: {why}")
        with kept(spec.rescore.reference):  # a vLLM reference starts once for the rescore and the attribution
            rescore_run(run, settings=spec.rescore)
            if spec.analysis.calibrate:
                calibrate_run(run, spec.rescore.token_budget, device=spec.rescore.device)
            return finish(run, spec.threshold_values(), attribution=spec.analysis.attribution, rule=rule)
