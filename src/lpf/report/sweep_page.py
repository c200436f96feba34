"""The report page of a sweep directory (`lpf sweep --out DIR`): sweep.json into one JSON-ready dict.

Charts show each shape metric (rate, onset, first-divergence median, period, max |diff|) against the
first knob's values, one line per combination of the other knobs, plus each cell's verdict mix.
Cells link to their own report.html when it exists (else their findings.json). Cell fields that
are missing or null are tolerated: the sweep writer and this page are built side by side.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from lpf.core.errors import LpfError
from lpf.report import experiment_charts

METRICS = [  # (cell key, title, log y)
    ("rate", "flag rate (flagged / scored requests)", False),
    ("onset_seq", "onset: first flagged arrival index", False),
    ("onset_step", "onset: first flagged engine step", False),
    ("first_divergence_median", "median first-divergence position", False),
    ("period", "period over steps", False),
    ("max_abs_logprob_diff", "max |logprob diff|", True),
]


def read_doc(path: Path, name: str, key: str, kind: str) -> dict:
    """A directory's document (sweep.json, shrink.json), which must hold a list under `key`."""
    try:
        doc = json.loads((path / name).read_text())
    except json.JSONDecodeError as e:
        raise LpfError(f"{path / name}: unreadable JSON ({e.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
        raise LpfError(f"{path / name}: not a {kind} (no {key} list)")
    return doc


def load(path: Path) -> dict:
    sweep = read_doc(path, "sweep.json", "cells", "sweep")
    knobs = [k for k in sweep.get("knobs") or [] if isinstance(k, dict) and k.get("name")]
    cells = [c for c in sweep["cells"] if isinstance(c, dict)]
    for c in cells:
        c["link"] = run_link(path, c.get("run_dir"))
    chart_list = []
    for key, title, log_y in METRICS:
        values = [
            c.get(key) for c in cells if isinstance(c.get(key), (int, float)) and not isinstance(c.get(key), bool)
        ]
        if values:
            x, groups, x_title = _grid(knobs, cells, key)
            # a log axis only pays when the values span orders of magnitude
            log_y = log_y and min(values) > 0 and max(values) / min(values) >= 100
            chart_list.append(
                {"key": key, "title": title, "figure": experiment_charts.knob_lines(x, groups, title, x_title, log_y)}
            )
    names = [str(c.get("name", i)) for i, c in enumerate(cells)]
    if knobs:
        labels = [" · ".join(str((c.get("values") or {}).get(k["name"], "?")) for k in knobs) for c in cells]
        if len(set(labels)) < len(labels):
            labels = names
    else:
        labels = names
    x_title = " · ".join(k["name"] for k in knobs) if knobs and labels is not names else "cell"
    return {
        "kind": "sweep",
        "knobs": knobs,
        "cells": cells,
        "moves": [m for m in sweep.get("moves") or [] if isinstance(m, dict)],
        "charts": chart_list,
        "mix": experiment_charts.verdict_mix(labels, names, [c.get("counts") or {} for c in cells], x_title)
        if cells
        else None,
    }


def _grid(knobs: list[dict], cells: list[dict], key: str) -> tuple[list[str], dict[str, list], str]:
    """x labels (first knob's values), {label of the other knobs' values: y per x}, x title."""
    if not knobs:
        return [str(c.get("name")) for c in cells], {key: [c.get(key) for c in cells]}, "cell"
    first, others = knobs[0], knobs[1:]
    xs = list(first.get("values") or [])
    by_values = {}
    for c in cells:
        vals = c.get("values") or {}
        by_values[tuple(str(vals.get(k["name"])) for k in knobs)] = c.get(key)
    groups = {}
    for combo in itertools.product(*[list(k.get("values") or []) for k in others]):
        label = ", ".join(f"{k['name']}={v}" for k, v in zip(others, combo))
        groups[label] = [by_values.get((str(x), *map(str, combo))) for x in xs]
    return [str(x) for x in xs], groups, str(first["name"])


def run_link(root: Path, run_dir) -> str | None:
    """A relative link to a run's page (else its findings.json) for a run directory inside `root`
    (a sweep's cell, a shrink's candidate); None for a path outside it or a run with neither."""
    if not isinstance(run_dir, str) or not run_dir:
        return None
    cell = (root / run_dir).resolve()
    try:
        cell.relative_to(root.resolve())
    except ValueError:
        return None
    for name in ("report.html", "findings.json"):
        if (cell / name).is_file():
            return (Path(run_dir) / name).as_posix()
    return None
