"""Terminal output: the audit summary and query results, drawn with rich on stderr/stdout."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

VERDICT_STYLE = {"clean": "green", "noise": "yellow", "divergent": "bold magenta", "corrupt": "bold red"}


def print_summary(findings: dict, run_path, console: Console) -> None:
    v = findings["verdict"]
    console.print(f"[bold]verdict:[/] [{VERDICT_STYLE.get(v, 'white')}]{v}[/]   "
                  f"engine {findings.get('engine')} · model {findings.get('model')} · reference {findings.get('reference')}")
    c = findings["counts"]
    line = "  ".join(f"[{VERDICT_STYLE[k]}]{k}[/] {c[k]}" for k in ("clean", "noise", "divergent", "corrupt"))
    extra = ""
    if findings.get("errors"):
        extra += f"  [red]errors[/] {findings['errors']}"
    if findings.get("unscored"):
        extra += f"  unscored {findings['unscored']}"
    console.print(f"requests {findings['n_requests']} · tokens {findings['n_tokens']}   {line}{extra}")
    o = findings.get("oracle") or {}
    if o.get("n"):
        console.print(f"oracle accuracy {o['accuracy']:.1%} ({o['correct']}/{o['n']} exact answers)")
    d = findings["metrics"].get("abs_logprob_diff", {})
    if d.get("max") is not None:
        console.print("|logprob diff|  " + "  ".join(f"{k} {d[k]:.3g}" for k in ("p50", "p90", "p99", "p99_9", "max")))
    th = findings["thresholds"]
    console.print(f"[dim]thresholds: clean <= {th['clean_abs_diff']:g}, divergent > {th['divergent_abs_diff']:g}, "
                  f"corrupt: >= {th['gibberish_min_tokens']} confident-gibberish tokens[/]")
    flagged = findings.get("flagged") or []
    if flagged:
        t = Table(title=f"flagged requests (worst {min(10, len(flagged))} of {len(flagged)})", title_justify="left")
        for col in ("request_id", "verdict", "first_divergence", "max |diff|"):
            t.add_column(col)
        for f in flagged[:10]:
            diff = f["max_abs_logprob_diff"]
            t.add_row(f["request_id"], f"[{VERDICT_STYLE[f['verdict']]}]{f['verdict']}[/]",
                      str(f["first_divergence"]), "inf" if diff is None else f"{diff:.3g}")
        console.print(t)
    console.print(f"results: {run_path}/findings.json  (lpf query {run_path} \"SELECT ...\")")


def print_rows(columns: list[str], rows: list, console: Console, fmt: str = "table") -> None:
    if fmt == "csv":
        import csv
        import sys

        w = csv.writer(sys.stdout)
        w.writerow(columns)
        w.writerows(rows)
        return
    if fmt == "json":
        import json

        console.print_json(json.dumps([dict(zip(columns, r)) for r in rows], default=str))
        return
    t = Table()
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*("NULL" if v is None else str(v) for v in r))
    console.print(t)
