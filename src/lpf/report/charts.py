"""Plotly figure specs for the report, as plain dicts: numpy in, `{"data": [...], "layout": {...}}` out.

Pure functions (no I/O, no plotly import: the page hands these dicts to the bundled plotly.js).
Every chart here uses SVG traces only (no WebGL), so it renders in any browser, headless included.
Sizes are bounded whatever the run's size: scatters are downsampled (`downsample_by_bin`), series
over steps are binned (`bin_series`), histograms are counts.
Any text that plotly draws (hover labels, tick text) goes through `ptext`, because plotly reads a
subset of HTML in text: model-derived strings must arrive as entities, never as tags.
"""

from __future__ import annotations

import math

import numpy as np

from lpf.report.chart_style import (
    GRID,
    MAX_SCATTER_POINTS,
    MAX_SERIES_POINTS,
    SERIES,
    VERDICT_COLORS,
    _log10_or_none,
    base_layout,
    hline,
    ptext,
    sig,
    sig_list,
    vline,
)


def diff_histogram(
    abs_diff: np.ndarray, clean_th: float | None, divergent_th: float | None, bins_per_decade: int = 5
) -> dict:
    """Histogram of per-token |logprob diff| on log-log axes; exact zeros get their own bar."""
    ad = np.asarray(abs_diff, dtype=float)
    finite = ad[np.isfinite(ad)]
    n_bad = int(ad.size - finite.size)
    zeros = int(np.count_nonzero(finite == 0))
    pos = finite[finite > 0]
    shapes, notes, data = [], [], []
    lo = hi = 0
    if pos.size:
        logs = np.log10(pos)
        # the axis always spans the thresholds too: "how far below clean" is half the story
        th_logs = [x for x in (_log10_or_none(clean_th), _log10_or_none(divergent_th)) if x is not None]
        lo = max(math.floor(min([float(logs.min())] + th_logs)), -12)
        hi = max(math.ceil(max([float(logs.max())] + th_logs)), lo + 1)
        edges = np.linspace(lo, hi, (hi - lo) * bins_per_decade + 1)
        counts, _ = np.histogram(np.clip(logs, lo, hi), bins=edges)
        centers = (edges[:-1] + edges[1:]) / 2
        colors = [_region_color(10**c, clean_th, divergent_th) for c in centers]
        keep = counts > 0
        data.append(
            {
                "type": "bar",
                "x": sig_list(centers[keep], 4),
                "y": counts[keep].tolist(),
                "width": 1 / bins_per_decade,
                "marker": {"color": [c for c, k in zip(colors, keep) if k]},
                "customdata": [[sig(10**a, 3), sig(10**b, 3)] for a, b, k in zip(edges[:-1], edges[1:], keep) if k],
                "hovertemplate": "|diff| %{customdata[0]} – %{customdata[1]}<br>%{y} tokens<extra></extra>",
                "name": "tokens",
                "showlegend": False,
            }
        )
    zero_x = lo - 0.8
    if zeros:
        data.append(
            {
                "type": "bar",
                "x": [zero_x],
                "y": [zeros],
                "width": 0.5,
                "name": "exactly 0",
                "marker": {"color": "#86efac"},
                "showlegend": False,
                "hovertemplate": "|diff| = 0 exactly<br>%{y} tokens<extra></extra>",
            }
        )
    for th, label, color in (
        (clean_th, "clean ≤ %g", VERDICT_COLORS["noise"]),
        (divergent_th, "divergent > %g", VERDICT_COLORS["divergent"]),
    ):
        x = _log10_or_none(th)
        if x is not None and pos.size and lo - 0.5 <= x <= hi + 0.5:
            s, a = vline(x, label % th, color)
            shapes.append(s)
            notes.append(a)
    if n_bad:
        notes.append(
            {
                "x": 1,
                "xref": "paper",
                "y": 1.08,
                "yref": "paper",
                "showarrow": False,
                "xanchor": "right",
                "text": f"{n_bad} tokens without a finite logprob (not shown)",
                "font": {"size": 10, "color": "#b91c1c"},
            }
        )
    ticks = list(range(lo, hi + 1))
    tickvals = ([zero_x] if zeros else []) + ticks
    ticktext = (["0"] if zeros else []) + [_decade(k) for k in ticks]
    top = max([zeros] + [max(d["y"]) for d in data if d["y"]])
    layout = base_layout(
        height=320,
        shapes=shapes,
        annotations=notes,
        xaxis={
            "title": {"text": "|engine logprob − reference logprob| per token"},
            "tickvals": tickvals,
            "ticktext": ticktext,
        },
        # log counts only when counts span enough to need it (else plotly crowds minor labels)
        yaxis={"title": {"text": "tokens"}, **({"type": "log", "exponentformat": "e"} if top >= 50 else {})},
    )
    return {"data": data, "layout": layout}


