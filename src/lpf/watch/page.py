"""The live page at /lpf/: one offline HTML page of what `lpf watch` has judged so far, refreshed by the browser.

Contract: `render_page(windows, counters, config=None, status=None, now=None) -> str`, pure. From the top:
- what it judges against (`config`: upstream, its dtype, the reference and its dtype, window size, sample
  rate) and `counters` (name -> number);
- the scoring lag and what could not be judged (`status`: the scorer's `live/scorer.json`: answered
  samples waiting and how long the oldest has waited at `now`, failed samples by status class, unscored
  ones by reason);
- a timeline (inline SVG, no script): each window's departure against the floor (its share of tokens
  beyond the floor over the share an honest engine stays under: 1 is the floor) on a log axis, alarmed
  windows in red, the incident's change point as a dashed line at its window, upstream-failing windows
  shaded, each window's failed requests as a bar under the axis;
- the windows (newest first, at most `SHOWN`): number, wall-clock span (UTC arrival of its first and last
  request), requests, tokens, verdicts, result (`lpf.watch.outages.window_result`), p-value, failures and
  unscorable samples in words, for an alarm its incident and change point (marked refined when the
  incident's evidence moved it), and its flagged requests (at most `LINKED`) as links into the drill-down of the
  report of the recording so far (`report.html#request-<id>`, served beside the page: `lpf.watch.snapshot`).
Every value is escaped. The page reloads itself every `REFRESH` seconds (a meta refresh). It is a summary,
not `report.html`: `lpf report DIR` on the recording draws the full report, `lpf inspect DIR REQUEST` one
flagged request.
"""

from __future__ import annotations

import math
import time
from html import escape
from urllib.parse import quote

from lpf.watch.outages import window_notes, window_result
from lpf.watch.snapshot import PAGE as REPORT_PAGE
from lpf.watch.snapshot import anchor

SHOWN = 200
REFRESH = 5
TIMELINE = 120  # windows on the timeline (the newest)
FLOOR_MIN = 1e-2  # departures below this (no token beyond the floor) are drawn at it
LINKED = 8  # flagged requests linked per window (the rest counted)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _clock(t) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) if isinstance(t, (int, float)) and t > 0 else "-"


def departure(w: dict) -> float | None:
    """The window's share of tokens beyond the floor over the share an honest engine stays under."""
    fr, er = w.get("flagged_rate"), w.get("expected_rate")
    if fr is None or not er:
        return None
    return max(fr / er, FLOOR_MIN)


def _timeline(windows: list[dict]) -> str:
    ws = windows[-TIMELINE:]
    if not ws:
        return "<p class='muted'>No window judged yet.</p>"
    width, height, left, top, plot_h, bar_h = 760, 190, 48, 10, 130, 30
    step = (width - left - 10) / max(len(ws), 1)
    values = [d for d in (departure(w) for w in ws) if d is not None]
    hi = max([10.0] + values)
    lo_log, hi_log = math.log10(FLOOR_MIN), math.ceil(math.log10(hi))

    def y(v: float) -> float:
        return top + plot_h * (1 - (math.log10(v) - lo_log) / (hi_log - lo_log))

    parts = [f"<svg width='{width}' height='{height}' role='img' aria-label='windows against the floor'>"]
    for e in range(int(lo_log), int(hi_log) + 1):  # the log axis: a line and a label per decade
        yy = y(10.0**e)
        parts.append(f"<line x1='{left}' x2='{width - 10}' y1='{yy:.1f}' y2='{yy:.1f}' class='grid'/>")
        parts.append(f"<text x='{left - 4}' y='{yy + 4:.1f}' text-anchor='end'>1e{e}</text>")
    yf = y(1.0)
    parts.append(f"<line x1='{left}' x2='{width - 10}' y1='{yf:.1f}' y2='{yf:.1f}' class='floor'/>")
    parts.append(f"<text x='{width - 12}' y='{yf - 3:.1f}' text-anchor='end' class='floor-label'>floor</text>")
    changes = set()
    for i, w in enumerate(ws):
        x = left + (i + 0.5) * step
        n = w.get("n_settled") or len(w.get("request_ids") or ()) or 1
        if w.get("upstream_failing"):
            parts.append(
                f"<rect x='{x - step / 2:.1f}' y='{top}' width='{step:.1f}' height='{plot_h}' class='failing'>"
                f"<title>window {escape(_fmt(w.get('window')))}: upstream failing</title></rect>"
            )
        failed = w.get("n_failed") or 0
        if failed:
            bh = bar_h * failed / n
            parts.append(
                f"<rect x='{x - step * 0.4:.1f}' y='{top + plot_h + 8 + bar_h - bh:.1f}' width='{step * 0.8:.1f}' "
                f"height='{bh:.1f}' class='failed'><title>{escape(_fmt(failed))} of {n} failed</title></rect>"
            )
        inc = w.get("incident") or {}
        change = w.get("change") or {}
        if w.get("alarm") and inc and (inc.get("id"), change.get("request_id")) not in changes:
            changes.add((inc.get("id"), change.get("request_id")))
            at = _window_of(ws, change.get("seq"))
            if at is not None:
                cx = left + (at + 0.5) * step
                parts.append(
                    f"<line x1='{cx:.1f}' x2='{cx:.1f}' y1='{top}' y2='{top + plot_h}' class='change'>"
                    f"<title>incident {escape(_fmt(inc.get('id')))}: change begins at "
                    f"{escape(_fmt(change.get('request_id')))}</title></line>"
                )
        d = departure(w)
        if d is not None:
            cls = "alarm" if w.get("alarm") else "ok"
            title = f"window {_fmt(w.get('window'))}: {_fmt(d)}x the floor, {window_result(w)}"
            parts.append(
                f"<circle cx='{x:.1f}' cy='{y(d):.1f}' r='3.5' class='{cls}'><title>{escape(title)}</title></circle>"
            )
        elif w.get("alarm"):  # tokens-only windows have no rate: the alarm still shows
            parts.append(f"<circle cx='{x:.1f}' cy='{top + 6}' r='3.5' class='alarm'/>")
    parts.append(f"<text x='{left}' y='{height - 2}'>failed requests per window</text></svg>")
    return "".join(parts)


