"""What every command module shares; command modules import this, `options` (the option decorators),
`audit_spec` (the options turned into an AuditSpec) and the render modules, never each other.

- `err` / `out`: stderr (progress, summaries, errors) and stdout (`--json` documents, and tables that
  are the command's output).
- `progress_bar(label, unit)`: one rich bar on stderr, shown once the stage has validated its inputs;
  `progress_bars(*stages)` several, for stages that run one after another in one call.
- `default_out(kind)`: where a run, a repeat, ... goes when --out is not given.
- `write_report(path)`: the one rule for writing report.html after findings exist.
- `fails(verdicts, fail_on)`: the one `--fail-on` rule.
Imports here are rich and light lpf modules only: `lpf --help` must stay fast.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from lpf.analysis.levels import at_or_above
from lpf.core.errors import LpfError

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
    p = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )

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
        err.print(
            f"[yellow]report not written (a bug in lpf.report, please report it):[/] "
            f"{type(e).__name__}: {escape(str(e))}",
            highlight=False,
            soft_wrap=True,
        )
        return None
    err.print(f"report: {written}", highlight=False)
    return written


def fails(verdicts: Iterable[str | None], fail_on: str) -> bool:
    """Whether any of `verdicts` is at or above the `--fail-on` level (exit 1)."""
    return any(at_or_above(v, fail_on) for v in verdicts)