def _decade(k: int) -> str:
    return {0: "1", 1: "10", -1: "0.1", 2: "100"}.get(k, f"1e{k}")


def _region_color(v: float, clean_th, divergent_th) -> str:
    if divergent_th is not None and v > divergent_th:
        return VERDICT_COLORS["divergent"]
    if clean_th is not None and v > clean_th:
        return VERDICT_COLORS["noise"]
    return VERDICT_COLORS["clean"]


def downsample_by_bin(x: np.ndarray, y: np.ndarray, keep: np.ndarray, max_points: int) -> np.ndarray:
    """Indices to plot: every `keep` row (up to max_points // 2, largest y first), and among the rest
    the largest y per x-bin so the envelope of the cloud survives. Sorted by x."""
    n = len(x)
    if n <= max_points:
        return np.arange(n)
    yy = np.where(np.isfinite(y), y, np.inf)
    kept = np.flatnonzero(keep)
    if kept.size > max_points // 2:
        kept = kept[np.argsort(-yy[kept], kind="stable")[: max_points // 2]]
    rest = np.flatnonzero(~keep)
    n_bins = max(1, max_points - kept.size)
    if rest.size > n_bins:
        xr = x[rest]
        edges = np.linspace(xr.min(), xr.max() + 1e-9, n_bins + 1)
        b = np.searchsorted(edges, xr, side="right") - 1
        order = np.lexsort((-yy[rest], b))  # by bin, then largest y first: each bin's first row is its max
        first = np.r_[True, b[order][1:] != b[order][:-1]]
        rest = rest[order[first]]
    idx = np.concatenate([kept, rest])
    return idx[np.argsort(x[idx], kind="stable")]


def request_scatter(
    seq: np.ndarray,
    max_diff: np.ndarray,
    verdict: np.ndarray,
    request_id: np.ndarray,
    clean_th: float | None,
    divergent_th: float | None,
    max_points: int = MAX_SCATTER_POINTS,
) -> tuple[dict, int]:
    """Per-request max |diff| against arrival index, one trace per verdict. Returns (figure, points shown)."""
    seq = np.asarray(seq, dtype=float)
    md = np.asarray(max_diff, dtype=float)
    verdict = np.asarray(verdict, dtype=object)
    flagged = np.isin(verdict, ["divergent", "corrupt", "error"])
    idx = downsample_by_bin(seq, md, flagged, max_points)
    finite = md[np.isfinite(md)]
    positive = finite[finite > 0]
    floor = 10 ** math.floor(math.log10(positive.min())) / 10 if positive.size else 1e-9
    top = float(positive.max()) * 3 if positive.size else 1.0
    data = []
    for v in ("clean", "noise", "unscored", "error", "divergent", "corrupt"):
        sel = idx[verdict[idx] == v]
        if not sel.size:
            continue
        raw = md[sel]
        shown = np.where(~np.isfinite(raw), top, np.maximum(raw, floor))
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": v,
                "x": seq[sel].astype(int).tolist(),
                "y": sig_list(shown, 4),
                "customdata": [
                    [ptext(r), "inf" if not math.isfinite(d) else f"{d:.3g}"]
                    for r, d in zip(request_id[sel].tolist(), raw.tolist())
                ],
                "hovertemplate": "%{customdata[0]}<br>arrival %{x}<br>max |diff| %{customdata[1]}<extra>"
                + v
                + "</extra>",
                "marker": {
                    "color": VERDICT_COLORS[v],
                    "size": 5 if v in ("clean", "noise") else 7,
                    "opacity": 0.55 if v in ("clean", "noise") else 0.9,
                    "line": {"width": 0},
                },
            }
        )
    shapes, notes = [], []
    for th, label, color in (
        (clean_th, "clean ≤ %g", VERDICT_COLORS["noise"]),
        (divergent_th, "divergent > %g", VERDICT_COLORS["divergent"]),
    ):
        if th is not None and th > 0:
            s, a = hline(th, label % th, color)
            shapes.append(s)
            notes.append(a)
    layout = base_layout(
        height=360,
        shapes=shapes,
        annotations=notes,
        xaxis={"title": {"text": "arrival index (seq)"}},
        yaxis={"title": {"text": "max |diff| in request"}, "type": "log", "exponentformat": "e"},
    )
    return {"data": data, "layout": layout}, int(idx.size)