def _window_of(ws: list[dict], seq) -> int | None:
    if seq is None:
        return None
    for i, w in enumerate(ws):
        if w.get("first_seq") is not None and w["first_seq"] <= seq <= (w.get("last_seq") or w["first_seq"]):
            return i
    return None


def _flagged_links(w: dict) -> str:
    flagged = [str(r) for r in w.get("flagged") or ()]
    if not flagged:
        return "-"
    links = [f"<a href='{REPORT_PAGE}#{escape(quote(anchor(r), safe=''))}'>{escape(r)}</a>" for r in flagged[:LINKED]]
    more = f" +{len(flagged) - LINKED} more" if len(flagged) > LINKED else ""
    return ", ".join(links) + more


def _status_lines(status: dict | None, now: float | None) -> str:
    if not status:
        return "<p class='muted'>The scorer has not reported yet.</p>"
    now = time.time() if now is None else now
    oldest = status.get("oldest_pending_arrival")
    lag_s = max(0.0, now - oldest) if oldest else 0.0
    failed = status.get("failed") or {}
    unscored = status.get("unscored") or {}
    items = [
        f"scoring lag: {_fmt(status.get('pending', 0))} answered samples waiting, oldest {lag_s:.0f} s",
        f"scored: {_fmt(status.get('scored', 0))} of {_fmt(status.get('recorded', 0))} recorded",
        "failed: " + (", ".join(f"{k} {v}" for k, v in sorted(failed.items())) or "none"),
        "not scorable: " + (", ".join(f"{k} {v}" for k, v in sorted(unscored.items())) or "none"),
    ]
    return "<ul>" + "".join(f"<li>{escape(i)}</li>" for i in items) + "</ul>"


def render_page(
    windows: list[dict],
    counters: dict,
    config: dict | None = None,
    status: dict | None = None,
    now: float | None = None,
) -> str:
    rows = []
    for w in list(reversed(windows))[:SHOWN]:
        test = w.get("run_test") or {}
        change = w.get("change") or {}
        inc = w.get("incident") or {}
        verdicts = ", ".join(f"{k} {v}" for k, v in sorted((w.get("verdicts") or {}).items()))
        where = ""
        if w.get("alarm"):
            where = (
                f"incident {_fmt(inc.get('id'))}: {_fmt(change.get('request_id'))}"
                if inc
                else _fmt(change.get("request_id"))
            )
            if change.get("refined"):
                where += " (refined)"
        cells = [
            w.get("window"),
            f"{_clock(w.get('t_first'))}..{_clock(w.get('t_last'))}",
            f"{_fmt(w.get('first_seq'))}..{_fmt(w.get('last_seq'))}",
            w.get("n_tokens"),
            verdicts or "-",
            window_result(w),
            test.get("p_value"),
            window_notes(w) or "-",
            "ALARM" if w.get("alarm") else "",
            where or "-",
        ]
        cls = ' class="alarm"' if w.get("alarm") else (' class="failing"' if w.get("upstream_failing") else "")
        tds = "".join(f"<td>{escape(_fmt(c))}</td>" for c in cells) + f"<td>{_flagged_links(w)}</td>"
        rows.append(f"<tr{cls}>{tds}</tr>")
    heads = [
        "window",
        "time (UTC)",
        "requests",
        "tokens",
        "verdicts",
        "result",
        "p-value",
        "failed / not scorable",
        "",
        "change begins at",
        "flagged requests (drill-down)",
    ]
    summary = " &middot; ".join(f"{escape(str(k))}: {escape(_fmt(v))}" for k, v in counters.items())
    judged = " &middot; ".join(f"{escape(str(k))}: {escape(_fmt(v))}" for k, v in (config or {}).items())
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<meta http-equiv='refresh' content='{REFRESH}'><title>lpf watch</title>"
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:left}tr.alarm{background:#fdd}"
        "tr.failing{background:#eee}.muted{color:#777}svg text{font-size:10px;fill:#555}"
        ".grid{stroke:#eee}.floor{stroke:#2a7;stroke-width:1.5}.floor-label{fill:#2a7}"
        ".change{stroke:#c00;stroke-dasharray:4 3;stroke-width:1.5}.failing{fill:#ddd}.failed{fill:#888}"
        "circle.ok{fill:#36c}circle.alarm{fill:#d00}</style>"
        f"</head><body><h1>lpf watch</h1><p>{judged}</p><p>{summary}</p>"
        f"{_status_lines(status, now)}<h2>Windows against the floor</h2>{_timeline(windows)}"
        "<table><tr>" + "".join(f"<th>{h}</th>" for h in heads) + "</tr>" + "".join(rows) + "</table>"
        f"<p><a href='{REPORT_PAGE}'>The report of the recording so far</a> (drawn when opened, again once more "
        "windows are judged). The recording is a run directory: <code>lpf analyze DIR</code>, "
        "<code>lpf report DIR</code>, <code>lpf inspect DIR REQUEST</code> for a flagged request.</p>"
        "</body></html>"
    )
