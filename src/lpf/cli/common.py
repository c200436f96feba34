"""What every command module shares; command modules import this and `render`, never each other.

- `err` / `out`: stderr (progress, summaries, errors) and stdout (`--json` documents, and tables that
  are the command's output).
- `progress_bar(label, unit)`: one rich bar on stderr, shown once the stage has validated its inputs;
  `progress_bars(*stages)` several, for stages that run one after another in one call.
- Option decorators, each option declared once: `engine_knob_options` (the engine knobs, on every
  command that starts an engine), `trace_dir_option` (a vLLM server's trace to join: run options and
  `lpf analyze`), `run_options`, `reference_options` (the rescorer's model, dtype, device and budget),
  `rescore_options` (those + the executor + --calibrate), `analysis_options`, `stream_option`
  (`lpf analyze`), and `audit_options` (all of
  them: `lpf audit`'s own set, which `sweep` also parses cells with).
- `rescore_settings(params)` / `rescore_args(params)`: parsed rescore options as the stage's
  settings, and back as `lpf rescore` arguments.
- `engine_knobs(params)`: the knob values a command got, as one engine-options dict;
  `knob_args(options)` is its inverse (the audit arguments that set engine options).
- `build_run_spec(params)`: the one run-spec builder, from parsed run options.
- `parse_audit_args(argv, what)`: an `lpf audit` argument list parsed into its params.
- `write_report(path)`: the one rule for writing report.html after findings exist.
- `fails(verdicts, fail_on)`: the one `--fail-on` rule.
Imports here are click, rich and light lpf modules only: `lpf --help` must stay fast.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Mapping

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from lpf.analysis.levels import FAIL_LEVELS, at_or_above
from lpf.builtin.faults import DRILLS
from lpf.errors import LpfError

err = Console(stderr=True)
out = Console()


@contextmanager
def progress_bar(label: str, unit: str):
    """Yields (on_start(total, done), tick(n)) driving one rich progress bar on stderr. The bar
    appears at on_start, after the stage has validated its inputs, so an error prints alone."""
    with progress_bars((label, unit)) as bars:
        yield bars[0]


@contextmanager
def progress_bars(*stages: tuple[str, str]):
    """`progress_bar` for stages that run one after another inside one call: a list of
    (on_start, tick) pairs, one (label, unit) each, as bars of one display, each shown at its on_start."""
    p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                 TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                 console=err, transient=False)

    def pair(label: str, unit: str):
        task = p.add_task(label, total=None, unit=unit, visible=False)

        def on_start(total: int, done: int = 0) -> None:
            p.update(task, total=total, completed=done, visible=True)
            p.start()

        def tick(n: int) -> None:
            p.advance(task, n)

        return on_start, tick

    try:
        yield [pair(label, unit) for label, unit in stages]
    finally:
        p.stop()


def _apply(f, opts: list):
    for o in reversed(opts):
        f = o(f)
    return f


# -- options ----------------------------------------------------------------------------------------
KNOB_PARAMS = ("dtype", "engine_option", "inject", "cache_mb", "max_num_seqs", "max_num_batched_tokens",
               "enable_chunked_prefill", "enable_prefix_caching")


def engine_knob_options(f):
    """The engine knobs, under vLLM's names where vLLM has one. Each engine refuses knobs it lacks."""
    return _apply(f, [
        click.option("--dtype", default=None, help="Engine dtype: float32, bfloat16 or float16."),
        click.option("-E", "--engine-option", "engine_option", multiple=True, metavar="KEY=VALUE",
                     help="Any other engine knob, e.g. -E block_size=32 (repeatable; `lpf engines` lists them)."),
        click.option("--inject", multiple=True, metavar="FAULT[:ARG]",
                     help="Fault drill (repeatable): built-in engine " + ", ".join(DRILLS) + "; vllm engine "
                          "stale-state, offset-wrap[:BITS] (through lpf-vllm-trace)."),
        click.option("--cache-mb", type=float, default=None,
                     help="Built-in engine: cache size in MiB (the gpu_memory_utilization analogue)."),
        click.option("--max-num-seqs", type=int, default=None, help="Most requests in one engine step (vLLM's name)."),
        click.option("--max-num-batched-tokens", type=int, default=None,
                     help="Token budget of one engine step (vLLM's name)."),
        click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=None,
                     help="Split long prompts over several steps (vLLM's name)."),
        click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
                     help="Reuse cached prefixes: KV blocks by hash, Mamba state checkpoints (vLLM's name; "
                          "built-in: -E mamba_block_size=N, -E mamba_cache_mode=align|all)."),
    ])


