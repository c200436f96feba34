"""The command line's options, each declared once; commands take them as decorators.

- `engine_knob_options` (-E for every engine knob, and the named knob flags generated from the engines'
  Options fields by `KnobCommand`, the class of every command that starts an engine) and
  `engine_knobs(params)`: the knob values a command got, as one engine-options dict.
- `trace_dir_option` (a vLLM server's trace to join: run options and `lpf analyze`), `run_options`,
  `reference_options` (the rescorer's model, dtype, device and budget), `server_reference_options`,
  `rescore_options` (those + the executor + --calibrate), `fail_on_option`, `analysis_options`,
  `stream_option` (`lpf analyze`), `audit_settings_options` (what one audit is: `lpf sweep`'s cells) and
  `audit_options` (all of them: `lpf audit`'s own set).
Imports here are click and light lpf modules only: `lpf --help` must stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import click

from lpf.analysis.levels import FAIL_LEVELS
from lpf.core.errors import LpfError


def _apply(f, opts: list):
    for o in reversed(opts):
        f = o(f)
    return f


def _engine_flags(engines: tuple[str, ...] | None) -> list:
    """The flagged knobs (lpf.core.knobs) of these engines' Options, every engine when None. A flag
    that engines take with different choices (--dtype: llamacpp's GGUF types, vllm's auto) says each
    engine's in its help: the first declaration's help alone would hide the others'."""
    import dataclasses

    from lpf.adapters import engine_names, get_engine_class
    from lpf.core.knobs import choices, flag_knobs

    classes = {e: get_engine_class(e).Options for e in (engines or engine_names())}
    out = []
    for k in flag_knobs(classes.values()):
        by_engine: dict[str, list[str]] = {}
        for e, cls in classes.items():
            if k.name in cls.model_fields:
                c = choices(cls.model_fields[k.name].annotation)
                by_engine.setdefault("|".join(c) if c else "any", []).append(e)
        if len(by_engine) > 1:
            per = "; ".join(f"{', '.join(es)}: {c}" for c, es in by_engine.items())
            k = dataclasses.replace(k, help=f"{k.help} By engine: {per}.")
        out.append(k)
    return out


def _flag_option(k) -> click.Option:
    """The click option of one flagged knob: its type from the field, its help from the field's description."""
    if k.kind == "bool":
        return click.Option([f"{k.flag_name}/--no-{k.flag_name[2:]}", k.name], default=None, help=k.help)
    kind = {"int": int, "float": float}.get(k.kind, str)
    return click.Option(
        [k.flag_name, k.name], type=kind, default=None, multiple=k.repeatable, metavar=k.metavar, help=k.help
    )


