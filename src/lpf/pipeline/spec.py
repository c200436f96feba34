"""`AuditSpec`: everything one audit needs, as one typed, frozen value that goes to and from JSON.

    AuditSpec(run=RunSpec(engine, model, workload, out, n, limit, sampling, engine_options, part_size, trace_dir,
                          declared=Declared(kv_cache_dtype, flash_attention, weight_quantization)),
              rescore=RescoreSettings(reference, dtype, token_budget, device, executor, ray,
                                      reference_model, reference_concurrency, reference_option),
              analysis=AnalysisSpec(calibrate, attribution), thresholds={name: value})

The command line and `lpf.audit` build one from their options through one builder
(`lpf.pipeline.audit_options.build_spec`, via `lpf.cli.audit_spec.build_audit_spec`), experiments build
theirs directly (a sweep cell, a shrink candidate, a conformance cell) and hand a cell nothing else:
`lpf audit --spec -` reads it back (`AuditSpec.model_validate_json`). Every run directory keeps the
spec it was created from in `RUN/spec.json` (docs/run-directory.md).

Validation happens on construction, so a spec that exists is one the pipeline can start: unknown
fields are refused (extra="forbid" here, in `SamplingParams`, `RescoreSettings` and `RayOptions`),
`engine_options` are checked against the engine's `Options` (a bad knob raises `LpfError` with one
line) and kept as the typed values of the options given (unset ones stay the engine's defaults),
`thresholds` are overrides (`lpf.analysis.thresholds` names; pinned: calibration never moves them).
`replace(spec, **changes)` validates again (pydantic's `model_copy` would not).

`audit_command(spec)` is the `lpf audit` argument list that runs the same audit, for people only
(shrink's command.sh, the header of a cell's log): nothing parses it back; `engine_option_args`
is its engine-knob part (named flags from the knobs' declarations, `-E NAME=VALUE` otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from lpf.core.model_specs import DEFAULT_MODEL
from lpf.core.sampling import SamplingParams
from lpf.core.workload import DEFAULT_WORKLOAD
from lpf.pipeline.rescore import RescoreSettings

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class Declared(BaseModel):
    """What the user says the engine runs where lpf cannot read it (`--kv-cache-dtype`, `--flash-attention`,
    `--weight-quantization`; the engine's dtype is its `--dtype` knob): recorded with the engine's own
    word in the manifest's `engine.configuration` (lpf.run.configuration). None: not declared."""

    model_config = _FROZEN

    kv_cache_dtype: str | None = None  # f32, f16, bf16, q8_0, q4_0, fp8, fp8_e4m3, fp8_e5m2, ...
    flash_attention: Literal["on", "off"] | None = None
    weight_quantization: str | None = None  # none, q8_0, q4_k_m, int8, fp8, awq, gptq, ...

    @field_validator("kv_cache_dtype", "weight_quantization")
    @classmethod
    def _named(cls, value: str | None) -> str | None:
        return value.strip().lower() or None if isinstance(value, str) else value


class RunSpec(BaseModel):
    """What a run is: which engine with which knobs, which model and prompts, how sampled, where it goes."""

    model_config = _FROZEN

    engine: str = "builtin"
    model: str = DEFAULT_MODEL
    workload: str = DEFAULT_WORKLOAD
    out: Path
    n: int = Field(1, ge=1)
    limit: int | None = Field(None, ge=1)  # the workload's first `limit` prompts only (None: all of them)
    sampling: SamplingParams = SamplingParams()
    engine_options: dict[str, Any] = Field({}, validate_default=True)  # the engine checks even none given
    part_size: int = Field(64, ge=1)
    trace_dir: Path | None = None  # a vLLM server's lpf-vllm-trace directory, joined after the run
    declared: Declared = Declared()

    @field_validator("engine_options")
    @classmethod
    def _valid_for_the_engine(cls, value: dict, info: ValidationInfo) -> dict:
        from lpf.adapters import get_engine_class

        if "engine" not in info.data:  # the engine name itself was refused: that error says why
            return value
        options = get_engine_class(info.data["engine"]).Options.parse(value)  # LpfError in one line
        return options.model_dump(include=options.model_fields_set)


class AnalysisSpec(BaseModel):
    model_config = _FROZEN

    calibrate: bool = False  # also score the reference at the engine's dtype (the noise floor)
    attribution: bool = True  # re-score flagged outputs under the prompts served beside them


class AuditSpec(BaseModel):
    model_config = _FROZEN

    version: Literal[1] = 1
    run: RunSpec
    # the command line's defaults (`lpf audit` with no rescore option): the reference where torch sees a GPU
    rescore: RescoreSettings = RescoreSettings(device="auto")
    analysis: AnalysisSpec = AnalysisSpec()
    thresholds: dict[str, int | float] = {}

    @field_validator("thresholds")
    @classmethod
    def _known_thresholds(cls, value: dict) -> dict:
        from lpf.analysis.thresholds import Thresholds

        th = Thresholds().with_overrides([f"{k}={v!r}" for k, v in value.items()])  # LpfError: unknown names
        return {name: getattr(th, name) for name in value}

    def threshold_values(self):
        """The analysis' `Thresholds`: defaults, with this spec's overrides pinned."""
        from lpf.analysis.thresholds import Thresholds

        return Thresholds().with_overrides([f"{k}={v!r}" for k, v in self.thresholds.items()])

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    def identity(self) -> dict:
        """The spec without where it goes: what two runs must share to be the same audit."""
        return self.model_dump(mode="json", exclude={"run": {"out"}})


def read_spec(run_dir: Path) -> AuditSpec | None:
    """The spec a run directory was created from (`RUN/spec.json`), or None when it has none (a run
    made before lpf wrote one). An unreadable one is an `LpfError`."""
    from pydantic import ValidationError

    from lpf.core.errors import LpfError

    path = Path(run_dir) / "spec.json"
    if not path.is_file():
        return None
    try:
        return AuditSpec.model_validate_json(path.read_text())
    except ValidationError as e:
        raise LpfError(f"{path}: not an audit spec ({e.errors(include_url=False)[0]['msg']})") from None


def replace(spec: BaseModel, **changes) -> BaseModel:
    """A copy of a spec (or any part of one) with `changes`, validated again."""
    return type(spec).model_validate({**dict(spec), **changes})


def with_run(spec: AuditSpec, **changes) -> AuditSpec:
    """`spec` with these `RunSpec` fields changed (validated again: engine options against the engine)."""
    return replace(spec, run=replace(spec.run, **changes))


# -- for people: the command line that runs the same audit ------------------------------------------
def _text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def engine_option_args(engine: str, options: dict) -> list[str]:
    """`lpf audit` arguments setting these engine options: the knob's named flag where it has one
    (lpf.core.knobs; booleans as --x/--no-x, repeatable ones once per comma-separated part), else -E."""
    from lpf.adapters import get_engine_class
    from lpf.core.knobs import knob_info

    cls = get_engine_class(engine).Options
    args: list[str] = []
    for name, value in options.items():
        k = knob_info(cls, name)
        if value is None:
            continue
        if k is None or not k.flag:
            args += ["-E", f"{name}={_text(value)}"]
        elif k.repeatable:
            args += [a for part in str(value).split(",") if part.strip() for a in (k.flag_name, part.strip())]
        elif k.kind == "bool":
            args.append(k.flag_name if value else f"--no-{k.flag_name[2:]}")
        else:
            args += [k.flag_name, _text(value)]
    return args


def audit_command(spec: AuditSpec, with_out: bool = True) -> list[str]:
    """The `lpf audit` arguments of this spec (after `lpf audit`): the run's settings always, the
    rescore and analysis settings where they differ from the defaults."""
    r, s = spec.run, spec.run.sampling
    args = [
        "--engine",
        r.engine,
        "--model",
        r.model,
        "--workload",
        r.workload,
        "--n",
        str(r.n),
        "--temperature",
        repr(s.temperature),
        "--top-p",
        repr(s.top_p),
        "--top-k",
        str(s.top_k),
        "--max-tokens",
        str(s.max_tokens),
        "--seed",
        str(s.seed),
        "--logprobs",
        str(s.logprobs),
    ]
    args += ["--ignore-eos"] * s.ignore_eos + ["--prompt-logprobs"] * s.prompt_logprobs
    if r.limit is not None:
        args += ["--limit", str(r.limit)]
    if r.trace_dir is not None:
        args += ["--trace-dir", str(r.trace_dir)]
    if r.part_size != RunSpec.model_fields["part_size"].default:
        args += ["--part-size", str(r.part_size)]
    args += engine_option_args(r.engine, r.engine_options)
    for name, value in r.declared.model_dump(exclude_none=True).items():
        args += ["--" + name.replace("_", "-"), str(value)]
    rs, default = spec.rescore, AuditSpec.model_fields["rescore"].default
    for flag, value, base in (
        ("--reference", rs.reference, default.reference),
        ("--reference-model", rs.reference_model, default.reference_model),
        ("--reference-concurrency", rs.reference_concurrency, default.reference_concurrency),
        ("--reference-dtype", rs.dtype, default.dtype),
        ("--reference-device", rs.device, default.device),
        ("--token-budget", rs.token_budget, default.token_budget),
        ("--executor", rs.executor, default.executor),
        ("--ray-address", rs.ray.address, default.ray.address),
        ("--actors", rs.ray.actors, default.ray.actors),
        ("--gpus-per-actor", rs.ray.gpus_per_actor, default.ray.gpus_per_actor),
    ):
        if value != base:
            args += [flag, _text(value)]
    args += [a for kv in rs.reference_option for a in ("-R", kv)]
    args += ["--calibrate"] * spec.analysis.calibrate + ["--no-attribution"] * (not spec.analysis.attribution)
    args += [a for name, value in spec.thresholds.items() for a in ("--threshold", f"{name}={value!r}")]
    return args + (["--out", str(r.out)] if with_out else [])