def first_divergence_chart(positions: np.ndarray, verdict: np.ndarray, max_bars: int = 256) -> dict:
    """Stacked bars: how many flagged requests first diverge at each output position."""
    positions = np.asarray(positions, dtype=np.int64)
    verdict = np.asarray(verdict, dtype=object)
    data = []
    if positions.size:
        width = max(1, math.ceil((int(positions.max()) + 1) / max_bars))
        for v in ("divergent", "corrupt"):
            p = positions[verdict == v]
            if not p.size:
                continue
            counts = np.bincount(p // width)
            nz = np.flatnonzero(counts)
            x = (nz * width).tolist()
            data.append(
                {
                    "type": "bar",
                    "name": v,
                    "x": x,
                    "y": counts[nz].tolist(),
                    "marker": {"color": VERDICT_COLORS[v]},
                    "width": 0.85 * width,
                    "hovertemplate": ("position %{x}" if width == 1 else f"positions %{{x}}–+{width - 1}")
                    + "<br>%{y} requests<extra>"
                    + v
                    + "</extra>",
                }
            )
    layout = base_layout(
        height=300,
        barmode="stack",
        xaxis={"title": {"text": "output position of the first divergent token"}, "rangemode": "tozero"},
        yaxis={"title": {"text": "flagged requests"}},
    )
    return {"data": data, "layout": layout}


def bin_series(
    x: np.ndarray, columns: dict[str, np.ndarray], how: dict[str, str], max_points: int = MAX_SERIES_POINTS
) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """Bins a per-x series to at most max_points: each column aggregated by its `how` (mean|max|sum).
    Returns (bin start x, columns, bin width in x units; 1 when nothing was binned)."""
    x = np.asarray(x)
    if x.size <= max_points:
        return x, columns, 1
    width = math.ceil((int(x.max()) - int(x.min()) + 1) / max_points)
    b = (x - x.min()) // width
    uniq, inv = np.unique(b, return_inverse=True)
    out = {}
    for name, col in columns.items():
        col = np.asarray(col, dtype=float)
        op = how.get(name, "mean")
        if op == "sum":
            out[name] = np.bincount(inv, weights=col, minlength=uniq.size)
        elif op == "max":
            acc = np.full(uniq.size, -np.inf)
            np.maximum.at(acc, inv, col)
            out[name] = acc
        else:
            out[name] = np.bincount(inv, weights=col, minlength=uniq.size) / np.bincount(inv, minlength=uniq.size)
    return uniq * width + x.min(), out, width


def step_series(
    steps: np.ndarray,
    batch_size: np.ndarray,
    batch_tokens: np.ndarray,
    flagged_active: np.ndarray,
    flagged_marks: np.ndarray,
    marks_label: str,
    onset_step: int | None,
) -> dict:
    """Two stacked panels over engine steps: batch size / tokens, and flagged requests in the batch
    with markers (`flagged_marks` per step: where they diverged, or were first scheduled)."""
    x, cols, width = bin_series(
        steps,
        {"bs": batch_size, "bt": batch_tokens, "fa": flagged_active, "fs": flagged_marks},
        {"bs": "mean", "bt": "mean", "fa": "max", "fs": "sum"},
    )
    per = "" if width == 1 else f" (per {width} steps: mean / max)"
    data = [
        {
            "type": "scatter",
            "mode": "lines",
            "name": "batch tokens",
            "x": x.tolist(),
            "y": sig_list(cols["bt"], 4),
            "line": {"color": SERIES[0], "width": 1.3},
            "yaxis": "y",
        },
        {
            "type": "scatter",
            "mode": "lines",
            "name": "batch size (requests)",
            "x": x.tolist(),
            "y": sig_list(cols["bs"], 4),
            "line": {"color": SERIES[1], "width": 1.3},
            "yaxis": "y2",
        },
        {
            "type": "bar",
            "name": "flagged requests in batch",
            "x": x.tolist(),
            "y": sig_list(cols["fa"], 4),
            "marker": {"color": VERDICT_COLORS["divergent"]},
            "yaxis": "y3",
        },
    ]
    started = np.asarray(cols["fs"], dtype=float)
    nz = np.flatnonzero(started > 0)
    if nz.size:
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": ptext(marks_label),
                "x": x[nz].tolist(),
                "y": sig_list(started[nz], 4),
                "yaxis": "y3",
                "marker": {"color": VERDICT_COLORS["corrupt"], "symbol": "triangle-up", "size": 8},
            }
        )
    shapes, notes = [], []
    if onset_step is not None:
        s, a = vline(onset_step, f"onset: step {onset_step}", VERDICT_COLORS["corrupt"])
        shapes.append(s)
        notes.append(a)
    layout = base_layout(
        height=420,
        shapes=shapes,
        annotations=notes,
        barmode="overlay",
        xaxis={"title": {"text": "engine step" + per}, "anchor": "y3"},
        yaxis={"domain": [0.42, 1.0], "title": {"text": "tokens"}, "rangemode": "tozero"},
        yaxis2={
            "overlaying": "y",
            "side": "right",
            "title": {"text": "requests"},
            "showgrid": False,
            "zeroline": False,
            "tickmode": "auto",
            "rangemode": "tozero",
        },
        yaxis3={"domain": [0.0, 0.3], "title": {"text": "flagged"}, "gridcolor": GRID, "rangemode": "tozero"},
    )
    layout["margin"]["r"] = 64
    return {"data": data, "layout": layout}


