"""The engine adapter interface: what every engine under test must give back.

An adapter is constructed once per run with the resolved model, the run's sampling parameters and
its own options (knobs, validated against `Options`, unknown names refused). Three methods:
`describe()` (name, version, knobs: goes into the manifest), `generate(requests)` (yields one
`Completion` per request as each finishes, in any order) and `close()`; optionally
`side_tables()` for tables only some engines have (per-step trace, fault ground truth). Adapters return token ids and
per-token raw logprobs (+ top-k when the engine has them), never aggregates. A request the engine
cannot complete comes back with `error` set, never dropped.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

from lpf.errors import LpfError, did_you_mean
from lpf.models import ModelRef
from lpf.sampling import SamplingParams
from lpf.workload import EngineRequest


@dataclass
class Completion:
    request_id: str
    output_token_ids: list[int]
    logprobs: list[float]  # raw logprob of each output token
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str = "length"  # stop | length | error
    error: str | None = None
    t_submit: float | None = None
    t_first_token: float | None = None
    t_finish: float = field(default_factory=time.time)

    def __post_init__(self):
        # An adapter that loses logprobs must fail here, not write a run that cannot be analysed.
        if self.error is None and len(self.logprobs) != len(self.output_token_ids):
            raise ValueError(f"{self.request_id}: {len(self.logprobs)} logprobs for "
                             f"{len(self.output_token_ids)} tokens")


@dataclass(frozen=True)
class Options:
    """Base for an adapter's knobs. Subclasses add fields with defaults."""

    @classmethod
    def parse(cls, raw: dict[str, str]) -> "Options":
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, text in raw.items():
            name = key.replace("-", "_")
            if name not in known:
                raise LpfError(f"unknown engine option {key!r}{did_you_mean(name, known)}; "
                               f"this engine takes: {', '.join(sorted(known)) or 'none'}")
            values[name] = _coerce(name, text, str(known[name].type))
        return cls(**values)


def _coerce(name: str, text: Any, annotation: str) -> Any:
    """Turn a command-line string into the field's type (annotations are strings here)."""
    if not isinstance(text, str):
        return text
    if "bool" in annotation:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise LpfError(f"engine option {name}: expected true/false, got {text!r}")
    for kind, conv in (("int", int), ("float", float)):
        if kind in annotation:
            try:
                return conv(text)
            except ValueError:
                raise LpfError(f"engine option {name}: expected {kind}, got {text!r}") from None
    return text


class Engine(ABC):
    name: str = "?"
    Options: type[Options] = Options

    def __init__(self, model: ModelRef, sampling: SamplingParams, options: Options):
        self.model = model
        self.sampling = sampling
        self.options = options

    @classmethod
    def check_model(cls, config: dict) -> None:
        """Raise LpfError if this engine cannot run a model with this config.json (checked before a
        run directory is created, so a refused run writes nothing)."""

    @abstractmethod
    def describe(self) -> dict:
        """{'name', 'version', 'options'} for the manifest. Never include secrets."""

    @abstractmethod
    def generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        """Run the requests; yield each completion as soon as it is final."""

    def side_tables(self) -> dict:
        """Extra run tables gathered since the last call, e.g. {"trace": table, "faults": table}
        (None where nothing new). Engines without any return {}."""
        return {}

    def close(self) -> None:
        pass
