"""What every format reader shares: the two ways a raw row can fail to become a response, the
context a conversion sees, and the small helpers the layouts need (unbatching, step from a name).

A reader's `convert(raw, ctx)` returns the lpf records (`lpf.rl.dump`) of one raw row, raises
`BadRow(reason)` when the row is malformed, or `Skipped(reason)` when the framework itself leaves the
row out of training (not an error).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


class BadRow(ValueError):
    """The raw row is malformed; the message is the reason listed in bad_rows."""


class Skipped(Exception):
    """The framework leaves this row out of training and of its metrics; listed in skipped_rows."""


@dataclass(frozen=True)
class Ctx:
    file: Path
    row: int


def step_from_name(path: Path) -> int | None:
    """The last number after 'step' in a file or folder name (train_data_step7.jsonl, step_7), else None."""
    for part in (path.stem, path.parent.name):
        m = re.findall(r"step_?(\d+)", part)
        if m:
            return int(m[-1])
    return None


def unbatch(rec: dict, key: str):
    """A value written with a batch dimension of 1 ([x]) -> x; BadRow when the dimension is not 1."""
    v = rec.get(key)
    if v is None:
        raise BadRow(f"missing {key}")
    if not isinstance(v, list) or len(v) != 1:
        n = len(v) if isinstance(v, list) else "no"
        raise BadRow(f"{key} has a batch dimension of {n}, expected 1")
    return v[0]


def spans(mask: list) -> list[tuple[int, int]]:
    """Maximal runs [start, end) of truthy entries."""
    out, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(mask)))
    return out