def engine_knobs(params: Mapping, **extra) -> dict:
    """{knob: value} of every knob given (None = not given, left out; -E values stay strings: the
    engine's `Options.parse` converts and validates them); `extra` adds named options the same way."""
    options = {}
    for kv in params.get("engine_option") or ():
        key, sep, value = kv.partition("=")
        if not sep:
            raise LpfError(f"--engine-option expects KEY=VALUE, got {kv!r}")
        options[key.strip()] = value.strip()
    named = {k: params.get(k) for k in KNOB_PARAMS if k not in ("engine_option", "inject")}
    named["inject"] = ",".join(params["inject"]) if params.get("inject") else None
    named.update(extra)
    options.update({k: v for k, v in named.items() if v is not None})
    return options


# engine options that have an option of their own on the command line (the rest go through -E)
_NAMED_KNOBS = {"dtype": "--dtype", "cache_mb": "--cache-mb", "max_num_seqs": "--max-num-seqs",
                "max_num_batched_tokens": "--max-num-batched-tokens", "base_url": "--base-url",
                "api_key_env": "--api-key-env", "served_model": "--served-model", "api": "--api"}


def knob_args(options: Mapping) -> list[str]:
    """The `lpf audit` arguments that set these engine options (the inverse of `engine_knobs`):
    the named option where there is one, `-E NAME=VALUE` otherwise; None values are left out."""
    def text(v) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else str(v)

    args: list[str] = []
    for name, value in options.items():
        if value is None:
            continue
        if name == "inject":
            args += [a for drill in str(value).split(",") if drill.strip() for a in ("--inject", drill.strip())]
        elif name in ("enable_chunked_prefill", "enable_prefix_caching"):
            flag = name.replace("_", "-")
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif name in _NAMED_KNOBS:
            args += [_NAMED_KNOBS[name], text(value)]
        else:
            args += ["-E", f"{name}={text(value)}"]
    return args


def trace_dir_option(f):
    return click.option("--trace-dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
                        help="openai engine: the LPF_VLLM_TRACE_DIR of the vLLM server (with lpf-vllm-trace) "
                             "that served the run; its step trace is joined to the run by request id.")(f)


