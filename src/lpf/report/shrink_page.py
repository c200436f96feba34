"""The report page of a shrink directory (`lpf shrink RUN --out DIR`): shrink.json into one JSON-ready dict.

The page shows the target and its signature, original vs minimal (requests, tokens, knobs off the
engine's default), the outcome (status, runs used, determinism, confirmation), the search's steps
(every candidate: phase, what was tried, its size, what the target did in each run, whether it
was adopted) with a chart of the sizes tried, and links to the reproducer's files and to each
candidate run's own report. Fields that are missing are tolerated: writer and page are built side
by side.
"""

from __future__ import annotations

from pathlib import Path

from lpf.report import experiment_charts
from lpf.report.sweep_page import read_doc, run_link

FILES = ("report.md", "command.sh", "repro.py", "workload.jsonl", "shrink.json")


def load(path: Path) -> dict:
    doc = read_doc(path, "shrink.json", "candidates", "shrink")
    adopted = set(doc.get("path") or [])
    steps, best, smallest = [], [], None
    for c in doc["candidates"]:
        if not isinstance(c, dict):
            continue
        size = c.get("size") or [0, 0, 0]
        if c.get("id") in adopted:
            smallest = size[0] if smallest is None else min(smallest, size[0])
        best.append(smallest)
        steps.append(
            {
                "id": c.get("id"),
                "phase": c.get("phase"),
                "step": c.get("step"),
                "description": c.get("description"),
                "size": size,
                "status": c.get("status"),
                "adopted": c.get("id") in adopted,
                "tries": [
                    dict(t, link=run_link(path, t.get("dir"))) for t in c.get("tries") or [] if isinstance(t, dict)
                ],
            }
        )
    chart = (
        experiment_charts.shrink_progress(
            [s["id"] for s in steps],
            [s["step"] or "" for s in steps],
            [s["size"] for s in steps],
            [s["status"] == "reproduces" for s in steps],
            best,
        )
        if steps
        else None
    )
    keys = (
        "target",
        "target_row",
        "signature",
        "signature_description",
        "signature_note",
        "status",
        "runs_used",
        "budget_runs",
        "deterministic",
        "confirmation",
        "original",
        "minimal",
        "source_run",
        "engine",
        "model",
        "tries",
        "need",
    )
    return {
        "kind": "shrink",
        "shrink": {k: doc.get(k) for k in keys},
        "steps": steps,
        "chart": chart,
        "files": [name for name in FILES if (path / name).is_file()],
    }
