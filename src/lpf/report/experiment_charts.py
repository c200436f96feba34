"""Plotly figure specs of the experiment pages, as plain dicts (pure; SVG traces only; model-derived
text through `ptext`): a sweep's metric lines by knob value and its verdict mix, a shrink's progress,
an RL run's per-step series."""

from __future__ import annotations


import numpy as np

from lpf.report.chart_style import (
    ACCENT,
    SERIES,
    VERDICT_COLORS,
    base_layout,
    hline,
    ptext,
    sig,
    sig_list,
)
from lpf.report.charts import bin_series


# -- sweep / RL charts -----------------------------------------------------------------------------
def knob_lines(
    x_labels: list[str], groups: dict[str, list], metric_title: str, x_title: str, log_y: bool = False
) -> dict:
    """One line per group (a combination of the other knobs) over the first knob's values."""
    data = []
    for i, (name, ys) in enumerate(groups.items()):
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": ptext(name) or metric_title,
                "x": [ptext(v) for v in x_labels],
                "y": [sig(v) for v in ys],
                "line": {"color": SERIES[i % len(SERIES)], "width": 2},
                "marker": {"size": 8},
                "connectgaps": False,
                "hovertemplate": ptext(x_title)
                + " %{x}<br>"
                + ptext(metric_title)
                + " %{y}<extra>"
                + ptext(name)
                + "</extra>",
            }
        )
    layout = base_layout(
        height=300,
        showlegend=len(groups) > 1,
        xaxis={"title": {"text": ptext(x_title)}, "type": "category"},
        yaxis={"title": {"text": ptext(metric_title)}, **({"type": "log", "exponentformat": "e"} if log_y else {})},
    )
    return {"data": data, "layout": layout}


def shrink_progress(
    ids: list[str], steps: list[str], sizes: list[list[int]], reproduces: list[bool], best: list[int | None]
) -> dict:
    """A shrink's candidates in the order they were tried: each one's request count (red: it still
    told the lie, grey: it did not) and the best configuration's request count so far (a step line)."""
    x = list(range(1, len(ids) + 1))
    hover = [
        ptext(f"{i}: {s}") + "<br>" + ptext(f"{n[0]} requests, {n[1]} tokens, {n[2]} knobs off default")
        for i, s, n in zip(ids, steps, sizes)
    ]
    data = [
        {
            "type": "scatter",
            "mode": "lines",
            "name": "best so far",
            "x": x,
            "y": best,
            "line": {"shape": "hv", "color": ACCENT, "width": 2},
            "hoverinfo": "skip",
        },
        {
            "type": "scatter",
            "mode": "markers",
            "name": "candidate",
            "x": x,
            "y": [n[0] for n in sizes],
            "text": hover,
            "hovertemplate": "%{text}<extra></extra>",
            "marker": {
                "size": 9,
                "color": [VERDICT_COLORS["corrupt"] if r else VERDICT_COLORS["unscored"] for r in reproduces],
            },
        },
    ]
    layout = base_layout(
        height=300,
        xaxis={"title": {"text": "candidate (in the order tried)"}},
        yaxis={"title": {"text": "requests"}, "type": "log"},
    )
    return {"data": data, "layout": layout}


def rl_series(
    steps: np.ndarray,
    columns: dict[str, np.ndarray],
    spikes: np.ndarray | None,
    log_y: bool = False,
    band: tuple[np.ndarray, np.ndarray] | None = None,
    y_line: float | None = None,
) -> dict:
    """Lines of per-step RL metrics (max per bin when binned), spike steps marked on the first line,
    an optional mean ± std band drawn around the first line."""
    keys = list(columns)
    cols = dict(columns)
    how = {k: "max" for k in keys}
    if spikes is not None:
        cols["__spike"], how["__spike"] = np.asarray(spikes, dtype=float), "max"
    if band is not None:
        cols["__bm"], cols["__bs"] = np.asarray(band[0], dtype=float), np.asarray(band[1], dtype=float)
        how["__bm"] = how["__bs"] = "mean"
    x, binned, width = bin_series(np.asarray(steps), cols, how)
    data = []
    if band is not None:
        mean, std = np.asarray(binned["__bm"]), np.nan_to_num(np.asarray(binned["__bs"]))
        xs = x.tolist()
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": xs + xs[::-1],
                "y": sig_list(mean + std, 4) + sig_list((mean - std)[::-1], 4),
                "fill": "toself",
                "fillcolor": "rgba(37,99,235,0.12)",
                "line": {"width": 0},
                "name": "mean ± std",
                "hoverinfo": "skip",
            }
        )
    for i, k in enumerate(keys):
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": k,
                "x": x.tolist(),
                "y": sig_list(binned[k], 4),
                "line": {"color": SERIES[i % len(SERIES)], "width": 1.5},
            }
        )
    if "__spike" in binned:
        hit = np.flatnonzero(np.asarray(binned["__spike"]) > 0)
        if hit.size and keys:
            first = np.asarray(binned[keys[0]])
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": "spike",
                    "x": x[hit].tolist(),
                    "y": sig_list(first[hit], 4),
                    "marker": {"color": VERDICT_COLORS["corrupt"], "size": 10, "symbol": "x"},
                }
            )
    shapes, notes = [], []
    if y_line is not None:
        s, a = hline(y_line, f"spike threshold {y_line:g}", VERDICT_COLORS["corrupt"])
        shapes.append(s)
        notes.append(a)
    per = "" if width == 1 else f" (max per {width} steps)"
    layout = base_layout(
        height=280,
        shapes=shapes,
        annotations=notes,
        xaxis={"title": {"text": "training step" + per}},
        yaxis={"type": "log", "exponentformat": "e"} if log_y else {},
    )
    return {"data": data, "layout": layout}


def verdict_mix(labels: list[str], names: list[str], counts: list[dict], x_title: str) -> dict:
    """Stacked bars: the verdict counts of each cell of a sweep (short labels on the axis, the cell's
    full name on hover)."""
    data = []
    for v in ("clean", "noise", "divergent", "corrupt"):
        ys = [int((c or {}).get(v) or 0) for c in counts]
        if any(ys):
            data.append(
                {
                    "type": "bar",
                    "name": v,
                    "x": [ptext(n) for n in labels],
                    "y": ys,
                    "customdata": [ptext(n) for n in names],
                    "marker": {"color": VERDICT_COLORS[v]},
                    "hovertemplate": "%{customdata}<br>%{y} requests<extra>" + v + "</extra>",
                }
            )
    layout = base_layout(
        height=300,
        barmode="stack",
        xaxis={"type": "category", "title": {"text": ptext(x_title)}, "automargin": True},
        yaxis={"title": {"text": "requests"}},
    )
    return {"data": data, "layout": layout}