def run_options(f):
    """What a run is: engine, model, workload, sampling, knobs, where it goes."""
    f = trace_dir_option(engine_knob_options(f))
    return _apply(f, [
        click.option("--engine", default="builtin", show_default=True, help="Engine under test (see `lpf engines`)."),
        click.option("--model", default=None, help="Model dir, zoo:NAME or tiny:NAME [default: zoo:hybrid]."),
        click.option("--workload", default=None, help="Prompts JSONL or zoo:NAME [default: zoo:oracle]."),
        click.option("--out", type=click.Path(path_type=Path), default=None, help="Run directory to create."),
        click.option("--n", "n", type=int, default=1, show_default=True, help="Rollouts per prompt."),
        click.option("--temperature", type=float, default=0.0, show_default=True),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
        click.option("--max-tokens", type=int, default=32, show_default=True,
                     help="Default per request; an item's own max_tokens wins."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--ignore-eos", is_flag=True, help="Generate max_tokens even past EOS."),
        click.option("--logprobs", type=int, default=5, show_default=True, help="Top-k alternatives recorded per token."),
        click.option("--prompt-logprobs", is_flag=True,
                     help="Also record the engine's logprob of every prompt token (the prefill path), audited apart."),
        click.option("--base-url", default=None, help="openai/sglang/llamacpp engines: the server, e.g. http://127.0.0.1:8000/v1."),
        click.option("--api-key-env", default=None, metavar="VAR",
                     help="openai/sglang engines: environment variable holding the API key (never written anywhere)."),
        click.option("--served-model", default=None,
                     help="openai engine: the name the server serves, when --model is the local copy."),
        click.option("--api", type=click.Choice(["auto", "completions", "chat"]), default=None,
                     help="openai engine: /v1/completions or /v1/chat/completions (auto: chat when the workload has messages)."),
        click.option("--part-size", type=int, default=64, show_default=True, hidden=True),
    ])


RESCORE_PARAMS = ("reference", "reference_dtype", "token_budget", "reference_device", "executor", "ray_address",
                  "actors", "gpus_per_actor")


def reference_options(f):
    """The reference rescorer: which model, its dtype and device, its batch budget (`lpf rescore`, `lpf rl rescore`)."""
    return _apply(f, [
        click.option("--reference", default=None, help="Reference model [default: the engine's model]."),
        click.option("--reference-dtype", default="float32", show_default=True),
        click.option("--reference-device", type=click.Choice(["cpu", "cuda", "auto"]), default="auto",
                     show_default=True, help="Where the reference runs (auto: a GPU when torch sees one)."),
        click.option("--token-budget", type=int, default=16384, show_default=True,
                     help="Rescorer tokens per batch (padding counted)."),
    ])


def rescore_options(f):
    """How a run is rescored: the reference options, the executor, and --calibrate."""
    return _apply(reference_options(f), [
        click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                     help="local: in this process; ray: an actor pool of rescorers on Ray Data (the [ray] extra)."),
        click.option("--ray-address", default=None, metavar="ADDR",
                     help="--executor ray: the cluster to join, e.g. ray://head:10001 [default: a local Ray]."),
        click.option("--actors", type=click.IntRange(min=1), default=1, show_default=True,
                     help="--executor ray: rescorer actors (one CPU each)."),
        click.option("--gpus-per-actor", type=click.FloatRange(min=0), default=0, show_default=True,
                     help="--executor ray: GPUs per actor (0: CPU actors)."),
        click.option("--calibrate", is_flag=True,
                     help="Also score the reference at the engine's dtype: the noise floor the engine cannot move."),
    ])


def rescore_settings(params: Mapping):
    """The `RescoreSettings` of parsed rescore options (validated)."""
    from lpf.pipeline.rescore import RayOptions, RescoreSettings

    settings = RescoreSettings(
        reference=params.get("reference"), dtype=params["reference_dtype"], token_budget=params["token_budget"],
        device=params["reference_device"], executor=params["executor"],
        ray=RayOptions(address=params.get("ray_address"), actors=params["actors"],
                       gpus_per_actor=float(params["gpus_per_actor"])))
    settings.validate()
    return settings


def rescore_args(params: Mapping) -> list[str]:
    """The `lpf rescore` arguments that reproduce parsed rescore options (a sweep cell's resume)."""
    args = []
    for name in RESCORE_PARAMS:
        value = params.get(name)
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def fail_on_option(what: str = "any request"):
    return click.option("--fail-on", type=click.Choice(FAIL_LEVELS), default="divergent", show_default=True,
                        help=f"Exit 1 when {what} is at or above this verdict.")


def analysis_options(f):
    return _apply(f, [
        click.option("--threshold", multiple=True, metavar="NAME=VALUE", help="Override a verdict threshold (repeatable)."),
        click.option("--attribution/--no-attribution", default=True, show_default=True,
                     help="Re-score flagged outputs under the prompts of requests served alongside them "
                          "(whose answer is this?)."),
        click.option("--json", "as_json", is_flag=True, help="Print findings JSON on stdout."),
        fail_on_option(),
    ])


def stream_option(f):
    return click.option("--stream/--no-stream", default=None,
                        help="Analyse the run streamed, chunk by chunk in bounded memory (the same findings), or "
                             "all in memory. Default: streamed above 10M tokens, unless the run has a calibration "
                             "run or prompt logprobs (read in memory).")(f)


