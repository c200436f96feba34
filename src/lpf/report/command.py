"""`lpf report DIR`: write DIR/report.html for a run, sweep or RL directory and print its path.

Kept apart from cli.py so the command line stays thin; heavy imports happen only when it runs.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("report")
@click.argument("directory", type=click.Path(path_type=Path))
def report(directory: Path) -> None:
    """Write DIR/report.html: one offline page for a run, sweep or RL directory."""
    from lpf.report import write_report

    click.echo(str(write_report(directory)))
