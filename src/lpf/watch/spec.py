"""What one `lpf watch` is, and what its scoring process is: two validated values, each built one way.

Contract:
- `WatchSpec` (pydantic, extra="forbid", frozen): every `lpf watch` setting, by the option's Python name
  but `--no-text` (`keep_text`) and `--queue` (`queue_size`), plus `scorer` (False: proxy and record only,
  for tests and benches). Validation is the whole check: the upstream URL, `--listen HOST:PORT`, the
  sampling rate, `--retain`, every bound, and the executor's options as `lpf rescore` checks them (Ray
  installed, a GPU asked where the device is one), and a server reference (`--reference self` or
  http(s)://, `lpf.pipeline.reference_http`) with `--model`, the model held here for its tokenizer. A bad value is an `LpfError` or a `ValidationError`
  (`watch_error` makes it one line naming the flag).
- `build_watch_spec(params)`: the spec of `lpf watch`'s parsed options: the one builder.
- `ScorerSpec` (pydantic, extra="forbid", frozen): what the scoring process needs (reference, dtype,
  device, window, a server reference's served name and concurrency, poll, max_lag, token budget, executor
  and Ray options), `WatchSpec.scorer_spec()` its
  part of a watch. `lpf watch` writes it to `RUN/live/scorer-spec.json` and starts
  `python -m lpf.watch.scorer RUN --spec FILE`, which reads it back as `lpf audit --spec FILE|-` reads an
  AuditSpec (`--spec -`: JSON on stdin); nothing turns it into flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lpf.core.errors import LpfError
from lpf.pipeline.reference_http import reference_form

_FROZEN = ConfigDict(extra="forbid", frozen=True)
SCORER_SPEC = "live/scorer-spec.json"


class ScorerSpec(BaseModel):
    """The scoring process's settings (module docstring)."""

    model_config = _FROZEN

    reference: str
    dtype: str = "float32"
    device: str = "cpu"
    window: int = Field(50, ge=1)
    # an http(s):// or self reference (`lpf.pipeline.reference_http`): the served name, requests in flight
    reference_model: str | None = None
    reference_concurrency: int | None = Field(None, ge=1)
    poll: float = Field(0.5, gt=0)
    max_lag: int = Field(10_000, ge=1)
    token_budget: int = Field(16384, ge=1)
    executor: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    actors: int = Field(1, ge=1)
    gpus_per_actor: float = Field(0.0, ge=0)

    def ray(self):
        from lpf.pipeline.rescore import RayOptions

        return RayOptions(address=self.ray_address, actors=self.actors, gpus_per_actor=float(self.gpus_per_actor))


class WatchSpec(BaseModel):
    """Every `lpf watch` setting (module docstring)."""

    model_config = _FROZEN

    upstream: str
    reference: str
    model: str | None = None  # the model the upstream serves, held here (tokenizer, floor row): --reference's default
    reference_model: str | None = None
    reference_concurrency: int | None = Field(None, ge=1)
    out: Path
    listen: str = "127.0.0.1:8100"
    sample: float = 0.01
    seed: int = 0
    keep_text: bool = True
    window: int = Field(50, ge=1)
    top_k: int = Field(5, ge=0)
    queue_size: int = Field(1024, ge=1)
    part_rows: int = Field(256, ge=1)
    part_seconds: float = Field(2.0, gt=0)
    upstream_timeout: float | None = Field(None, gt=0)
    upstream_dtype: str | None = None
    reference_dtype: str = "float32"
    reference_device: str = "cpu"
    alert_webhook: str | None = None
    fail_after: int | None = Field(None, ge=1)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "warning"
    scorer: bool = True
    max_lag: int = Field(10_000, ge=1)
    retain: tuple[str, ...] = ()  # --retain values: a size and/or an age (lpf.watch.retention.parse_retain)
    executor: Literal["local", "ray"] = "local"  # the scorer's reference: in its process, or on Ray actors
    ray_address: str | None = None
    actors: int = Field(1, ge=1)
    gpus_per_actor: float = Field(0.0, ge=0)

    @field_validator("upstream")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise LpfError(f"--upstream must be an http(s) URL, got {value!r}")
        return value

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        _, sep, port = value.rpartition(":")
        if not sep or not port.isdigit():
            raise LpfError(f"--listen must be HOST:PORT, got {value!r}")
        return value

    @field_validator("retain")
    @classmethod
    def _retain(cls, value: tuple) -> tuple:
        from lpf.watch.retention import parse_retain

        parse_retain(value)
        return value

    @model_validator(mode="after")
    def _sampling_and_executor(self) -> "WatchSpec":
        from lpf.pipeline.rescore import RescoreSettings
        from lpf.watch.sample import Sampler

        Sampler(self.sample, self.seed)  # a bad rate is refused before anything is created
        # the executor's options checked as `lpf rescore` checks them (Ray installed, a GPU asked for cuda)
        s = self.scorer_spec()
        RescoreSettings(
            reference=s.reference,
            dtype=s.dtype,
            device=s.device,
            executor=s.executor,
            ray=s.ray(),
            reference_model=s.reference_model,
            reference_concurrency=s.reference_concurrency,
        ).validate()
        if reference_form(self.reference) == "vllm":
            raise LpfError(
                f"--reference {self.reference}: lpf watch re-scores with a model, self or http(s)://; vLLM's "
                "offline reference is lpf audit's and lpf rescore's"
            )
        if self.model is None and reference_form(self.reference) != "transformers":
            raise LpfError(
                f"--reference {self.reference} re-scores on a server: --model names the model it serves, held "
                "here (a dir, zoo:NAME or tiny:NAME: its tokenizer reads the traffic)"
            )
        return self

    @property
    def local_model(self) -> str:
        """The model held here: its tokenizer reads the traffic, its name picks the floor row."""
        return self.model or self.reference

    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "127.0.0.1", int(port)

    def scorer_spec(self) -> ScorerSpec:
        return ScorerSpec(
            reference=self.reference,
            dtype=self.reference_dtype,
            device=self.reference_device,
            window=self.window,
            reference_model=self.reference_model,
            reference_concurrency=self.reference_concurrency,
            max_lag=self.max_lag,
            executor=self.executor,
            ray_address=self.ray_address,
            actors=self.actors,
            gpus_per_actor=self.gpus_per_actor,
        )


_RENAMED = {"no_text": ("keep_text", lambda v: not v)}


def build_watch_spec(params: Mapping[str, Any]) -> WatchSpec:
    """The `WatchSpec` of `lpf watch`'s parsed options (LpfError, one line naming the flag, when one is bad)."""
    from pydantic import ValidationError

    values = {}
    for k, v in params.items():
        name, convert = _RENAMED.get(k, (k, None))
        values[name] = convert(v) if convert else v
    values["retain"] = tuple(values.get("retain") or ())
    try:
        return WatchSpec.model_validate(values)
    except ValidationError as e:
        raise LpfError(watch_error(e)) from None


def watch_error(e) -> str:
    """A spec's validation error as one line naming the flag: `--window must be >= 1, got 0`."""
    from lpf.pipeline.audit_options import options_error

    line = options_error(e, "flag")
    return "--queue" + line.removeprefix("--queue-size") if line.startswith("--queue-size") else line


def read_scorer_spec(text: str, name: str) -> ScorerSpec:
    """A `ScorerSpec` from its JSON (`name`: where it came from, for the one-line error)."""
    from pydantic import ValidationError

    try:
        return ScorerSpec.model_validate_json(text)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise LpfError(f"--spec {name}: not a scorer spec ({where + ': ' if where else ''}{first['msg']})") from None