def audit_options(f):
    """`lpf audit`'s whole option set (run + rescore + analysis)."""
    return run_options(rescore_options(analysis_options(f)))


def _audit_parser() -> click.Command:
    """A command with exactly `lpf audit`'s options, to parse argument lists without running anything."""
    return click.command("audit")(audit_options(lambda **kw: kw))


def parse_audit_args(argv: list[str], what: str) -> dict:
    """`lpf audit` arguments parsed into their params (defaults filled), or LpfError naming `what`."""
    try:
        with _audit_parser().make_context("audit", list(argv), resilient_parsing=False) as ctx:
            return dict(ctx.params)
    except click.ClickException as e:
        raise LpfError(f"{what}: {e.format_message()}") from None


def audit_option_kinds() -> dict[str, str]:
    """`lpf audit` option name -> kind (option | switch | flag | multi), for sweep knobs."""
    kinds = {}
    for p in _audit_parser().params:
        if not isinstance(p, click.Option) or p.hidden:
            continue
        kind = ("switch" if p.secondary_opts else "flag") if p.is_flag else ("multi" if p.multiple else "option")
        for opt in p.opts:
            if opt.startswith("--"):
                kinds[opt[2:]] = kind
    return kinds


# -- building a run ---------------------------------------------------------------------------------
def build_run_spec(params: Mapping):
    """The `RunSpec` of parsed run options (`run_options`' params; others are ignored). Engines
    behind a server name a model that is not a local path: their adapter picks the local one."""
    from lpf.adapters import get_engine_class
    from lpf.model_specs import DEFAULT_MODEL
    from lpf.pipeline import RunSpec
    from lpf.sampling import SamplingParams
    from lpf.workload import DEFAULT_WORKLOAD

    p = params
    options = engine_knobs(p, base_url=p.get("base_url"), api_key_env=p.get("api_key_env"),
                           served_model=p.get("served_model"), api=p.get("api"))
    hook = getattr(get_engine_class(p["engine"]), "resolve_model_spec", None)
    model = hook(p.get("model"), p.get("reference"), options) if hook else p.get("model")
    if p["part_size"] < 1:
        raise LpfError("--part-size must be >= 1")
    sampling = SamplingParams(temperature=p["temperature"], top_p=p["top_p"], top_k=p["top_k"],
                              max_tokens=p["max_tokens"], seed=p["seed"], ignore_eos=p["ignore_eos"],
                              logprobs=p["logprobs"], prompt_logprobs=bool(p.get("prompt_logprobs")))
    out_dir = p.get("out") or Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")
    return RunSpec(engine=p["engine"], model=model or DEFAULT_MODEL, workload=p.get("workload") or DEFAULT_WORKLOAD,
                   out=out_dir, n=p["n"], sampling=sampling, engine_options=options, part_size=p["part_size"],
                   trace_dir=p.get("trace_dir"))


def default_out(kind: str) -> Path:
    return Path("runs") / time.strftime(f"{kind}-%Y%m%d-%H%M%S")


# -- after findings ---------------------------------------------------------------------------------
def write_report(path: Path) -> Path | None:
    """report.html in a directory whose findings are already written; prints its path or why not.
    A report that cannot be drawn never costs the findings: every failure is a warning here."""
    from rich.markup import escape

    try:
        from lpf.report import write_report as write

        written = write(path)
    except LpfError as e:
        err.print(f"[yellow]report not written:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return None
    except Exception as e:  # noqa: BLE001 - a report bug must not fail a command whose findings are written
        err.print(f"[yellow]report not written (a bug in lpf.report, please report it):[/] "
                  f"{type(e).__name__}: {escape(str(e))}", highlight=False, soft_wrap=True)
        return None
    err.print(f"report: {written}", highlight=False)
    return written


def fails(verdicts: Iterable[str | None], fail_on: str) -> bool:
    """Whether any of `verdicts` is at or above the `--fail-on` level (exit 1)."""
    return any(at_or_above(v, fail_on) for v in verdicts)
