"""The command line's door to the one audit builder: parsed click options -> `AuditOptions` ->
`lpf.pipeline.audit_options.build_spec` -> `lpf.pipeline.spec.AuditSpec` (the builder `lpf.audit` uses).

Contract:
- `build_audit_spec(params)`: the `AuditSpec` of a command's parsed options (`options.run_options`' and,
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

from lpf.cli.common import default_out
from lpf.core.errors import LpfError


def build_audit_spec(params: Mapping):
    """The `AuditSpec` of a command's parsed options: `run_options`' params and, where the command has
    them, the rescore and analysis options (else their defaults: `lpf run`). The options become an
    `AuditOptions` (the command's other parameters, such as `lpf sweep`'s own, are not audit settings)
    and `lpf.pipeline.audit_options.build_spec` builds the spec, as `lpf.audit` does. Validates everything
    (engine knobs, thresholds, rescore settings) or raises LpfError."""
    from pydantic import ValidationError

    from lpf.pipeline.audit_options import AuditOptions, build_spec, knob_flags

    known = set(AuditOptions.model_fields) | set(knob_flags())
    try:
        options = AuditOptions.model_validate({k: v for k, v in params.items() if k in known})
        return build_spec(options, lambda: default_out("run"))
    except ValidationError as e:  # a bound of a setting (--n 0): one line naming the flag
        raise LpfError(spec_error(e)) from None


def spec_error(e) -> str:
    """A spec's validation error as one line naming the command-line flag: `--n must be >= 1, got 0`."""
    from lpf.pipeline.audit_options import options_error

    return options_error(e, "flag")


# `lpf rescore`'s options (reference_options + the executor's): its settings are the builder's rescore part
_RESCORE = ("reference", "reference_dtype", "reference_device", "token_budget", "executor", "ray_address", "actors")
_RESCORE += ("gpus_per_actor", "reference_model", "reference_concurrency", "reference_option")


def rescore_settings(params: Mapping):
    """The `RescoreSettings` of parsed rescore options (validated), by the builder's own rescore part."""
    from pydantic import ValidationError

    from lpf.pipeline.audit_options import AuditOptions
    from lpf.pipeline.audit_options import rescore_settings as of_options

    try:
        return of_options(AuditOptions.model_validate({k: v for k, v in params.items() if k in _RESCORE}))
    except ValidationError as e:
        raise LpfError(spec_error(e)) from None
