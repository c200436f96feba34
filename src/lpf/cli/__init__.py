"""The `lpf` command line: one click group; its commands live one module per group.

  common.py       what every command shares: consoles, progress bars, the report rule, the --fail-on rule
  options.py      the option decorators, each option declared once
  audit_spec.py   parsed options -> the one AuditSpec builder (lpf.pipeline.audit_options), rescore settings
  render.py       the run's terminal summary (domain modules return data and print nothing); the other
                  terminal tables beside it: render_views.py (engines, zoo, query, inspect),
                  render_experiments.py (sweep, repeat, shrink), render_compare.py (diff, conformance),
                  render_rl.py, render_locate.py
  run.py          audit, run, rescore, analyze        views.py   query, inspect, report, engines, zoo
  experiments.py  sweep, repeat                       rl.py      rl analyze, rl simulate
  serve.py        serve                               compare.py diff, conformance
  locate.py       locate (render_locate.py draws its summary)
  watch.py        watch (render_watch.py draws its lines)
Command modules import `common`, `options`, `audit_spec` and the render modules only, never each other. `lpf --help` imports click,
rich and a few light lpf modules: every heavy import sits inside a command's body.

Exit codes everywhere: 0 fine, 1 findings at or above `--fail-on`, 2 bad usage or input (an
`LpfError`, printed as one line, never a traceback). `--json` prints findings on stdout; all
progress and summaries go to stderr so stdout stays machine-readable.
"""

from __future__ import annotations

import sys

import click

from lpf.cli import compare, experiments, locate, rl, run, serve, views, watch
from lpf.cli.common import err
from lpf.core.errors import LpfError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="logprob-forensics")
def cli():
    """logprob-forensics: re-score an engine's exact tokens with a reference and find the requests that lie."""


for _module in (run, views, experiments, rl, serve, compare, locate, watch):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


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
    except Exception as e:
        from pydantic import ValidationError

        if not isinstance(e, ValidationError):
            raise
        from rich.markup import escape

        from lpf.cli.audit_spec import spec_error

        # a bound no command turned into an LpfError: still one line, exit 2 (bad input, not a crash)
        err.print(f"[bold red]error:[/] {escape(spec_error(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
