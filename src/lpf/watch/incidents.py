"""One change point per incident: alarmed windows in a row are one incident with one change point.

Contract: `Incidents(change_point)` is the scorer's memory of the open incident. `note(line, tables,
before)` is called for every judged window in arrival order (`line`: the window's JSON line, `tables`:
its scored (requests, tokens, reference) or None, `before`: the tables of the window judged before it, or
None) and edits `line` in place:
- the first alarmed window opens an incident (id: its window number) at its own change point;
- each later alarmed window of the open incident gets the incident's change point as its `change`
  (not a new one of its own), recomputed over the evidence so far (the window before the incident and
  up to MAX_EVIDENCE_WINDOWS of its windows: where the change begins does not move with later windows,
  which only add more tokens after it); when the estimate moves, `change.refined` is True and
  `change.was` names the earlier estimate, so a reader sees it was refined and from what;
- `line["incident"]` = {id, first_window, windows (alarmed so far), refined} on each alarmed window;
- a window with scored requests that does not alarm closes the incident; a window with nothing scored
  (an outage) leaves it open: it says nothing about the engine.
`change_point(requests, tokens, reference, flagged_ids)` is the windows module's estimator bound to the
run's info (`lpf.watch.windows.incident_change`). `restore(lines)` reopens the incident the last judged lines left
open (a restarted scorer keeps the incident's id and change point; the evidence tables start again).
"""

from __future__ import annotations

import pyarrow as pa

MAX_EVIDENCE_WINDOWS = 4


class Incidents:
    def __init__(self, change_point):
        self.change_point = change_point
        self.open: dict | None = None  # {id, first_window, windows, change, evidence: [tables], first_flagged}

    def restore(self, lines: list[dict]) -> None:
        for line in lines:
            inc = line.get("incident")
            if line.get("alarm") and inc:
                self.open = {
                    "id": inc["id"],
                    "first_window": inc["first_window"],
                    "windows": inc.get("windows", 1),
                    "change": line.get("change"),
                    "evidence": [],
                    "flagged": [],
                }
            elif line.get("n_requests") and not line.get("alarm"):
                self.open = None

    def note(self, line: dict, tables, before) -> None:
        if not line.get("alarm"):
            if line.get("n_requests"):
                self.open = None
            return
        flagged = list(line.get("flagged") or [])
        if self.open is None:
            self.open = {
                "id": line["window"],
                "first_window": line["window"],
                "windows": 1,
                "change": line.get("change"),
                "evidence": [t for t in (before, tables) if t is not None],
                "flagged": flagged,
            }
            line["incident"] = {"id": line["window"], "first_window": line["window"], "windows": 1, "refined": False}
            return
        inc = self.open
        inc["windows"] += 1
        if tables is not None and len(inc["evidence"]) <= MAX_EVIDENCE_WINDOWS:
            inc["evidence"].append(tables)
            inc["flagged"] = inc["flagged"] + flagged
            req, tok, ref = (pa.concat_tables([t[i] for t in inc["evidence"]]) for i in range(3))
            new = self.change_point(req, tok, ref, inc["flagged"])
            old = inc["change"] or {}
            if new and new.get("request_id") != old.get("request_id"):
                was = {k: old.get(k) for k in ("request_id", "seq")} if old else None
                inc["change"] = {**new, "refined": True, "was": was}
        line["change"] = inc["change"]
        line["incident"] = {
            "id": inc["id"],
            "first_window": inc["first_window"],
            "windows": inc["windows"],
            "refined": bool((inc["change"] or {}).get("refined")),
        }
