"""`lpf audit`, `lpf run`, `lpf rescore`, `lpf analyze`: the pipeline's stages, one command each.

`audit` is `run` + `rescore` (+ the calibration run with `--calibrate`) + `analyze`. Every stage
validates its inputs before it writes anything, shows a progress bar on stderr and leaves a run
directory that the next stage (or `--resume`) can pick up.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lpf.cli.audit_spec import build_audit_spec, rescore_settings
from lpf.cli.common import err, fails, progress_bar, progress_bars, write_report
from lpf.cli.options import (
    KnobCommand,
    analysis_options,
    audit_options,
    rescore_options,
    run_options,
    stream_option,
    trace_dir_option,
)
from lpf.cli.render import print_calibration, print_failures, print_summary
from lpf.core.errors import LpfError


def _generate(run) -> None:
    from lpf.pipeline import all_failed, execute_run, failed_requests

    with progress_bar("generate", "requests") as (on_start, tick):
        execute_run(run, on_start, tick)
    line = failed_requests(run)
    if line and not all_failed(run):  # when every request failed, the run ends with that line (exit 2)
        print_failures(line, err)
    if run.manifest.get("trace_dir"):
        _join(run, run.manifest["trace_dir"])


def _join(run, trace_dir) -> None:
    from rich.markup import escape

    from lpf.pipeline import join_trace

    info = join_trace(run, trace_dir)
    err.print(
        f"joined {info['rows']} trace rows from {escape(str(trace_dir))}"
        if info["recorded"]
        else f"[yellow]no trace joined:[/] {escape(info['why'] or '')}",
        highlight=False,
    )


def _rescore(run, settings, redo=False, calibrate=False) -> None:
    from lpf.pipeline import calibrate_run, rescore_run

    with progress_bar("rescore ", "tokens") as (on_start, tick):
        rescore_run(run, redo=redo, on_start=on_start, tick=tick, settings=settings)
    if calibrate:
        with progress_bar("calibrate", "tokens") as (on_start, tick):
            cal = calibrate_run(run, settings.token_budget, on_start, tick, device=settings.device)
        print_calibration(cal, run.path, err)


def _analyze(run, thresholds, as_json, fail_on, attribution=True, stream=None, tokens_only=False) -> None:
    from lpf.pipeline import analyze_run

    with progress_bars(("analyze  ", "tokens"), ("attribute", "tokens")) as (analysis, (on_start, tick)):
        findings = analyze_run(
            run, thresholds, attribution, on_start, tick, stream=stream, progress=analysis, tokens_only=tokens_only
        )
    print_summary(findings, run.path, err)
    write_report(run.path)
    if as_json:
        click.echo(json.dumps(findings, indent=2))
    if findings["n_requests"] == findings["errors"]:
        from lpf.pipeline import all_failed

        raise LpfError(f"nothing could be audited: {all_failed(run) or 'every request failed'}")
    # the run's verdict counts too: `systematic` is the run-level test's and a prompt-only divergence
    # the prompt block's, neither carried by a request's output verdict
    if fails([*(v for v, c in findings["counts"].items() if c), findings["verdict"]], fail_on):
        sys.exit(1)


_WITH_SPEC = {"spec_file", "out", "as_json", "fail_on"}  # what may go with --spec: the spec holds the rest


@click.command(cls=KnobCommand)
@audit_options
@click.option(
    "--spec",
    "spec_file",
    type=click.File("r"),
    default=None,
    metavar="FILE|-",
    help="Run this audit spec (JSON: a run directory's spec.json; - reads stdin) instead of the options "
    "above (--out, --json, --fail-on still apply); rerun it to finish an interrupted audit.",
)
@click.pass_context
def audit(ctx, spec_file, as_json, fail_on, **params):
    """Run a workload on an engine, rescore it with the reference, analyze: all in one."""
    from lpf.pipeline import create_run, open_audit

    if spec_file is None:  # a new audit: an --out that exists is refused (`lpf run --resume` finishes a run)
        spec = build_audit_spec(params)  # every setting checked before the engine starts
        run = create_run(spec)
    else:  # a spec's audit: rerunning it finishes it where it stopped
        spec = _read_spec(ctx, spec_file, params.get("out"))
        run = open_audit(spec)
    err.print(f"run directory: {run.path}")
    from lpf.pipeline.reference_vllm import kept
    from lpf.pipeline.reference_vllm_self import held

    with held(spec.rescore.reference):  # a self-reference on the vllm engine re-scores in the run's own engine
        if run.manifest.get("status") != "complete":
            _generate(run)
        with kept(spec.rescore.reference):  # a vLLM reference starts once for the rescore and the attribution
            _rescore(run, spec.rescore, calibrate=spec.analysis.calibrate)
            _analyze(run, spec.threshold_values(), as_json, fail_on, spec.analysis.attribution)


def _read_spec(ctx: click.Context, spec_file, out: Path | None):
    from pydantic import ValidationError

    from lpf.pipeline.spec import AuditSpec, with_run

    given = [
        p.opts[0]
        for p in ctx.command.get_params(ctx)
        if p.name not in _WITH_SPEC and ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        raise LpfError(
            f"--spec holds every setting of the audit: drop {given[0]} (only --out, --json and --fail-on go with it)"
        )
    name = getattr(spec_file, "name", "-")
    try:
        spec = AuditSpec.model_validate_json(spec_file.read())
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise LpfError(f"--spec {name}: not an audit spec ({where + ': ' if where else ''}{first['msg']})") from None
    spec.rescore.validate()
    return with_run(spec, out=out) if out is not None else spec


@click.command(cls=KnobCommand)
@run_options
@click.option(
    "--resume",
    type=click.Path(path_type=Path),
    default=None,
    help="Finish an interrupted run (its manifest supplies every other option).",
)
def run(resume, **run_params):
    """Run a workload on an engine and store every token and logprob (no rescoring)."""
    from lpf.pipeline import all_failed, create_run
    from lpf.run.store import RunDir

    run_dir = RunDir.open(resume) if resume else create_run(build_audit_spec(run_params))
    err.print(f"run directory: {run_dir.path}")
    _generate(run_dir)
    why = all_failed(run_dir)
    if why:
        raise LpfError(why)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@rescore_options
@click.option("--redo", is_flag=True, help="Drop existing reference scores and rescore everything.")
def rescore(run_dir, calibrate, redo, **params):
    """Teacher-force the reference model over a run's prompts and outputs (resumable: a request is
    scored once; `--executor ray` spreads the work over a pool of Ray actors)."""
    from lpf.run.store import RunDir

    settings = rescore_settings(params)
    _rescore(RunDir.open(run_dir), settings, redo, calibrate)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@trace_dir_option
@analysis_options
@stream_option
@click.option(
    "--tokens-only",
    is_flag=True,
    help="Judge from the tokens alone, as if the engine had returned no logprobs (what a tokens-only "
    "server's audit would say).",
)
def analyze(run_dir, trace_dir, threshold, attribution, as_json, fail_on, stream, tokens_only):
    """Re-run the analysis on a stored, rescored run and rewrite findings.json."""
    from lpf.run.store import RunDir

    run = RunDir.open(run_dir)
    if trace_dir is not None:
        _join(run, trace_dir)
    from lpf.analysis.thresholds import Thresholds

    _analyze(run, Thresholds().with_overrides(list(threshold)), as_json, fail_on, attribution, stream, tokens_only)


COMMANDS = (audit, run, rescore, analyze)
