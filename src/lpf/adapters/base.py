"""The engine adapter interface: what every engine under test must give back.

An adapter is constructed once per run with the resolved model, the run's sampling parameters and
its own options (knobs: a pydantic `Options` model whose fields say types and ranges; unknown names
are refused with a did-you-mean). Three methods:
`describe()` (name, version, knobs: goes into the manifest; `configuration()` what the engine says of its
own dtype, KV cache, flash attention, weights and sampling defaults), `generate(requests)` (yields one
`Completion` per request as each finishes, in any order) and `close()`; optionally
`side_tables()` for tables only some engines have (per-step trace, fault ground truth). What an engine
can do beyond that is said by class attributes (`supports_prompt_logprobs`, `trace_source`, `state_slots`,
`server`, `locate_replay`, `seeded_replay`, `discovers_architectures`, `repro_script`, `kept_worker`) that
callers ask through
`lpf.adapters.capability(name, attr)`, never by the engine's name. Adapters return token ids and
per-token raw logprobs (+ top-k when the engine has them), never aggregates. A request the engine
cannot complete comes back with `error` set, never dropped. Before a run starts, `check_model(config)`
and `check_capacity(model, options, requests)` refuse what the engine can never run.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError

from lpf.core.errors import LpfError, did_you_mean
from lpf.core.model_specs import ModelRef
from lpf.core.sampling import SamplingParams
from lpf.core.workload import EngineRequest


@dataclass
class Completion:
    request_id: str
    output_token_ids: list[int]
    logprobs: list[float | None]  # raw logprob of each output token (None: the server returned none)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str = "length"  # stop | length | error
    error: str | None = None
    t_submit: float | None = None
    t_first_token: float | None = None
    t_finish: float = field(default_factory=time.time)
    # evidence kept as returned: why the answer failed a consistency check (None: it passed), and every
    # attempt to get it (HTTP engines: dicts with the `schema.ATTEMPT` fields)
    inconsistency: str | None = None
    attempts: list[dict] = field(default_factory=list)
    # prompt logprobs (`--prompt-logprobs`), per prompt position 1..P-1: None when not asked or not given
    prompt_logprobs: list[float] | None = None
    prompt_topk_ids: list[list[int]] = field(default_factory=list)
    prompt_topk_logprobs: list[list[float]] = field(default_factory=list)
    # the engine's own rank of each prompt token (1 = its argmax; vLLM gives one), None where not given
    prompt_ranks: list[int | None] | None = None

    @classmethod
    def failed(cls, request_id: str, error: str, **kw) -> "Completion":
        """A request that got no answer, with why (`kw`: the evidence kept beside it, e.g. attempts)."""
        return cls(request_id=request_id, output_token_ids=[], logprobs=[], finish_reason="error", error=error, **kw)

    def __post_init__(self):
        # An adapter that loses logprobs must fail here, not write a run that cannot be analysed.
        if self.error is None and len(self.logprobs) != len(self.output_token_ids):
            raise ValueError(
                f"{self.request_id}: {len(self.logprobs)} logprobs for {len(self.output_token_ids)} tokens"
            )


class Options(BaseModel):
    """Base for an adapter's knobs: a frozen pydantic model that refuses unknown names. Subclasses
    declare typed fields with their defaults and ranges (`Field(ge=1)`, `Literal[...]`), so types,
    ranges and "did you mean" come from one place for every engine; `parse` takes the command
    line's strings or a manifest's stored values and raises `LpfError` with one line."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> "Options":
        known = cls.model_fields
        values: dict[str, Any] = {}
        for key, value in raw.items():
            name = key.replace("-", "_")
            if name not in known:
                raise LpfError(
                    f"unknown engine option {key!r}{did_you_mean(name, known)}; "
                    f"this engine takes: {', '.join(sorted(known)) or 'none'}"
                )
            values[name] = value
        try:
            return cls(**values)
        except ValidationError as e:
            raise LpfError(option_error(e)) from None

    @classmethod
    def default(cls, name: str) -> Any:
        return cls.model_fields[name].default

    def to_dict(self) -> dict:
        return self.model_dump()


_RANGE_WORDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_TYPE_WORDS = {
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "int_type": "expected an integer",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "bool_parsing": "expected true/false",
    "bool_type": "expected true/false",
    "string_type": "expected text",
}


