"""The terminal summary of `lpf locate`: the finding, the op where the engine departs, the reference on
trial, and the departure along the forward pass (every op in execution order, with a bar per op).

`print_locate(doc, out_dir, console)` draws a locate.json document; model text is escaped."""

from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

SUSPECT_STYLE = {"engine": "bold red", "reference": "bold magenta", "both": "bold dark_orange", "nobody": "green"}


def _g(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def _bar(ratio) -> str:
    """log10(error / floor) as a bar: empty within the floor, one block per decade beyond it."""
    if ratio is None or ratio <= 1:
        return ""
    return "█" * min(12, 1 + int(math.log10(ratio)))


def print_locate(doc: dict, out_dir, console: Console) -> None:
    v, t, rp = doc.get("verdict") or {}, doc.get("target") or {}, doc.get("replay") or {}
    suspect = v.get("suspect", "?")
    console.print(
        f"[bold]locate:[/] {escape(doc.get('request_id', '?'))} · output position {t.get('output_position')} "
        f"({escape(t.get('why') or '')}) · engine {escape(str((doc.get('engine') or {}).get('name')))}"
    )
    console.print(f"[bold]suspect:[/] [{SUSPECT_STYLE.get(suspect, 'white')}]{suspect}[/]")
    console.print(escape(doc.get("sentence") or ""), soft_wrap=True)
    if doc.get("details"):
        console.print(f"[dim]{escape(doc['details'])}[/]", soft_wrap=True)
    chk = rp.get("check") or {}
    replayed = (
        f"replayed {rp.get('steps_replayed')} of {rp.get('steps_scheduled')} steps"
        if rp.get("steps_scheduled")
        else "replayed"
    )
    if chk.get("positions"):
        replayed += (
            f"; its logprobs vs the run's: max |diff| {_g(chk.get('max_abs_logprob_diff'))} over "
            f"{chk['positions']} positions ({'reproduces' if rp.get('reproduces') else 'does NOT reproduce'} the run)"
        )
    console.print(escape(replayed))
    tr = doc.get("trials") or {}
    g = tr.get("gold") or {}
    lines = [
        f"float64 gold: {'agrees' if g.get('agrees') else 'departs' if g.get('agrees') is False else '–'}"
        + (
            f" (worst {g['worst_op']}: {g['worst_epsilons']:.3g} float32 epsilons, tolerance {g['tolerance_epsilons']})"
            if g.get("worst_op")
            else ""
        )
    ]
    for key, name in (
        ("decode_path", "decode path vs teacher-forced"),
        ("attention", "attention implementations"),
        ("engine_vs_decode_path", "engine vs reference decode path"),
    ):
        if key in tr:
            f = tr[key].get("first_departure")
            lines.append(
                f"{name}: "
                + (
                    "agree"
                    if f is None
                    else f"depart at {f['op']} ({f['token']}), rel error {_g(f['rel_error'])}, {_g(f['ratio'])}x floor"
                )
            )
    console.print("reference on trial: " + escape("; ".join(lines)), soft_wrap=True)
    located = (doc.get("located") or {}).get("op")
    table = Table(
        title="the departure along the forward pass (engine vs reference, max over positions)", title_justify="left"
    )
    for col in ("op", "max rel error", "floor", "x floor", "first departs", ""):
        table.add_column(col)
    for m in doc.get("modules") or []:
        style = "bold red" if m["op"] == located else ("red" if (m.get("ratio") or 0) > 1 else "")
        table.add_row(
            escape(m["op"]),
            _g(m.get("max_rel_error")),
            _g(m.get("floor")),
            _g(m.get("ratio")),
            "–" if m.get("first_departure") is None else str(m["first_departure"]),
            _bar(m.get("ratio")),
            style=style,
        )
    console.print(table)
    console.print(f"results: {out_dir}/locate.json")
