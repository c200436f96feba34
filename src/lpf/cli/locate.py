"""`lpf locate`: where in the forward pass a lying request's lie is born, and whether the reference is to blame.

`lpf.locate` does the work (replay, capture, align, judge) and writes locate.json; `render_locate`
draws the summary; the report page is written beside locate.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from lpf.cli.common import err, out, write_report
from lpf.cli.render_locate import print_locate


@click.command("locate")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--request", "request_id", default=None, help="Request to locate (default: the worst flagged one).")
@click.option(
    "--position", type=int, default=None, help="Output position to locate (default: the request's first divergence)."
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory for locate.json and report.html (default: RUN/locate/<request>-o<position>).",
)
@click.option(
    "--no-trials",
    is_flag=True,
    help="Skip the reference's decode path and attention trials (the float64 gold always runs: it sets the floors).",
)
@click.option("--json", "as_json", is_flag=True, help="Print locate.json on stdout.")
def locate_cmd(run_dir, request_id, position, out_dir, no_trials, as_json):
    """Replay one request through the engine with per-op capture, align it op by op against the reference
    (and the reference against itself), and name the first op and token that depart."""
    from lpf.core.errors import LpfError
    from lpf.locate import locate

    if not run_dir.is_dir():
        raise LpfError(f"{run_dir} is not a run directory")
    with err.status("locating") as status:
        doc, where = locate(
            run_dir, request_id, position, out_dir, trials=not no_trials, on_stage=lambda s: status.update(s)
        )
    print_locate(doc, where, err if as_json else out)
    write_report(where)
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))


COMMANDS = (locate_cmd,)
