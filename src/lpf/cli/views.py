"""Read-only views of what exists: `lpf query`, `lpf inspect`, `lpf report`, `lpf engines`, `lpf zoo list`.

None of them changes a run's data (`report` writes report.html beside it, nothing else).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from lpf.cli.common import out
from lpf.cli.render_views import print_engines, print_request, print_rows, print_zoo


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("sql")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
def query(run_dir, sql, fmt):
    """SQL (DuckDB) over a run: views requests, tokens, reference, summary (and trace, faults, calibration)."""
    from lpf.views.query import run_query

    columns, rows = run_query(run_dir, sql)
    print_rows(columns, rows, out, fmt)


@click.command("inspect")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True, help="Print the request, tokens and trace as JSON.")
@click.option("--top", type=int, default=3, show_default=True, help="Top-k alternatives shown per side.")
def inspect_cmd(run_dir, request_id, as_json, top):
    """One request token by token (engine vs reference) and its trace step by step."""
    from lpf.views.inspect import inspect_request

    info = inspect_request(run_dir, request_id)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
    else:
        print_request(info, out, top=max(0, top))


@click.command("report")
@click.argument("directory", type=click.Path(path_type=Path))
def report(directory: Path) -> None:
    """Write DIR/report.html: one offline page for a run, sweep or RL directory."""
    from lpf.report import write_report

    click.echo(str(write_report(directory)))


@click.command()
def engines():
    """List the engine adapters and their knobs (-E NAME=VALUE) with defaults."""
    from lpf.adapters import engine_names, get_engine_class

    from lpf.adapters.base import capabilities

    rows = []
    for name in engine_names():
        cls = get_engine_class(name)
        rows.append((name, {k: f.default for k, f in cls.Options.model_fields.items()}, capabilities(cls)))
    print_engines(rows, out)


@click.group()
def zoo():
    """Bundled models and workloads."""


@zoo.command("list")
def zoo_list():
    """Models (architecture, parameters, size, task accuracy) and workloads."""
    from lpf.zoo import registry

    print_zoo(registry.list_models(), registry.list_workloads(), out)


COMMANDS = (query, inspect_cmd, report, engines, zoo)
