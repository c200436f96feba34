"""The report's chart style and the helpers every figure shares: verdict colours, ink and series
colours, point caps, `ptext` (model-derived text as HTML entities: plotly reads a subset of HTML in
text), significant-digit rounding, the base layout and reference lines. Pure; no plotly import."""

from __future__ import annotations

import math

import numpy as np

VERDICT_COLORS = {
    "clean": "#16a34a",
    "noise": "#ca8a04",
    "divergent": "#c026d3",
    "systematic": "#ea580c",
    "corrupt": "#dc2626",
    "error": "#6b7280",
    "unscored": "#9ca3af",
}
INK, MUTED, GRID, ACCENT = "#1f2937", "#6b7280", "#eceef2", "#2563eb"
SERIES = ["#2563eb", "#f97316", "#0d9488", "#9333ea", "#e11d48", "#65a30d", "#0891b2", "#a16207"]
MAX_SCATTER_POINTS = 12_000
MAX_SERIES_POINTS = 3_000


def ptext(s) -> str:
    """A string plotly shows literally (its text fields accept a subset of HTML)."""
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def sig(x, digits: int = 5):
    """A float rounded to `digits` significant digits (smaller JSON); None for non-finite."""
    if x is None:
        return None
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def sig_list(values, digits: int = 5) -> list:
    return [sig(v, digits) for v in np.asarray(values, dtype=float).tolist()]


def base_layout(title: str | None = None, height: int = 340, **kw) -> dict:
    layout = {
        "height": height,
        "margin": {"l": 64, "r": 24, "t": 40 if title else 16, "b": 48},
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "#ffffff",
        "font": {
            "family": "Inter, ui-sans-serif, system-ui, -apple-system, 'Segoe UI', sans-serif",
            "size": 12,
            "color": INK,
        },
        "hoverlabel": {"font": {"family": "ui-monospace, SFMono-Regular, Menlo, monospace", "size": 12}},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0, "font": {"size": 11}},
        "xaxis": {"gridcolor": GRID, "zeroline": False, "linecolor": "#d1d5db"},
        "yaxis": {"gridcolor": GRID, "zeroline": False, "linecolor": "#d1d5db"},
        "bargap": 0.08,
    }
    if title:
        layout["title"] = {"text": ptext(title), "x": 0, "xanchor": "left", "font": {"size": 14}}
    for key, value in kw.items():
        if isinstance(value, dict) and isinstance(layout.get(key), dict):
            layout[key] = {**layout[key], **value}
        else:
            layout[key] = value
    return layout


def vline(x: float, label: str, color: str = MUTED) -> tuple[dict, dict]:
    shape = {
        "type": "line",
        "xref": "x",
        "yref": "paper",
        "x0": x,
        "x1": x,
        "y0": 0,
        "y1": 1,
        "line": {"color": color, "width": 1, "dash": "dash"},
    }
    note = {
        "x": x,
        "xref": "x",
        "y": 1,
        "yref": "paper",
        "text": ptext(label),
        "showarrow": False,
        "xanchor": "left",
        "yanchor": "top",
        "font": {"size": 10, "color": color},
        "xshift": 3,
    }
    return shape, note


def hline(y: float, label: str, color: str = MUTED) -> tuple[dict, dict]:
    shape = {
        "type": "line",
        "xref": "paper",
        "yref": "y",
        "x0": 0,
        "x1": 1,
        "y0": y,
        "y1": y,
        "line": {"color": color, "width": 1, "dash": "dash"},
    }
    note = {
        "x": 1,
        "xref": "paper",
        "y": y,
        "yref": "y",
        "text": ptext(label),
        "showarrow": False,
        "xanchor": "right",
        "yanchor": "bottom",
        "font": {"size": 10, "color": color},
    }
    return shape, note


def _log10_or_none(v) -> float | None:
    return math.log10(v) if v is not None and v > 0 and math.isfinite(v) else None


# -- run charts -------------------------------------------------------------------------------------
