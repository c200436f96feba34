"""What an RL dump reader is (`Reader`, a `typing.Protocol`) and the one registry of them (`READERS`).

A reader is a module under `lpf.rl.formats` with:
  NAME       its `--format` name (the registry's key)
  REQUIRED   the fields a dump of its layout must have (named when missing)
  LAYOUT     how "readable: ..." describes it in an error
  KINDS      the file kinds it reads: ("parquet", "jsonl") for row layouts, ("torch",) for torch files
  DETECT     its rank among the row layouts told apart by a first record's fields (lower is tried first:
             the most specific layout first), or None where its files' kind tells it (torch)
  matches(keys) -> bool         whether a first record's fields are its layout
  missing(keys) -> list[str]    its REQUIRED fields not in `keys`
and, to read rows, `convert(rec, ctx) -> list[dict]` (`RowReader`: one raw row -> lpf records, `BadRow` /
`Skipped` from `lpf.rl.formats.common`) or `raw_rows(files, label, ignored)` (`FileReader`: whole files ->
`lpf.rl.dump.RawRow`s). Optional: `after(dump)` (a pass over the finished dump), `refuse(keys) -> str | None`
(why a dump that looks like this layout still cannot be read), `NO_FILES` / `NOT_ITS_KIND` (the errors a
file reader gives for a directory without its files / a forced file of another kind).

Adding a format is one module and one line in `READERS` (docs/design.md, "How to add an RL format").
This module is light (no numpy): the command line reads `NAMES` from it; readers are imported on use.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Iterator, Protocol, runtime_checkable

# the one registry: --format name -> the module that reads it (the command line's choices, in this order)
READERS: dict[str, str] = {
    "lpf": "lpf.rl.formats.lpf_layout",
    "verl": "lpf.rl.formats.verl",
    "prime-rl": "lpf.rl.formats.primerl",
    "nemo-rl": "lpf.rl.formats.nemorl",
    "slime": "lpf.rl.formats.slime",
}
NAMES = tuple(READERS)


@runtime_checkable
class Reader(Protocol):
    NAME: str
    REQUIRED: tuple[str, ...]
    LAYOUT: str
    KINDS: tuple[str, ...]
    DETECT: int | None

    def matches(self, keys: set[str]) -> bool: ...

    def missing(self, keys: set[str]) -> list[str]: ...


@runtime_checkable
class RowReader(Reader, Protocol):
    def convert(self, rec: dict, ctx) -> list[dict]: ...


@runtime_checkable
class FileReader(Reader, Protocol):
    def raw_rows(self, files: list, label, ignored: list) -> Iterator: ...


@lru_cache(maxsize=None)
def reader(name: str) -> Reader:
    """The reader registered as `name`, imported and checked against the protocol (a reader that breaks it
    is a programming error, named here rather than deep inside a read)."""
    module = importlib.import_module(READERS[name])
    if not isinstance(module, (RowReader, FileReader)) or module.NAME != name:
        gone = [
            m for m in ("NAME", "REQUIRED", "LAYOUT", "KINDS", "DETECT", "matches", "missing") if not hasattr(module, m)
        ]
        raise TypeError(f"{READERS[name]} is not an RL dump reader for {name!r} (lacks {gone or 'convert/raw_rows'})")
    return module


def readers() -> dict[str, Reader]:
    """Every registered reader, by name, in the registry's order."""
    return {name: reader(name) for name in READERS}
