"""The report the live page links into: `lpf analyze` over a snapshot of the recording so far.

Contract: `Snapshots(run_path)`; `await snapshots.report(n_windows)` returns the bytes of `live/report/report.html`,
a full `report.html` (its drill-down anchors each shown request as `#request-<id>`) of the recording as it stood
when the last one was made, made again first when more windows have been judged since (`n_windows`: the
supervisor's count) or when there is none; an LpfError says why it could not be made. One is made at a time (a
second caller waits for it and reads it). The snapshot is a run directory of its own (`live/report/`): the
manifest copied and every committed part of the recording hard-linked (parts are immutable once renamed into
place, and a part that `--retain` deletes later lives on in the snapshot), so the analysis never opens the live
recording (`RunDir.open` deletes a tokens part whose requests part the recorder has not written yet, and a
`.tmp-` file being written). `lpf analyze SNAPSHOT --no-attribution` runs in a child process (no reference model
loaded, nothing of it in the proxy's process) and writes the findings and report.html there.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

from lpf.core.errors import LpfError

REPORT_DIR = "live/report"
PAGE = "report.html"
TIMEOUT_S = 300.0


def anchor(request_id: str) -> str:
    """The report's drill-down anchor of a request (report.js gives each shown request this id)."""
    return f"request-{request_id}"


def link_parts(run_path: Path, target: Path) -> None:
    """`target` becomes a run directory holding the recording's manifest and committed parts (hard links)."""
    target.mkdir(parents=True)
    shutil.copy2(run_path / "manifest.json", target / "manifest.json")
    for sub in sorted(p for p in run_path.iterdir() if p.is_dir() and p.name != "live"):
        parts = [p for p in sub.glob("part-*.parquet")]
        if not parts:
            continue
        (target / sub.name).mkdir()
        for p in parts:
            try:
                os.link(p, target / sub.name / p.name)
            except FileNotFoundError:  # deleted by --retain between the listing and the link
                pass
            except OSError:  # a file system without hard links: a copy
                shutil.copy2(p, target / sub.name / p.name)


class Snapshots:
    def __init__(self, run_path: Path):
        self.run_path = Path(run_path)
        self.made_at: int | None = None  # windows judged when the current one was made
        self.lock = asyncio.Lock()

    async def report(self, n_windows: int) -> bytes:
        async with self.lock:  # (read inside it: the next one replaces the directory)
            page = self.run_path / REPORT_DIR / PAGE
            if self.made_at is None or n_windows > self.made_at or not page.is_file():
                await self._make()
                self.made_at = n_windows
            return page.read_bytes()

    async def _make(self) -> None:
        final = self.run_path / REPORT_DIR
        new = final.with_name("report.new")
        shutil.rmtree(new, ignore_errors=True)
        link_parts(self.run_path, new)
        if not (new / "requests").is_dir():
            shutil.rmtree(new, ignore_errors=True)
            raise LpfError("nothing recorded yet: no report to draw")
        argv = [sys.executable, "-m", "lpf", "analyze", str(new), "--no-attribution", "--fail-on", "never"]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=dict(os.environ)
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0 or not (new / PAGE).is_file():
            why = err.decode(errors="replace").strip().splitlines()
            raise LpfError(f"lpf analyze on the snapshot failed: {why[-1] if why else proc.returncode}")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(new, final)
