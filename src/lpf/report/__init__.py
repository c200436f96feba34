"""`report.html`: one self-contained, offline page for a run, sweep, shrink or RL directory.

`write_report(path) -> Path` detects the directory's kind by the files present (run: manifest.json
+ findings.json; sweep: sweep.json; shrink: shrink.json; conformance: conformance.json; locate:
locate.json; RL: rl_findings.json + rl_steps.parquet), gathers what the page shows (`run_page`,
`sweep_page`, `shrink_page`, `conformance_page`, `locate_page`, `rl_page`), renders it (`html`) and writes DIR/report.html
atomically. Raises LpfError for a directory that is none of these or whose files are unreadable.
"""

from __future__ import annotations

import os
from pathlib import Path

from lpf.core.errors import LpfError


def detect_kind(path: Path) -> str:
    if (path / "sweep.json").is_file():
        return "sweep"
    if (path / "shrink.json").is_file():
        return "shrink"
    if (path / "conformance.json").is_file():
        return "conformance"
    if (path / "locate.json").is_file():
        return "locate"
    if (path / "rl_findings.json").is_file() and (path / "rl_steps.parquet").is_file():
        return "rl"
    if (path / "manifest.json").is_file() and (path / "findings.json").is_file():
        return "run"
    if (path / "manifest.json").is_file():
        raise LpfError(f"{path} has no findings.json yet: run `lpf analyze {path}` first")
    raise LpfError(
        f"{path} is not a run, sweep, shrink, conformance, locate or RL directory "
        f"(no findings.json, sweep.json, shrink.json, conformance.json, locate.json or rl_findings.json)"
    )


def build_page(path: Path) -> tuple[dict, str]:
    """(page data, page title) for a directory."""
    kind = detect_kind(path)
    if kind == "sweep":
        from lpf.report import sweep_page

        return sweep_page.load(path), f"lpf sweep · {path.name}"
    if kind == "shrink":
        from lpf.report import shrink_page

        return shrink_page.load(path), f"lpf shrink · {path.name}"
    if kind == "conformance":
        from lpf.report import conformance_page

        return conformance_page.load(path), f"lpf conformance · {path.name}"
    if kind == "locate":
        from lpf.report import locate_page

        page = locate_page.load(path)
        return page, f"lpf locate · {page['doc'].get('request_id')} · {path.name}"
    if kind == "rl":
        from lpf.report import rl_page

        return rl_page.load(path), f"lpf RL · {path.name}"
    from lpf.report import run_page

    page = run_page.load(path)
    return page, f"lpf · {page['findings'].get('verdict', '?')} · {path.name}"


def write_report(path) -> Path:
    from lpf.report.html import render

    path = Path(path)
    if not path.is_dir():
        raise LpfError(f"{path} is not a directory")
    page, title = build_page(path)
    out = path / "report.html"
    tmp = path / ".tmp-report.html"
    tmp.write_text(render(page, title), encoding="utf-8")
    os.replace(tmp, out)
    return out