def option_error(e: ValidationError) -> str:
    """The first problem of a validation error as one line: `NAME must be >= 1, got 0`."""
    err = e.errors(include_url=False)[0]
    name = ".".join(str(p) for p in err.get("loc", ())) or "engine options"
    kind, ctx, got = err.get("type", ""), err.get("ctx") or {}, err.get("input")
    if kind in _RANGE_WORDS:
        bound = next(iter(v for k, v in ctx.items() if k in ("gt", "ge", "lt", "le")), "?")
        return f"{name} must be {_RANGE_WORDS[kind]} {bound}, got {got!r}"
    if kind == "literal_error":
        return f"{name} must be {ctx.get('expected', '?')}, got {got!r}"
    if kind in _TYPE_WORDS:
        return f"engine option {name}: {_TYPE_WORDS[kind]}, got {got!r}"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return msg if not err.get("loc") else f"engine option {name}: {msg}"


CAPABILITY_WORDS = {  # how `lpf engines` names each capability that is set
    "supports_prompt_logprobs": "prompt logprobs",
    "trace_source": "trace ({})",
    "state_slots": "state slots",
    "server": "server (HTTP)",
    "locate_replay": "lpf locate",
    "seeded_replay": "seeded replay",
    "discovers_architectures": "lpf conformance",
    "repro_script": "repro.py",
    "kept_worker": "kept worker",
}


def capabilities(engine_cls) -> list[str]:
    """The capabilities this engine class sets, in words (`lpf engines`)."""
    out = []
    for attr, words in CAPABILITY_WORDS.items():
        value = getattr(engine_cls, attr)
        if value:
            out.append(words.format(value))
    return out


class Engine(ABC):
    name: str = "?"
    Options: type[Options] = Options
    # -- capabilities: what callers ask an engine class (never a list of engine names; `capability`) --
    # whether `generate` fills Completion.prompt_logprobs when the run's sampling asks for them
    supports_prompt_logprobs: bool = False
    # where a run's step trace comes from: "own" (the adapter's `side_tables()["trace"]`), "joined" (a
    # server's lpf-vllm-trace directory, joined after the run with --trace-dir), None (none to have)
    trace_source: str | None = None
    # whether the trace names each request's recurrent-state slot (`state_slot`: slot-reuse evidence)
    state_slots: bool = False
    # the engine under test answers over HTTP: tokens and logprobs only, no activations to capture
    server: bool = False
    # how `lpf locate` replays one request op by op: "lpf.locate.replays:NAME" (run, target, upto) -> EngineSide
    locate_replay: str | None = None
    # whether lpf can redraw the engine's sampled tokens on the reference's logits (`lpf.pipeline.replay`)
    seeded_replay: bool = False
    # whether `lpf conformance` can ask the engine which architectures it loads (experiments.conformance.discover)
    discovers_architectures: bool = False
    # whether `lpf shrink` writes a standalone repro.py for it (experiments.shrink.repro_script)
    repro_script: bool = False
    # whether a sweep or shrink cell may run in a kept worker (an in-process engine: experiments.kept_cells)
    kept_worker: bool = False

    def __init__(self, model: ModelRef, sampling: SamplingParams, options: Options):
        self.model = model
        self.sampling = sampling
        self.options = options

    @classmethod
    def check_model(cls, config: dict) -> None:
        """Raise LpfError if this engine cannot run a model with this config.json (checked before a
        run directory is created, so a refused run writes nothing)."""

    @classmethod
    def chat_prompts(cls, options: Options) -> bool | None:
        """Whether this engine takes the workload as chat turns (True: render every prompt with the chat
        template; None: when the workload has `messages`); engines that take token ids say False."""
        return False

    @classmethod
    def check_capacity(cls, model: ModelRef, options: Options, requests: list[EngineRequest]) -> None:
        """Raise LpfError when this configuration could hold none of `requests` (checked before a run
        directory is created: a run of nothing but errors is refused, not started)."""

    @abstractmethod
    def describe(self) -> dict:
        """{'name', 'version', 'options'} for the manifest. Never include secrets."""

    def configuration(self) -> dict:
        """What the engine says of its own configuration, {field: (value, via)} (`lpf.run.configuration`
        fields; `lpf.adapters.engine_config` reads them): the manifest's `engine.configuration` with what
        the user declared. Engines that cannot tell return {}."""
        return {}

    @abstractmethod
    def generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        """Run the requests; yield each completion as soon as it is final."""

    def side_tables(self) -> dict:
        """Extra run tables gathered since the last call, e.g. {"trace": table, "faults": table}
        (None where nothing new). Engines without any return {}."""
        return {}

    def close(self) -> None:
        pass
