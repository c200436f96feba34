"""Retention of `lpf watch`'s rolling run directory: the oldest committed samples go once it is too big or too old.

Contract: `parse_retain(values) -> Retention` reads `--retain` values: a size (`500MB`, `20GB`, `1.5TB`, `4096B`)
and/or an age (`90s`, `30m`, `12h`, `7d`); anything else is an `LpfError`. `Retention.prune(run_path, now)`
deletes, oldest first, whole commits of the recorder while the run's parts weigh more than `max_bytes` or the
oldest requests part is older than `max_age` (its modification time), and returns (parts deleted, bytes freed).
A commit is a requests part with the tokens / prompt_tokens part of its number and the `watch` parts written
no later than it; the requests part goes first (a request is recorded iff its requests part exists: a kill
in between leaves a tokens orphan that `RunDir.open` removes, never a request without its tokens). Reference
parts (`reference`, `prompt_reference`, `seeded`: the scorer's) written before the deleted requests part go
with it: the scorer writes a reference part after every request in it was committed, so such a part holds
only requests already deleted. The newest requests part is never deleted (part numbers continue from it).
The size counted is the parts' bytes (requests, tokens, prompt_tokens, watch and the reference tables); the
manifest and `live/` are small and stay.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lpf.core.errors import LpfError

UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400}
PAIRED = ("tokens", "prompt_tokens")  # committed under the requests part's number
SCORED = ("reference", "prompt_reference", "seeded")
COUNTED = ("requests", *PAIRED, "watch", *SCORED)
_SPEC = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


@dataclass(frozen=True)
class Retention:
    max_bytes: int | None = None
    max_age: float | None = None  # seconds

    def __bool__(self) -> bool:
        return self.max_bytes is not None or self.max_age is not None

    def prune(self, run_path: Path, now: float) -> tuple[int, int]:
        if not self:
            return 0, 0
        files = {t: _parts(run_path / t) for t in COUNTED}
        size = sum(st.st_size for t in COUNTED for _, st in files[t])
        deleted = freed = 0
        requests = files["requests"]
        for path, st in requests[:-1]:  # oldest first; the newest stays
            too_big = self.max_bytes is not None and size > self.max_bytes
            too_old = self.max_age is not None and now - st.st_mtime > self.max_age
            if not (too_big or too_old):
                break
            group = [(path, st)]
            group += [(p, s) for t in PAIRED for p, s in files[t] if p.name == path.name]
            group += [(p, s) for p, s in files["watch"] if s.st_mtime_ns <= st.st_mtime_ns]
            group += [(p, s) for t in SCORED for p, s in files[t] if s.st_mtime_ns < st.st_mtime_ns]
            for p, s in group:  # the requests part first
                try:
                    p.unlink()
                except FileNotFoundError:
                    continue
                deleted, freed, size = deleted + 1, freed + s.st_size, size - s.st_size
            gone = {p for p, _ in group}
            files = {t: [(p, s) for p, s in files[t] if p not in gone] for t in COUNTED}
        return deleted, freed


def _parts(d: Path) -> list:
    """(path, stat) of a table's parts, oldest part number first."""
    out = []
    for p in sorted(d.glob("part-*.parquet")) if d.is_dir() else ():
        try:
            out.append((p, p.stat()))
        except FileNotFoundError:
            pass
    return out


def parse_retain(values) -> Retention:
    max_bytes = max_age = None
    for v in values or ():
        m = _SPEC.match(str(v))
        unit = m.group(2).lower() if m else ""
        if m and unit in UNITS:
            max_bytes = int(float(m.group(1)) * UNITS[unit])
        elif m and unit in AGES:
            max_age = float(m.group(1)) * AGES[unit]
        else:
            raise LpfError(f"--retain takes a size (500MB, 20GB) or an age (12h, 7d), got {v!r}")
        if (max_bytes is not None and max_bytes <= 0) or (max_age is not None and max_age <= 0):
            raise LpfError(f"--retain must be more than 0, got {v!r}")
    return Retention(max_bytes, max_age)