FLOOR_BARS = (
    ("token", "q99", "token error, q99"),
    ("token", "median", "token error, median"),
    ("topk", "q99", "top-k spread, q99"),
    ("topk", "median", "top-k spread, median"),
    ("settled", "q99", "settled |d|, q99"),
)


def floor_chart(run_test: dict) -> dict | None:
    """The run-level test's floors: observed (this run) against expected (its dtype pair), log scale.
    Token error is |d| / sensitivity over informative tokens; top-k spread is the spread of the shared
    top-k logprob errors; settled is |d| where the reference is sure (`lpf.analysis.floors`)."""
    floors = run_test.get("floors") or {}
    exp, obs = floors.get("expected") or {}, floors.get("observed") or {}

    def value(f, group, name):
        v = (f.get(group) or {}).get(name)
        return sig(v, 4) if isinstance(v, (int, float)) and v > 0 else None

    bars = [(label, value(exp, g, n), value(obs, g, n)) for g, n, label in FLOOR_BARS]
    bars = [b for b in bars if b[1] is not None or b[2] is not None]
    if not bars:
        return None
    labels = [ptext(b[0]) for b in bars]
    color = VERDICT_COLORS["systematic"] if run_test.get("result") == "different" else VERDICT_COLORS["clean"]
    pair = ptext(run_test.get("floor_pair") or "?")
    data = [
        {
            "type": "bar",
            "name": f"expected ({pair})",
            "x": labels,
            "y": [b[1] for b in bars],
            "marker": {"color": "#9ca3af"},
            "hovertemplate": "expected %{y:.3g}<extra>%{x}</extra>",
        },
        {
            "type": "bar",
            "name": "observed (this run)",
            "x": labels,
            "y": [b[2] for b in bars],
            "marker": {"color": color},
            "hovertemplate": "observed %{y:.3g}<extra>%{x}</extra>",
        },
    ]
    layout = base_layout(
        height=300,
        barmode="group",
        xaxis={"type": "category", "automargin": True},
        yaxis={"type": "log", "exponentformat": "e", "title": {"text": "nats"}},
    )
    return {"data": data, "layout": layout}
