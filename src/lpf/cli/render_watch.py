"""`lpf watch`'s terminal lines: one per judged window, one structured JSON line per alarm, the closing summary.

All on stderr (stdout stays free for a caller's pipes). The alarm line is `supervisor.alarm_record`
as one JSON object, so a log shipper can parse it.
"""

from __future__ import annotations

import json

import click


def window_line(w: dict) -> None:
    from lpf.watch.outages import window_notes, window_result

    test = w.get("run_test") or {}
    p = test.get("p_value")
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted((w.get("verdicts") or {}).items())) or "none scored"
    notes = window_notes(w)
    change = w.get("change") or {}
    incident = w.get("incident") or {}
    click.echo(
        f"lpf watch: window {w.get('window')} (requests {w.get('first_seq')}..{w.get('last_seq')}, "
        f"{w.get('n_tokens', 0)} tokens): {verdicts}; {window_result(w)}"
        + (f" (p={p:.3g})" if p is not None else "")
        + (f"; {notes}" if notes else "")
        + (
            f"; incident {incident['id']} (window {incident.get('windows')} of it): change begins at "
            f"{change.get('request_id')}" + (" (refined)" if change.get("refined") else "")
            if incident and w.get("alarm")
            else ""
        ),
        err=True,
    )
    if w.get("alarm"):
        from lpf.watch.supervisor import alarm_record

        click.echo(json.dumps(alarm_record(w), default=float), err=True)


def summary(outcome) -> None:
    click.echo(
        f"lpf watch: stopped after {outcome.recorded} recorded samples ({outcome.dropped} dropped), "
        f"{len(outcome.windows)} windows judged, {outcome.alarms} alarmed, "
        f"{outcome.scorer_restarts} scorer restarts",
        err=True,
    )
