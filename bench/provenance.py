"""What a bench result records about the code it measured, so the table can say when it is stale.

Contract: `stamp(doc)` returns `doc` (a dict, the results file's top level) with `commit` (the full
hash of the checkout's HEAD, or None outside a git checkout) and `dirty` (whether tracked files under
src/ or bench/ differed from HEAD when it ran: then the commit is not exactly the code measured), and
`date` (today, UTC) when the bench recorded none. scripts/bench_table.py compares `commit` with the
paths each bench covers (git log) to mark a row stale.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def stamp(doc: dict) -> dict:
    commit = _git("rev-parse", "HEAD")
    changes = _git("status", "--porcelain", "--untracked-files=no", "--", "src", "bench", ":(exclude)bench/results")
    out = dict(doc)
    out.setdefault("date", time.strftime("%Y-%m-%d", time.gmtime()))
    out["commit"] = commit
    out["dirty"] = bool(changes) if changes is not None else None
    return out
