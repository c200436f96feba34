"""The `lpf` command line. Thin: parse, call `lpf.pipeline`, print, choose the exit code.

Exit codes everywhere: 0 fine, 1 findings at or above `--fail-on`, 2 bad usage or input (an
`LpfError`, printed as one line, never a traceback). `--json` prints findings on stdout; all
progress and summaries go to stderr so stdout stays machine-readable.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from lpf.errors import LpfError

err = Console(stderr=True)
out = Console()

FAIL_LEVELS = ("noise", "divergent", "corrupt", "never")


@contextmanager
def progress_bar(label: str, unit: str):
    """Yields (on_start(total, done), tick(n)) driving one rich progress bar on stderr. The bar
    appears at on_start, after the stage has validated its inputs, so an error prints alone."""
    p = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                 TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=False)
    task = p.add_task(label, total=None)

    def on_start(total: int, done: int) -> None:
        p.update(task, total=total, completed=done)
        p.start()

    def tick(n: int) -> None:
        p.advance(task, n)

    try:
        yield on_start, tick
    finally:
        p.stop()


def run_options(f):
    opts = [
        click.option("--engine", default="builtin", show_default=True, help="Engine under test (see `lpf engines`)."),
        click.option("--model", default=None, help="Model dir, zoo:NAME or tiny:NAME [default: zoo:hybrid]."),
        click.option("--workload", default=None, help="Prompts JSONL or zoo:NAME [default: zoo:oracle]."),
        click.option("--out", type=click.Path(path_type=Path), default=None, help="Run directory to create."),
        click.option("--n", "n", type=int, default=1, show_default=True, help="Rollouts per prompt."),
        click.option("--temperature", type=float, default=0.0, show_default=True),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
        click.option("--max-tokens", type=int, default=32, show_default=True, help="Default per request; an item's own max_tokens wins."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--ignore-eos", is_flag=True, help="Generate max_tokens even past EOS."),
        click.option("--logprobs", type=int, default=5, show_default=True, help="Top-k alternatives recorded per token."),
        click.option("--dtype", default=None, help="Engine dtype (float32, bfloat16, float16)."),
        click.option("-E", "--engine-option", "engine_option", multiple=True, metavar="KEY=VALUE",
                     help="Engine knob, e.g. -E batch_size=16 (repeatable)."),
        click.option("--inject", multiple=True, metavar="FAULT[:ARG]",
                     help="builtin engine: enable a fault drill (repeatable): " + ", ".join(_drills()) + "."),
        click.option("--cache-mb", type=float, default=None, help="builtin engine: cache size (the gpu_memory_utilization analogue)."),
        click.option("--max-num-seqs", type=int, default=None, help="Engine knob (vLLM's name)."),
        click.option("--max-num-batched-tokens", type=int, default=None, help="Engine knob (vLLM's name)."),
        click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=None, help="Engine knob (vLLM's name)."),
        click.option("--base-url", default=None, help="openai/sglang engines: the server, e.g. http://127.0.0.1:8000/v1."),
        click.option("--api-key-env", default=None, metavar="VAR",
                     help="openai/sglang engines: environment variable holding the API key (never written anywhere)."),
        click.option("--served-model", default=None,
                     help="openai engine: the name the server serves, when --model is the local copy."),
        click.option("--part-size", type=int, default=64, show_default=True, hidden=True),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def analysis_options(f):
    f = click.option("--threshold", multiple=True, metavar="NAME=VALUE", help="Override a verdict threshold (repeatable).")(f)
    f = click.option("--json", "as_json", is_flag=True, help="Print findings JSON on stdout.")(f)
    f = click.option("--fail-on", type=click.Choice(FAIL_LEVELS), default="divergent", show_default=True,
                     help="Exit 1 when any request is at or above this verdict.")(f)
    return f


def _drills() -> list[str]:
    from lpf.engine.faults import DRILLS

    return list(DRILLS)


def _run_spec(engine, model, workload, out, n, temperature, top_p, top_k, max_tokens, seed, ignore_eos,
              logprobs, dtype, engine_option, part_size, inject, cache_mb, max_num_seqs, max_num_batched_tokens,
              enable_chunked_prefill, base_url=None, api_key_env=None, served_model=None, reference=None):
    from lpf.models import DEFAULT_MODEL
    from lpf.pipeline import RunSpec
    from lpf.sampling import SamplingParams
    from lpf.workload import DEFAULT_WORKLOAD

    from lpf.knobs import engine_options

    options = engine_options(engine_option, inject, dtype=dtype, cache_mb=cache_mb, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=enable_chunked_prefill, base_url=base_url,
                             api_key_env=api_key_env, served_model=served_model)
    model = _engine_model_spec(engine, model, reference, options)
    if part_size < 1:
        raise LpfError("--part-size must be >= 1")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                              seed=seed, ignore_eos=ignore_eos, logprobs=logprobs)
    out = out or Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")
    return RunSpec(engine=engine, model=model or DEFAULT_MODEL, workload=workload or DEFAULT_WORKLOAD,
                   out=out, n=n, sampling=sampling, engine_options=options, part_size=part_size)


def _engine_model_spec(engine, model, reference, options):
    """Engines behind a server name a model that is not a local path; they pick the local one."""
    from lpf.engines import get_engine_class

    hook = getattr(get_engine_class(engine), "resolve_model_spec", None)
    return hook(model, reference, options) if hook else model


def _execute(run) -> None:
    from lpf.pipeline import execute_run

    with progress_bar("generate", "requests") as (on_start, tick):
        execute_run(run, on_start, tick)


def _rescore(run, reference, reference_dtype, token_budget, redo=False, calibrate=False) -> None:
    from lpf.pipeline import rescore_run

    with progress_bar("rescore ", "tokens") as (on_start, tick):
        rescore_run(run, reference, reference_dtype, token_budget, redo, on_start, tick)
    if calibrate:
        from lpf.calibrate_cli import calibrate_step

        calibrate_step(run, token_budget, progress_bar, err)


def _write_report(path) -> None:
    """report.html next to findings.json; a report that cannot be drawn never costs the findings."""
    from lpf.report import write_report

    try:
        err.print(f"report: {write_report(path)}", highlight=False)
    except LpfError as e:
        err.print(f"[yellow]report not written:[/] {e}", highlight=False, soft_wrap=True)
    except Exception as e:  # noqa: BLE001 - a report bug must not fail an audit whose findings are written
        err.print(f"[yellow]report not written (a bug in lpf.report, please report it):[/] "
                  f"{type(e).__name__}: {e}", highlight=False, soft_wrap=True)


def _analyze_and_report(run, threshold, as_json, fail_on) -> None:
    from lpf.analysis.thresholds import Thresholds
    from lpf.analysis.verdicts import SEVERITY
    from lpf.pipeline import analyze_run
    from lpf.summary import print_summary

    findings = analyze_run(run, Thresholds().with_overrides(list(threshold)))
    print_summary(findings, run.path, err)
    _write_report(run.path)
    if as_json:
        click.echo(json.dumps(findings, indent=2))
    if findings["n_requests"] == findings["errors"]:
        raise LpfError("nothing could be audited: every request failed (see the error column of requests)")
    if fail_on != "never" and any(SEVERITY[v] >= SEVERITY[fail_on] and c for v, c in findings["counts"].items()):
        sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="logprob-forensics")
def cli():
    """logprob-forensics: re-score an engine's exact tokens with a reference and find the requests that lie."""


