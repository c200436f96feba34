"""The one way options become an audit: parsed click options -> `lpf.pipeline.spec.AuditSpec`.

Contract:
- `build_audit_spec(params)`: the `AuditSpec` of a command's parsed options (`common.run_options`' and,
  where the command has them, the rescore and analysis options; else their defaults: `lpf run`).
  Validates everything (engine knobs, thresholds, rescore settings) or raises LpfError.
- `rescore_settings(params)`: parsed rescore options as the rescore stage's `RescoreSettings` (validated):
  the spec's `rescore` part, and `lpf rescore`'s settings on their own.
- `spec_error(e)`: a spec's pydantic validation error as one line naming the command-line flag.
Options become a spec here and nowhere else; nothing in lpf/cli/ turns a spec or options back into
arguments (`spec.audit_command` renders one for people). The pipeline modules are imported inside the
functions: `lpf --help` imports this module and must stay light (no pydantic, no engines).
"""

from __future__ import annotations

from typing import Mapping

from lpf.cli.common import default_out, engine_knobs
from lpf.core.errors import LpfError


def build_audit_spec(params: Mapping):
    """The one `AuditSpec` builder, from parsed options: `run_options`' params and, where the command
    has them, the rescore and analysis options (else their defaults: `lpf run`). Engines behind a server
    name a model that is not a local path: their adapter picks the local one. Validates everything
    (engine knobs, thresholds, rescore settings) or raises LpfError."""
    from pydantic import ValidationError

    from lpf.adapters import get_engine_class

    p = params
    options = engine_knobs(p)
    hook = getattr(get_engine_class(p["engine"]), "resolve_model_spec", None)
    model = hook(p.get("model"), p.get("reference"), options) if hook else p.get("model")
    if p["part_size"] < 1:
        raise LpfError("--part-size must be >= 1")
    try:
        return _audit_spec(p, model, options)
    except ValidationError as e:  # a bound of a spec field (--n 0): one line naming the flag
        raise LpfError(spec_error(e)) from None


def spec_error(e) -> str:
    """A spec's validation error as one line naming the command-line flag: `--n must be >= 1, got 0`."""
    from lpf.adapters.base import option_error

    first = e.errors(include_url=False)[0]
    loc = [str(x) for x in first.get("loc", ()) if not isinstance(x, int)]
    flag = "--" + loc[-1].replace("_", "-") if loc else "the audit spec"
    line, where = option_error(e), ".".join(str(x) for x in first.get("loc", ()))
    if where and line.startswith(f"engine option {where}:"):
        return flag + line.removeprefix(f"engine option {where}")
    return flag + line.removeprefix(where) if where and line.startswith(where) else f"{flag}: {line}"


def _audit_spec(p: Mapping, model, options: dict):
    from lpf.analysis.thresholds import Thresholds
    from lpf.core.sampling import SamplingParams
    from lpf.pipeline.spec import AnalysisSpec, AuditSpec, Declared, RunSpec

    sampling = SamplingParams(
        temperature=p["temperature"],
        top_p=p["top_p"],
        top_k=p["top_k"],
        max_tokens=p["max_tokens"],
        seed=p["seed"],
        ignore_eos=p["ignore_eos"],
        logprobs=p["logprobs"],
        prompt_logprobs=bool(p.get("prompt_logprobs")),
    )
    run = RunSpec(
        engine=p["engine"],
        **({"model": model} if model else {}),
        **({"workload": p["workload"]} if p.get("workload") else {}),
        out=p.get("out") or default_out("run"),
        n=p["n"],
        sampling=sampling,
        engine_options=options,
        part_size=p["part_size"],
        trace_dir=p.get("trace_dir"),
        declared=Declared(**{k: p.get(k) for k in Declared.model_fields}),
    )
    pinned = Thresholds().with_overrides(list(p.get("threshold") or ()))
    kw = {"rescore": rescore_settings(p)} if "token_budget" in p else {}
    return AuditSpec(
        run=run,
        analysis=AnalysisSpec(calibrate=bool(p.get("calibrate")), attribution=p.get("attribution", True)),
        thresholds={name: getattr(pinned, name) for name in pinned.pinned},
        **kw,
    )


def rescore_settings(params: Mapping):
    """The `RescoreSettings` of parsed rescore options (validated)."""
    from lpf.pipeline.rescore import RayOptions, RescoreSettings

    settings = RescoreSettings(
        reference=params.get("reference"),
        dtype=params["reference_dtype"],
        token_budget=params["token_budget"],
        device=params["reference_device"],
        executor=params["executor"],
        ray=RayOptions(
            address=params.get("ray_address"), actors=params["actors"], gpus_per_actor=float(params["gpus_per_actor"])
        ),
    )
    settings.validate()
    return settings
