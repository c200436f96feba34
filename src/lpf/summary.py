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
    _print_thresholds(findings["thresholds"], console)
    _print_shape(findings.get("shape"), console)
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
    _print_hypotheses(findings.get("hypotheses") or [], console)
    console.print(f"results: {run_path}/findings.json  (lpf query {run_path} \"SELECT ...\")")


def _print_thresholds(th: dict, console: Console) -> None:
    """The thresholds this run's verdicts used, and where they came from."""
    source = th.get("source", "default")
    floor = (th.get("noise_floor") or {}).get("token_abs_diff") or {}
    origin = f"calibrated to this run's floor: token |diff| median {floor['median']:.2g}, MAD {floor['mad']:.2g}" \
        if source == "calibrated" and floor else source
    if source == "calibration-run" and floor:
        dtype = (th.get("noise_floor") or {}).get("dtype", "?")
        origin = f"from a calibration run, reference at {dtype}: token |diff| median {floor['median']:.2g}, " \
                 f"MAD {floor['mad']:.2g}"
    pinned = f", pinned: {', '.join(th['pinned'])}" if th.get("pinned") else ""
    console.print(f"[dim]thresholds ({origin}{pinned}): clean <= {th['clean_abs_diff']:.3g}, "
                  f"divergent > {th['divergent_abs_diff']:.3g}, tie margin {th.get('tie_margin', 0):.3g}, "
                  f"corrupt: gibberish score >= {th.get('gibberish_min_score', 0):.2g} "
                  f"with >= {th['gibberish_min_tokens']} lie tokens[/]")


def _print_shape(shape: dict | None, console: Console) -> None:
    if not shape or not shape.get("n_flagged"):
        return
    onset = shape.get("onset") or {}
    fd = shape.get("first_divergence") or {}
    per = shape.get("periodicity") or {}
    parts = [f"rate {shape['rate']:.2%} ({shape['n_flagged']} flagged)",
             f"onset request #{onset.get('seq')}" + (f", step {onset['step']}" if onset.get("step") is not None else "")]
    if fd.get("median") is not None:
        parts.append(f"first divergence median position {fd['median']:g} ({fd.get('at_zero_fraction', 0):.0%} at 0)")
    if per.get("period") is not None:
        parts.append(f"period {per['period']:g} {per.get('over', 'step')}s (confidence {per.get('confidence', 0):.2f})")
    console.print("shape: " + " · ".join(parts))


def _print_hypotheses(hyps: list, console: Console) -> None:
    if not hyps:
        return
    console.print("[bold]likely mechanisms[/] (Fisher exact test, best first):")
    for h in hyps[:3]:
        console.print(f"  {h['rank']}. {h['sentence']} [dim](p={h['p_value']:.2g})[/]", highlight=False)


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
