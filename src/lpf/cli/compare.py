"""Comparing engines: `lpf diff` (which of two runs, or the reference, departs) and `lpf conformance`
(every architecture an engine claims, under a grid of knobs, each non-clean cell attributed by diff).

`lpf.run_diff` and `lpf.conformance` do the work and return documents; `render` draws them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lpf.cli.common import err, fail_on_option, out
from lpf.cli.render import print_diff


@click.command("diff")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the diff document on stdout.")
@click.option("--out", "out_file", type=click.Path(path_type=Path), default=None,
              help="Also write the diff document (JSON) to this file.")
@fail_on_option("any request's departure from the reference (by either engine, or the reference's own)")
def diff(run_a, run_b, as_json, out_file, fail_on):
    """Who is wrong: two engines' runs of one workload, rescored by one reference, compared request by request.

    Per request: do A and B agree with each other, and which departs from the reference? When both
    agree with each other and not with the reference, the reference is named the suspect.
    """
    from lpf.run_diff import diff_runs

    level = "divergent" if fail_on == "never" else fail_on
    _, doc = diff_runs(run_a, run_b, level)
    print_diff(doc, err if as_json else out)
    if out_file is not None:
        out_file.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    if fail_on != "never" and doc["suspect"] != "none":  # someone departs at or above --fail-on
        sys.exit(1)


COMMANDS = (diff,)
