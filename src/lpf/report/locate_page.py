"""The report page of a locate directory (`lpf locate RUN --out DIR`): locate.json as one page.

The page shows the target (request, output position, why it was chosen), the finding's sentence,
the located op and, for a Mamba layer, its input state; the verdict (engine, reference, both,
nobody); the reference on trial (float64 gold, decode path, attention implementations); the replay
(steps replayed of those scheduled, whether it reproduces the run's logprobs) and the request's own
steps; and two charts of the departure along the forward pass: per op (execution order) the largest
relative error of the engine against the reference, its floor, and the trials' errors beside it
(`departure_chart`), and per op and position log10(error / floor) (`departure_map`). Plotly specs
are plain dicts, SVG traces only; model-derived text goes through `chart_style.ptext`.
"""

from __future__ import annotations

import json
from pathlib import Path

from lpf.core.errors import LpfError
from lpf.report.chart_style import ACCENT, MUTED, SERIES, VERDICT_COLORS, base_layout, ptext, sig

TRIAL_SERIES = (
    ("gold_max_rel_error", "float32 reference vs float64 gold"),
    ("decode_path_max_rel_error", "reference decode path vs teacher-forced"),
    ("attention_max_rel_error", "eager vs default attention"),
)


def load(path: Path) -> dict:
    try:
        doc = json.loads((path / "locate.json").read_text())
    except json.JSONDecodeError as e:
        raise LpfError(f"{path / 'locate.json'}: unreadable JSON ({e.msg})") from None
    if not isinstance(doc, dict) or doc.get("kind") != "locate":
        raise LpfError(f"{path / 'locate.json'}: not a locate document")
    modules = [m for m in doc.get("modules") or [] if isinstance(m, dict)]
    grid = doc.get("grid") or {}
    return {
        "kind": "locate",
        "doc": {
            k: doc.get(k)
            for k in (
                "request_id",
                "target",
                "engine",
                "reference",
                "replay",
                "located",
                "mamba",
                "input",
                "verdict",
                "sentence",
                "details",
                "trials",
                "seconds",
                "run",
            )
        },
        "modules": modules,
        "chart": departure_chart(modules, doc.get("located")) if modules else None,
        "map": departure_map(grid) if grid.get("ops") else None,
    }


def departure_chart(modules: list[dict], located: dict | None) -> dict:
    x = list(range(len(modules)))
    labels = [ptext(m.get("op")) for m in modules]
    hover = [ptext(f"{m.get('op')}: {m.get('description', '')}") for m in modules]
    data = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "name": "engine vs reference",
            "x": x,
            "y": [sig(m.get("max_rel_error"), 3) for m in modules],
            "text": hover,
            "hovertemplate": "%{text}<br>max rel error %{y}<extra></extra>",
            "line": {"color": VERDICT_COLORS["corrupt"], "width": 2},
            "marker": {"size": 6},
        },
        {
            "type": "scatter",
            "mode": "lines",
            "name": "floor",
            "x": x,
            "y": [sig(m.get("floor"), 3) for m in modules],
            "line": {"color": MUTED, "width": 1, "dash": "dash", "shape": "hvh"},
            "hoverinfo": "skip",
        },
    ]
    for i, (key, name) in enumerate(TRIAL_SERIES):
        ys = [sig(m.get(key), 3) for m in modules]
        if any(y for y in ys):
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "name": ptext(name),
                    "x": x,
                    "y": ys,
                    "line": {"color": SERIES[(i + 2) % len(SERIES)], "width": 1.5},
                    "connectgaps": False,
                    "hovertemplate": ptext(name) + " %{y}<extra></extra>",
                }
            )
    shapes, notes = [], []
    if located:
        at = next((i for i, m in enumerate(modules) if m.get("op") == located.get("op")), None)
        if at is not None:
            shapes.append(
                {
                    "type": "line",
                    "xref": "x",
                    "yref": "paper",
                    "x0": at,
                    "x1": at,
                    "y0": 0,
                    "y1": 1,
                    "line": {"color": ACCENT, "width": 1.5},
                }
            )
            notes.append(
                {
                    "x": at,
                    "xref": "x",
                    "y": 1,
                    "yref": "paper",
                    "text": ptext("first departure"),
                    "showarrow": False,
                    "xanchor": "left",
                    "yanchor": "top",
                    "xshift": 4,
                    "font": {"size": 10, "color": ACCENT},
                }
            )
    layout = base_layout(
        height=360,
        shapes=shapes,
        annotations=notes,
        xaxis={
            "tickmode": "array",
            "tickvals": x,
            "ticktext": labels,
            "tickangle": -60,
            "tickfont": {"size": 9},
            "title": {"text": "op, in execution order"},
        },
        yaxis={"type": "log", "exponentformat": "e", "title": {"text": "max relative error"}},
    )
    layout["margin"]["b"] = 120
    return {"data": data, "layout": layout}


def departure_map(grid: dict) -> dict:
    ops, positions = grid.get("ops") or [], grid.get("positions") or []
    z = grid.get("log_ratio") or []
    data = [
        {
            "type": "heatmap",
            "x": positions,
            "y": [ptext(o) for o in ops],
            "z": z,
            "zmin": -4,
            "zmax": 4,
            "colorscale": [[0, "#f8fafc"], [0.5, "#fde68a"], [0.75, "#f97316"], [1, "#b91c1c"]],
            "colorbar": {"title": {"text": "log10 err/floor", "side": "right"}, "thickness": 12},
            "hovertemplate": "%{y} at position %{x}<br>log10(error / floor) %{z}<extra></extra>",
        }
    ]
    layout = base_layout(
        height=max(320, 14 * len(ops) + 80),
        xaxis={"title": {"text": "token position" + (f" (bins of {grid['bin']})" if grid.get("bin", 1) > 1 else "")}},
        yaxis={"autorange": "reversed", "tickfont": {"size": 9}},
    )
    layout["margin"]["l"] = 130
    return {"data": data, "layout": layout}
