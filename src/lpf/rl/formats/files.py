"""Finding a dump's files and telling what each holds, by content (magic bytes and first record),
never by file name or suffix.

`kind(path)` is "parquet" (PAR1 magic), "torch" (a torch.save zip archive, or a legacy pickle),
"jsonl" (first non-empty line is a JSON object) or None. `first_keys(path, kind)` is the field
names of a Parquet schema or of the first JSON line. `candidates(path)` lists a file, or every data
file under a directory (MAX_DEPTH levels: prime-rl nests step_N/rank_R.jsonl, slime rollout_data/
and train_data/; not inside `<stem>.policy/`, the checkpoints `lpf rl simulate` writes beside its
dump), in natural order of their relative paths. `jsonl_rows` / `parquet_rows` yield
(line or row number, record or None, why unreadable).
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Iterator

from lpf.core.errors import LpfError

MAX_DEPTH = 3
_PROBE = 1 << 16


def natural(p: Path | str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def kind(path: Path) -> str | None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(_PROBE)
    except OSError:
        return None
    if head[:4] == b"PAR1":
        return "parquet"
    if head[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as z:
                if any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist()):
                    return "torch"
        except (zipfile.BadZipFile, OSError):
            return "torch-damaged"  # a zip that does not open: most likely a cut-off torch.save
        return None
    if head[:1] == b"\x80":  # pickle protocol 2+: torch's legacy (non-zip) format
        return "torch"
    return "jsonl" if _first_object(path) is not None else None


def _first_object(path: Path, lines: int = 20) -> dict | None:
    """The first JSON object among the first `lines` non-empty lines (a bad first line is a bad row,
    not proof that the file is no JSONL)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        seen = 0
        for line in fh:
            if not line.strip():
                continue
            seen += 1
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, dict):
                return rec
            if seen >= lines:
                break
    return None


def is_blank(path: Path) -> bool:
    with open(path, "rb") as fh:
        return not fh.read(_PROBE).strip()


def first_keys(path: Path, file_kind: str) -> set[str]:
    if file_kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return set(pq.read_schema(path).names)
        except Exception as e:  # pyarrow raises many types for a damaged file
            raise LpfError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    if file_kind == "jsonl":
        return set(_first_object(path) or {})
    return set()


def candidates(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise LpfError(f"dump {str(path)!r} does not exist")
    out = []
    for p in path.rglob("*"):
        rel = p.relative_to(path)
        if len(rel.parts) > MAX_DEPTH or any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if any(part.endswith(".policy") for part in rel.parts[:-1]):  # lpf rl simulate's checkpoints: no dump
            continue
        out.append(p)
    return sorted(out, key=lambda p: natural(p.relative_to(path)))


def jsonl_rows(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                yield (
                    n,
                    None,
                    f"not valid JSON ({e.msg}{'; the file may be cut off' if not line.endswith(chr(10)) else ''})",
                )
                continue
            if not isinstance(rec, dict):
                yield n, None, f"not a JSON object ({type(rec).__name__})"
                continue
            yield n, rec, None


def parquet_rows(path: Path) -> tuple[Iterator[tuple[int, dict | None, str | None]], dict]:
    """(rows, the Parquet key metadata "lpf" as a dict)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises many types for a damaged file
        raise LpfError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    meta = {}
    if table.schema.metadata and b"lpf" in table.schema.metadata:
        meta = json.loads(table.schema.metadata[b"lpf"])
    return ((n, rec, None) for n, rec in enumerate(table.to_pylist(), 1)), meta