class KnobCommand(click.Command):
    """A command with engine knobs (`engine_knob_options`): the named knob flags are generated from the
    engines' Options fields the first time the command parses or shows help, so `lpf --help` imports
    no engine module (and no pydantic)."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not getattr(self, "_knob_flags_added", False):
            self._knob_flags_added = True
            engines = getattr(self.callback, "__lpf_knob_engines__", None)
            at = next((i + 1 for i, p in enumerate(self.params) if p.name == "engine_option"), len(self.params))
            self.params[at:at] = [_flag_option(k) for k in _engine_flags(engines)]
        return super().get_params(ctx)


def engine_knob_options(f=None, *, engines: tuple[str, ...] | None = None):
    """The engine knobs: -E KEY=VALUE for every knob, and a named option for each flagged knob of these
    engines (all by default), generated from their Options fields by `KnobCommand` (the command's
    class: `@click.command(cls=KnobCommand)`). Each engine refuses knobs it lacks."""

    def apply(g):
        g.__lpf_knob_engines__ = engines
        return click.option(
            "-E",
            "--engine-option",
            "engine_option",
            multiple=True,
            metavar="KEY=VALUE",
            help="Any other engine knob, e.g. -E block_size=32 (repeatable; `lpf engines` lists them).",
        )(g)

    return apply if f is None else apply(f)


def engine_knobs(params: Mapping, engines: tuple[str, ...] | None = None) -> dict:
    """{knob: value} of every knob given (None = not given, left out; -E values stay strings: the
    engine's `Options.parse` converts and validates them); a named option wins over -E. A repeatable
    flag's values are joined with ","."""
    options = {}
    for kv in params.get("engine_option") or ():
        key, sep, value = kv.partition("=")
        if not sep:
            raise LpfError(f"--engine-option expects KEY=VALUE, got {kv!r}")
        options[key.strip()] = value.strip()
    for k in _engine_flags(engines):
        value = params.get(k.name)
        if k.repeatable:
            value = ",".join(value) if value else None
        if value is not None:
            options[k.name] = value
    return options


def trace_dir_option(f):
    return click.option(
        "--trace-dir",
        type=click.Path(path_type=Path),
        default=None,
        metavar="DIR",
        help="openai engine: the LPF_VLLM_TRACE_DIR of the vLLM server (with lpf-vllm-trace) "
        "that served the run; its step trace is joined to the run by request id.",
    )(f)


def _run_settings(f):
    """What a run is, but where it goes: engine, model, workload, sampling, knobs."""
    f = trace_dir_option(engine_knob_options(f))
    return _apply(
        f,
        [
            click.option(
                "--engine", default="builtin", show_default=True, help="Engine under test (see `lpf engines`)."
            ),
            click.option("--model", default=None, help="Model dir, zoo:NAME or tiny:NAME [default: zoo:hybrid]."),
            click.option("--workload", default=None, help="Prompts JSONL or zoo:NAME [default: zoo:oracle]."),
            click.option(
                "--n",
                "n",
                type=int,
                default=1,
                show_default=True,
                help="Rollouts per prompt (each prompt is sent N times; --limit shrinks a workload).",
            ),
            click.option(
                "--limit",
                type=int,
                default=None,
                metavar="N",
                help="Audit the workload's first N prompts only [default: all].",
            ),
            click.option("--temperature", type=float, default=0.0, show_default=True),
            click.option("--top-p", type=float, default=1.0, show_default=True),
            click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
            click.option(
                "--max-tokens",
                type=int,
                default=32,
                show_default=True,
                help="Default per request; an item's own max_tokens wins.",
            ),
            click.option("--seed", type=int, default=0, show_default=True),
            click.option("--ignore-eos", is_flag=True, help="Generate max_tokens even past EOS."),
            click.option(
                "--logprobs", type=int, default=5, show_default=True, help="Top-k alternatives recorded per token."
            ),
            click.option(
                "--prompt-logprobs",
                is_flag=True,
                help="Also record the engine's logprob of every prompt token (the prefill path), audited apart.",
            ),
            click.option("--part-size", type=int, default=64, show_default=True, hidden=True),
            click.option(
                "--kv-cache-dtype",
                default=None,
                metavar="TYPE",
                help="Declare the engine's KV cache type where lpf cannot read it (f32, f16, bf16, q8_0, q4_0, "
                "fp8_e4m3, fp8_e5m2, ...): recorded in the manifest's engine.configuration.",
            ),
            click.option(
                "--flash-attention",
                type=click.Choice(["on", "off"]),
                default=None,
                help="Declare whether the engine runs flash attention, where lpf cannot read it.",
            ),
            click.option(
                "--weight-quantization",
                default=None,
                metavar="SCHEME",
                help="Declare the engine's weight quantization (none, q8_0, q4_k_m, int8, fp8, awq, ...).",
            ),
        ],
    )


def out_option(f):
    return click.option("--out", type=click.Path(path_type=Path), default=None, help="Run directory to create.")(f)


def run_options(f):
    """What a run is: engine, model, workload, sampling, knobs, where it goes."""
    return _run_settings(out_option(f))


WHERE_HELP = (
    "Where the reference runs: a model (transformers here), http(s)://HOST:PORT/v1 (a trusted deployment of "
    "the same model) or self (the audited server) [default: the engine's model]."
)


def reference_options(f, where: bool | str = False):
    """The reference rescorer: which model, its dtype and device, its batch budget (`lpf rescore`, `lpf rl rescore`);
    `where`: --reference also takes a server (`rescore_options`: `lpf audit`, `lpf rescore`), or that help text."""
    return _apply(
        f,
        [
            click.option(
                "--reference",
                default=None,
                help=where
                if isinstance(where, str)
                else WHERE_HELP
                if where
                else "Reference model [default: the engine's model].",
            ),
            click.option("--reference-dtype", default="float32", show_default=True),
            click.option(
                "--reference-device",
                type=click.Choice(["cpu", "cuda", "auto"]),
                default="auto",
                show_default=True,
                help="Where the reference runs (auto: a GPU when torch sees one).",
            ),
            click.option(
                "--token-budget",
                type=int,
                default=16384,
                show_default=True,
                help="Rescorer tokens per batch (padding counted).",
            ),
        ],
    )


def server_reference_options(f):
    """A server or vLLM reference's settings: its served name, requests in flight, -R knobs (`lpf audit`,
    `lpf rescore`, `lpf rl rescore`)."""
    return _apply(
        f,
        [
            click.option(
                "--reference-model",
                default=None,
                metavar="NAME",
                help="--reference http(s)://HOST:PORT/v1: the name that server serves.",
            ),
            click.option(
                "--reference-concurrency",
                type=int,
                default=None,
                metavar="N",
                help="--reference http(s)://... or self: requests in flight [default: 8; self: 1].",
            ),
            click.option(
                "-R",
                "--reference-option",
                multiple=True,
                metavar="KEY=VALUE",
                help="--reference vllm:MODEL: a vLLM knob of the reference (tensor_parallel_size, batch_invariant, "
                "max_num_seqs with batch_invariant, max_model_len, ...).",
            ),
        ],
    )


def rescore_options(f):
    """How a run is rescored: the reference options, the server reference's, the executor, and --calibrate."""
    return _apply(
        server_reference_options(reference_options(f, where=True)),
        [
            click.option(
                "--executor",
                type=click.Choice(["local", "ray"]),
                default="local",
                show_default=True,
                help="local: in this process; ray: an actor pool of rescorers on Ray Data (the [ray] extra).",
            ),
            click.option(
                "--ray-address",
                default=None,
                metavar="ADDR",
                help="--executor ray: the cluster to join, e.g. ray://head:10001 [default: a local Ray].",
            ),
            click.option(
                "--actors",
                type=click.IntRange(min=1),
                default=1,
                show_default=True,
                help="--executor ray: rescorer actors (one CPU each).",
            ),
            click.option(
                "--gpus-per-actor",
                type=click.FloatRange(min=0),
                default=0,
                show_default=True,
                help="--executor ray: GPUs per actor (0: CPU actors).",
            ),
            click.option(
                "--calibrate",
                is_flag=True,
                help="Also score the reference at the engine's dtype: the noise floor the engine cannot move.",
            ),
        ],
    )


def fail_on_option(what: str = "any request"):
    return click.option(
        "--fail-on",
        type=click.Choice(FAIL_LEVELS),
        default="divergent",
        show_default=True,
        help=f"Exit 1 when {what} is at or above this verdict.",
    )


def _analysis_settings(f):
    return _apply(
        f,
        [
            click.option(
                "--threshold", multiple=True, metavar="NAME=VALUE", help="Override a verdict threshold (repeatable)."
            ),
            click.option(
                "--attribution/--no-attribution",
                default=True,
                show_default=True,
                help="Re-score flagged outputs under the prompts of requests served alongside them "
                "(whose answer is this?).",
            ),
        ],
    )


def analysis_options(f):
    f = _analysis_settings(f)
    return _apply(
        f,
        [
            click.option("--json", "as_json", is_flag=True, help="Print findings JSON on stdout."),
            fail_on_option(),
        ],
    )


def stream_option(f):
    return click.option(
        "--stream/--no-stream",
        default=None,
        help="Analyse the run streamed, chunk by chunk in bounded memory (the same findings), or "
        "all in memory. Default: streamed above 10M tokens, unless the run has a calibration "
        "run or prompt logprobs (read in memory).",
    )(f)


def audit_settings_options(f):
    """What one audit is, without where it goes or what it prints (run + rescore + analysis settings):
    `lpf audit`'s options but --out, --json and --fail-on; `lpf sweep` takes these for its cells."""
    return _run_settings(rescore_options(_analysis_settings(f)))


def audit_options(f):
    """`lpf audit`'s whole option set (run + rescore + analysis)."""
    return run_options(rescore_options(analysis_options(f)))
