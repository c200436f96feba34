"""`AuditOptions`: the settings of one audit as `lpf audit` and `lpf.audit` take them, and the one function
that turns them into an `AuditSpec`.

Contract:
- `AuditOptions` (pydantic, extra="forbid"): one field per `lpf audit` option but the terminal's own
  (`--json`, `--fail-on`, `--spec`), named as the option's Python name (`--top-p` is `top_p`,
  `-E/--engine-option` is `engine_option`, `--threshold` is `threshold`), with the option's default
  (tests/test_spec_options.py walks the click options and checks both). Two forms the API adds:
  `engine_options` ({knob: value}) and `thresholds` ({name: value}). Every named engine-knob flag
  (`--inject`, `--max-num-seqs`, ...: `lpf.core.knobs`, flagged on any engine's Options) is a keyword of
  its own name too; validation gathers the knobs into `engine_options`: the API's dict, then `-E`
  values, then the named flags (a named flag wins over -E, as on the command line).
- `build_spec(options, default_out)`: the `AuditSpec`, built one way for the command line, the API and the
  experiments' cells: the engine's `resolve_model_spec` hook (engines behind a server name a model that is
  not a local path: the hook picks the local one and fills `served_model`), the run, the rescore settings
  (validated), the analysis and the thresholds. `default_out()` is where the run goes when `out` is None.
- `rescore_settings(options)`: the rescore part alone (`lpf rescore`).
- `options_error(e, style)`: a validation error as one line naming the setting as the caller spells it:
  `--max-tokens must be >= 1, got 0` (style "flag") or `max_tokens must be >= 1, got 0` (style "keyword").
Bad input is an `LpfError` or a pydantic `ValidationError` (the callers turn it into one line).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lpf.core.errors import LpfError

TERMINAL_ONLY = {
    "as_json": "`lpf.audit` returns the Findings (Findings.to_dict() is the --json document)",
    "fail_on": "Findings.check(fail_on=...) raises what --fail-on exits 1 on",
    "spec_file": "lpf.audit(spec) runs an AuditSpec as --spec FILE does",
}


@lru_cache(maxsize=1)
def knob_flags() -> dict[str, Any]:
    """{name: Knob} of every engine's flagged knobs (the named `lpf audit` flags generated from them)."""
    from lpf.adapters import engine_names, get_engine_class
    from lpf.core.knobs import flag_knobs

    return {k.name: k for k in flag_knobs(get_engine_class(e).Options for e in engine_names())}


class AuditOptions(BaseModel):
    """One audit's settings by `lpf audit`'s option names (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: str = "builtin"
    model: str | None = None
    workload: str | None = None
    n: int = 1
    limit: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 32
    seed: int = 0
    ignore_eos: bool = False
    logprobs: int = 5
    prompt_logprobs: bool = False
    part_size: int = 64
    trace_dir: Path | None = None
    # what the engine runs where lpf cannot read it (the spec's `run.declared`)
    kv_cache_dtype: str | None = None
    flash_attention: Literal["on", "off"] | None = None
    weight_quantization: str | None = None
    out: Path | None = None
    engine_option: tuple[str, ...] = ()
    engine_options: dict[str, Any] = {}
    reference: str | None = None
    reference_model: str | None = None
    reference_concurrency: int | None = None
    reference_option: tuple[str, ...] = ()
    reference_dtype: str = "float32"
    reference_device: Literal["cpu", "cuda", "auto"] = "auto"
    token_budget: int = 16384
    executor: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    actors: int = Field(1, ge=1)
    gpus_per_actor: float = Field(0.0, ge=0)
    calibrate: bool = False
    attribution: bool = True
    threshold: tuple[str, ...] = ()
    thresholds: dict[str, int | float] = {}

    @model_validator(mode="before")
    @classmethod
    def _gather_knobs(cls, data: Any) -> Any:
        """Named knob flags and -E values into `engine_options` (a named flag wins over -E, -E over the dict)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        flags = knob_flags()
        merged = dict(data.get("engine_options") or {})
        for kv in data.get("engine_option") or ():
            key, sep, value = str(kv).partition("=")
            if not sep:
                raise LpfError(f"--engine-option expects KEY=VALUE, got {kv!r}")
            merged[key.strip()] = value.strip()
        for name in [k for k in data if k in flags and k not in cls.model_fields]:
            value = data.pop(name)
            if isinstance(value, (list, tuple)):  # a repeatable flag: its values joined with ","
                value = ",".join(str(v) for v in value) if value else None
            if value is not None:
                merged[name] = value
        data["engine_options"], data["engine_option"] = merged, ()
        return data


def options_error(e, style: Literal["flag", "keyword"] = "flag") -> str:
    """A validation error (of `AuditOptions` or of the spec built from it) as one line naming the setting."""
    from lpf.adapters.base import option_error

    first = e.errors(include_url=False)[0]
    loc = [str(x) for x in first.get("loc", ()) if not isinstance(x, int)]
    if loc:
        name = "--" + loc[-1].replace("_", "-") if style == "flag" else loc[-1]
    else:
        name = "the audit spec" if style == "flag" else "the settings"
    if first.get("type") == "extra_forbidden" and style == "keyword":
        return f"no setting {loc[-1]!r}"
    line, where = option_error(e), ".".join(str(x) for x in first.get("loc", ()))
    if where and line.startswith(f"engine option {where}:"):
        return name + line.removeprefix(f"engine option {where}")
    return name + line.removeprefix(where) if where and line.startswith(where) else f"{name}: {line}"


