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

from lpf.cli.common import (analysis_options, audit_options, build_run_spec, err, fails, progress_bar, rescore_options,
                            run_options, write_report)
from lpf.cli.render import print_calibration, print_summary
from lpf.errors import LpfError


def _generate(run) -> None:
    from lpf.pipeline import execute_run

    with progress_bar("generate", "requests") as (on_start, tick):
        execute_run(run, on_start, tick)


def _rescore(run, reference, reference_dtype, token_budget, redo=False, calibrate=False) -> None:
    from lpf.pipeline import calibrate_run, rescore_run

    with progress_bar("rescore ", "tokens") as (on_start, tick):
        rescore_run(run, reference, reference_dtype, token_budget, redo, on_start, tick)
    if calibrate:
        with progress_bar("calibrate", "tokens") as (on_start, tick):
            cal = calibrate_run(run, token_budget, on_start, tick)
        print_calibration(cal, run.path, err)


def _analyze(run, threshold, as_json, fail_on) -> None:
    from lpf.analysis.thresholds import Thresholds
    from lpf.pipeline import analyze_run

    findings = analyze_run(run, Thresholds().with_overrides(list(threshold)))
    print_summary(findings, run.path, err)
    write_report(run.path)
    if as_json:
        click.echo(json.dumps(findings, indent=2))
    if findings["n_requests"] == findings["errors"]:
        raise LpfError("nothing could be audited: every request failed (see the error column of requests)")
    # the run's verdict counts too: `systematic` is the run-level test's, no request carries it
    if fails([*(v for v, c in findings["counts"].items() if c), findings["verdict"]], fail_on):
        sys.exit(1)


@click.command()
@audit_options
def audit(reference, reference_dtype, token_budget, calibrate, threshold, as_json, fail_on, **run_params):
    """Run a workload on an engine, rescore it with the reference, analyze: all in one."""
    from lpf.pipeline import create_run

    run = create_run(build_run_spec({**run_params, "reference": reference}))
    err.print(f"run directory: {run.path}")
    _generate(run)
    _rescore(run, reference, reference_dtype, token_budget, calibrate=calibrate)
    _analyze(run, threshold, as_json, fail_on)


@click.command()
@run_options
@click.option("--resume", type=click.Path(path_type=Path), default=None,
              help="Finish an interrupted run (its manifest supplies every other option).")
def run(resume, **run_params):
    """Run a workload on an engine and store every token and logprob (no rescoring)."""
    from lpf.pipeline import create_run
    from lpf.run.store import RunDir

    run_dir = RunDir.open(resume) if resume else create_run(build_run_spec(run_params))
    err.print(f"run directory: {run_dir.path}")
    _generate(run_dir)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@rescore_options
@click.option("--redo", is_flag=True, help="Drop existing reference scores and rescore everything.")
def rescore(run_dir, reference, reference_dtype, token_budget, calibrate, redo):
    """Teacher-force the reference model over a run's prompts and outputs."""
    from lpf.run.store import RunDir

    _rescore(RunDir.open(run_dir), reference, reference_dtype, token_budget, redo, calibrate)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@analysis_options
def analyze(run_dir, threshold, as_json, fail_on):
    """Re-run the analysis on a stored, rescored run and rewrite findings.json."""
    from lpf.run.store import RunDir

    _analyze(RunDir.open(run_dir), threshold, as_json, fail_on)


COMMANDS = (audit, run, rescore, analyze)
