"""The report page of a conformance directory (`lpf conformance --out DIR`): conformance.json as a matrix.

Architecture x cell: each entry shows the cell's verdict (output, and prompt positions when they
differ), the largest |logprob diff| on prompt and output positions, the first divergence, the top
hypothesis, the `lpf diff` attribution and the `lpf locate` line (linked to its page), and links to
the cell's own report; a cell the engine's own judgement calls clean although its verdict is not says
how (llama.cpp's per-token judgement with the departures it names, bf16's per-position test against
the ensemble of honest bf16 runs, or the older bf16 envelope). The reference column (the reference's
own paths against its float64 gold, `--grid full`) is listed per architecture, and the architectures
that were not audited with their reason. Fields missing from an older document are tolerated.
"""

from __future__ import annotations

import json
from pathlib import Path

from lpf.core.errors import LpfError


def load(path: Path) -> dict:
    try:
        doc = json.loads((path / "conformance.json").read_text())
    except json.JSONDecodeError as e:
        raise LpfError(f"{path / 'conformance.json'}: unreadable JSON ({e.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cells"), list):
        raise LpfError(f"{path / 'conformance.json'}: not a conformance document (no cells list)")
    rows = [r for r in doc["cells"] if isinstance(r, dict)]
    for r in rows:  # a link only to a page that exists inside the directory
        link = r.get("link")
        r["link"] = link if isinstance(link, str) and (path / link).is_file() and ".." not in Path(link).parts else None
        lc = r.get("locate")
        if isinstance(lc, dict):  # the locate line links to its page only when it is there
            ll = lc.get("link")
            lc["link"] = ll if isinstance(ll, str) and (path / ll).is_file() and ".." not in Path(ll).parts else None
    order = [a.get("architecture") for a in doc.get("architectures") or [] if isinstance(a, dict)]
    audited = [a for a in order if any(r.get("architecture") == a for r in rows)]
    return {
        "kind": "conformance",
        "engine": doc.get("engine"),
        "engine_version": doc.get("engine_version"),
        "reference": doc.get("reference"),
        "grid": doc.get("grid"),
        "complete": doc.get("complete"),
        "elapsed_s": doc.get("elapsed_s"),
        "cells": doc.get("cell_catalogue") or [],
        "rows": rows,
        "audited": audited,
        "reference_column": [_reference_row(r) for r in doc.get("reference_column") or [] if isinstance(r, dict)],
        "not_audited": [
            a for a in doc.get("architectures") or [] if isinstance(a, dict) and a.get("status") != "audit"
        ],
    }


def _reference_row(r: dict) -> dict:
    """One architecture of the reference column: its status, the paths that depart, and per path its
    largest |d| from the gold and the first departing position."""
    paths = r.get("paths") if isinstance(r.get("paths"), dict) else {}
    return {
        "architecture": r.get("architecture"),
        "status": r.get("status"),
        "departing": [n for n in r.get("departing") or [] if isinstance(n, str)],
        "paths": {
            n: {"max_abs": v.get("max_abs"), "first_departure": v.get("first_departure")}
            for n, v in paths.items()
            if isinstance(v, dict)
        },
        "reason": r.get("error") or r.get("reason"),
    }