@cli.command()
@run_options
@click.option("--reference", default=None, help="Reference model [default: the engine's model].")
@click.option("--reference-dtype", default="float32", show_default=True)
@click.option("--token-budget", type=int, default=16384, show_default=True, help="Rescorer tokens per batch (padding counted).")
@click.option("--calibrate", is_flag=True, help="Also score the reference at the engine's dtype: the noise floor the engine cannot move.")
@analysis_options
def audit(reference, reference_dtype, token_budget, calibrate, threshold, as_json, fail_on, **kw):
    """Run a workload on an engine, rescore it with the reference, analyze: all in one."""
    from lpf.pipeline import create_run

    run = create_run(_run_spec(reference=reference, **kw))
    err.print(f"run directory: {run.path}")
    _execute(run)
    _rescore(run, reference, reference_dtype, token_budget, calibrate=calibrate)
    _analyze_and_report(run, threshold, as_json, fail_on)


@cli.command()
@run_options
@click.option("--resume", type=click.Path(path_type=Path), default=None,
              help="Finish an interrupted run (its manifest supplies every other option).")
def run(resume, **kw):
    """Run a workload on an engine and store every token and logprob (no rescoring)."""
    from lpf.pipeline import create_run
    from lpf.run.store import RunDir

    run_dir = RunDir.open(resume) if resume else create_run(_run_spec(**kw))
    err.print(f"run directory: {run_dir.path}")
    _execute(run_dir)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--reference", default=None, help="Reference model [default: the engine's model].")
@click.option("--reference-dtype", default="float32", show_default=True)
@click.option("--token-budget", type=int, default=16384, show_default=True)
@click.option("--redo", is_flag=True, help="Drop existing reference scores and rescore everything.")
@click.option("--calibrate", is_flag=True, help="Also score the reference at the engine's dtype (calibration/), used by analyze.")
def rescore(run_dir, reference, reference_dtype, token_budget, redo, calibrate):
    """Teacher-force the reference model over a run's prompts and outputs."""
    from lpf.run.store import RunDir

    _rescore(RunDir.open(run_dir), reference, reference_dtype, token_budget, redo, calibrate)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@analysis_options
def analyze(run_dir, threshold, as_json, fail_on):
    """Re-run the analysis on a stored, rescored run and rewrite findings.json."""
    from lpf.run.store import RunDir

    _analyze_and_report(RunDir.open(run_dir), threshold, as_json, fail_on)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("sql")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
def query(run_dir, sql, fmt):
    """SQL (DuckDB) over a run: views requests, tokens, reference, summary."""
    from lpf.query import run_query
    from lpf.summary import print_rows

    columns, rows = run_query(run_dir, sql)
    print_rows(columns, rows, out, fmt)


@cli.command()
def engines():
    """List the engine adapters."""
    from lpf.engines import engine_names

    for name in engine_names():
        click.echo(name)


@cli.group()
def zoo():
    """Bundled models and workloads."""


@zoo.command("list")
def zoo_list():
    """Models (architecture, parameters, size, task accuracy) and workloads."""
    from rich import box
    from rich.table import Table

    from lpf.zoo import registry

    t = Table(title="models", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False, collapse_padding=True)
    for c in ("name", "architecture", "params", "size", "accuracy", "p(answer)", "ready"):
        t.add_column(c, min_width=16 if c == "architecture" else None)
    for m in registry.list_models():
        t.add_row(f"zoo:{m['name']}", m["architecture"].removesuffix("ForCausalLM"), f"{m['parameters']:,}" if m["parameters"] else "-",
                  f"{m['size_bytes'] / 1e6:.1f} MB" if m["size_bytes"] else "-",
                  f"{m['accuracy']:.1%}" if m["accuracy"] is not None else "-",
                  f"{m['median_answer_prob']:.3f}" if m["median_answer_prob"] is not None else "-",
                  "yes" if m["available"] else "no")
    out.print(t)
    w = Table(title="workloads", title_justify="left", box=box.SIMPLE_HEAD)
    for c in ("name", "requests", "description"):
        w.add_column(c)
    for wl in registry.list_workloads():
        w.add_row(f"zoo:{wl['name']}", str(wl["default_n"]), wl["description"])
    out.print(w)


from lpf.rl.cli import rl as _rl  # noqa: E402  (RL commands: lpf/rl/cli.py)

cli.add_command(_rl)

from lpf.serve.command import serve as _serve  # noqa: E402  (lpf serve: lpf/serve/command.py)

cli.add_command(_serve)

from lpf.report.command import report as _report  # noqa: E402  (lpf report: lpf/report/command.py)

cli.add_command(_report)

from lpf.experiments_cli import register as _register_experiments  # noqa: E402  (sweep, repeat, inspect)

_register_experiments(cli)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except LpfError as e:
        from rich.markup import escape

        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)  # [..] in a message is text
        sys.exit(2)
    except click.exceptions.Abort:
        err.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2)