def _configured_kv(engine_cls, declared: str | None, engine_options: dict) -> dict:
    """An engine lpf starts whose KV precision is a knob (`kv_cache_dtype`: the built-in engine's, vLLM's) is
    configured by the declaration (`--kv-cache-dtype`), when the knob takes that type: declaring is configuring,
    and the engine then says it in the manifest. A type the knob does not take stays a declaration (recorded
    beside the engine's own word); a knob set to another type than the one declared is a contradiction."""
    import typing

    field = engine_cls.Options.model_fields.get("kv_cache_dtype")
    if not declared or field is None:
        return engine_options
    from lpf.run.configuration import canonical_dtype

    def literals(t) -> set:
        args = typing.get_args(t)
        return set(args) if typing.get_origin(t) is typing.Literal else set().union(*map(literals, args or ()))

    want = declared.strip().lower()
    given = engine_options.get("kv_cache_dtype")
    if given is not None and canonical_dtype(str(given)) != canonical_dtype(want):
        raise LpfError(
            f"--kv-cache-dtype {declared} declares another KV cache than -E kv_cache_dtype={given} configures: give one"
        )
    if given is None and want in literals(field.annotation):
        engine_options = {**engine_options, "kv_cache_dtype": want}
    return engine_options


def build_spec(options: AuditOptions, default_out: Callable[[], Path]):
    """The one `AuditSpec` builder (module docstring): validates everything or raises LpfError /
    pydantic's ValidationError."""
    from lpf.adapters import get_engine_class
    from lpf.analysis.thresholds import Thresholds
    from lpf.core.sampling import SamplingParams
    from lpf.pipeline.reference_http import reference_form
    from lpf.pipeline.spec import AnalysisSpec, AuditSpec, Declared, RunSpec

    o = options
    engine_options = dict(o.engine_options)
    engine_cls = get_engine_class(o.engine)
    engine_options = _configured_kv(engine_cls, o.kv_cache_dtype, engine_options)
    hook = getattr(engine_cls, "resolve_model_spec", None)
    # a reference behind a server has no local model to lend the run its tokenizer: --model must be one
    form = reference_form(o.reference)
    local = o.reference if form == "transformers" else None
    if form == "vllm":  # vLLM's reference model is a local one
        from lpf.pipeline.reference_vllm import parse_spec

        local = parse_spec(o.reference)
    try:
        model = hook(o.model, local, engine_options) if hook else o.model
    except LpfError:
        if local is None and o.reference is not None:
            raise LpfError(
                f"--reference {o.reference} scores on a server: --model must be the local copy of the served "
                f"model (its tokenizer), with --served-model NAME"
            ) from None
        raise
    sampling = SamplingParams(
        temperature=o.temperature,
        top_p=o.top_p,
        top_k=o.top_k,
        max_tokens=o.max_tokens,
        seed=o.seed,
        ignore_eos=o.ignore_eos,
        logprobs=o.logprobs,
        prompt_logprobs=o.prompt_logprobs,
    )
    run = RunSpec(
        engine=o.engine,
        **({"model": model} if model else {}),
        **({"workload": o.workload} if o.workload else {}),
        out=o.out if o.out is not None else default_out(),
        n=o.n,
        limit=o.limit,
        sampling=sampling,
        engine_options=engine_options,
        part_size=o.part_size,
        trace_dir=o.trace_dir,
        declared=Declared(
            kv_cache_dtype=o.kv_cache_dtype,
            flash_attention=o.flash_attention,
            weight_quantization=o.weight_quantization,
        ),
    )
    rescore = rescore_settings(o)
    if reference_form(o.reference) == "self" and o.engine not in ("openai", "vllm"):
        raise LpfError(
            f"--reference self re-scores with the audited engine itself: it needs --engine openai (its server) "
            f"or --engine vllm, not {o.engine}; pass a model or an http(s):// reference"
        )
    if o.calibrate and reference_form(o.reference) != "transformers":
        from lpf.pipeline.calibrate import NO_CALIBRATION

        raise LpfError(NO_CALIBRATION.format(spec=o.reference))
    pinned = Thresholds().with_overrides([*o.threshold, *(f"{k}={v!r}" for k, v in o.thresholds.items())])
    return AuditSpec(
        run=run,
        rescore=rescore,
        analysis=AnalysisSpec(calibrate=o.calibrate, attribution=o.attribution),
        thresholds={name: getattr(pinned, name) for name in pinned.pinned},
    )


def rescore_settings(o: AuditOptions):
    """The rescore stage's `RescoreSettings` of these options (validated): the spec's `rescore` part, and
    `lpf rescore`'s settings on their own."""
    from lpf.pipeline.rescore import RayOptions, RescoreSettings

    settings = RescoreSettings(
        reference=o.reference,
        reference_model=o.reference_model,
        reference_concurrency=o.reference_concurrency,
        reference_option=tuple(o.reference_option),
        dtype=o.reference_dtype,
        token_budget=o.token_budget,
        device=o.reference_device,
        executor=o.executor,
        ray=RayOptions(address=o.ray_address, actors=o.actors, gpus_per_actor=float(o.gpus_per_actor)),
    )
    settings.validate()
    return settings
