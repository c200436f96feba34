"""The live page at /lpf/: one offline HTML page of what `lpf watch` has judged so far, refreshed by the browser.

Contract: `render_page(windows, counters) -> str`, pure: the judged windows (newest first, at most
`SHOWN`), each with its requests, tokens, verdict counts, run-test result and p-value, and for an alarm its
change point; `counters` (name -> number) above them. Every value is escaped. The page reloads itself every
`REFRESH` seconds (a meta refresh: no script). It is a summary, not `report.html`: `lpf report DIR` on the
recording draws the full report.
"""

from __future__ import annotations

from html import escape

SHOWN = 200
REFRESH = 5


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def render_page(windows: list[dict], counters: dict) -> str:
    rows = []
    for w in list(reversed(windows))[:SHOWN]:
        test = w.get("run_test") or {}
        change = w.get("change") or {}
        verdicts = ", ".join(f"{k} {v}" for k, v in sorted((w.get("verdicts") or {}).items()))
        cells = [
            w.get("window"),
            f"{_fmt(w.get('first_seq'))}..{_fmt(w.get('last_seq'))}",
            w.get("n_tokens"),
            verdicts or "-",
            test.get("result"),
            test.get("p_value"),
            "ALARM" if w.get("alarm") else "",
            change.get("request_id"),
        ]
        cls = ' class="alarm"' if w.get("alarm") else ""
        rows.append(f"<tr{cls}>" + "".join(f"<td>{escape(_fmt(c))}</td>" for c in cells) + "</tr>")
    heads = ["window", "requests", "tokens", "verdicts", "run test", "p-value", "", "change begins at"]
    summary = " &middot; ".join(f"{escape(str(k))}: {escape(_fmt(v))}" for k, v in counters.items())
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<meta http-equiv='refresh' content='{REFRESH}'><title>lpf watch</title>"
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:left}tr.alarm{background:#fdd}</style>"
        f"</head><body><h1>lpf watch</h1><p>{summary}</p>"
        "<table><tr>" + "".join(f"<th>{h}</th>" for h in heads) + "</tr>" + "".join(rows) + "</table>"
        "<p>The recording is a run directory: <code>lpf analyze DIR</code>, <code>lpf report DIR</code>.</p>"
        "</body></html>"
    )
