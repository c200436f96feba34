"""A run directory on disk: manifest, append-only Parquet parts, crash-safe commits.

Contract:
- Every file appears atomically (written to a `.tmp-` name, then renamed): a reader never sees half
  a part, and a SIGKILL loses at most the part in flight.
- Requests commit as a group under one part number N: `tokens/part-N` (and `prompt_tokens/part-N` when
  the engine returned prompt logprobs) first, `requests/part-N` last. A request is done iff it appears
  in some requests part; a tokens or prompt_tokens part without its requests part is an orphan of a
  crash and is deleted on open. So resume neither redoes nor duplicates a request.
- Reference (and calibration) parts are self-contained; a request is rescored iff it has rows there
  (or no outputs). Prompt-reference scores commit with their reference scores under one part number
  (`prompt_reference/part-N` first, `reference/part-N` last); a prompt_reference part without its
  reference part is a crash's orphan, deleted on open, so a resumed rescore never duplicates one.
- Opening a directory written by a newer schema is refused rather than misread; parts written by an
  older one are read with the columns they lack as nulls, so every reader sees the current schema.
- Parts carry Parquet page checksums, verified on read: a damaged part (truncated, overwritten,
  bit-flipped) is an `LpfError` naming it, never a partial table passed off as the whole run. A
  manifest that does not parse is one too.
- `writer()` holds the run's lock (`.lock`, an flock the kernel drops when its process dies) while
  a stage appends parts: a second writer of the same run is refused with one line instead of
  interleaving parts (e.g. a resumed sweep cell while a killed sweep's child still runs).
- A directory left by a run killed while it was being created (no manifest; nothing but the files
  `create` writes before it) counts as empty: `lpf run --out` may create the run there again.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from lpf.core.errors import LpfError
from lpf.run import schema

_PART = re.compile(r"^part-(\d{6})\.parquet$")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _leaves(t: pa.DataType, path: str):
    """(Parquet column path, type) of each leaf column under a field of type `t` named `path`."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        yield from _leaves(t.value_type, f"{path}.list.element")
    elif pa.types.is_struct(t):
        for f in t:
            yield from _leaves(f.type, f"{path}.{f.name}")
    else:
        yield path, t


def _atomic_write_table(path: Path, table: pa.Table) -> None:
    """zstd with page checksums; floating-point columns BYTE_STREAM_SPLIT and never dictionary-encoded
    (their bytes split by significance: zstd then finds the exponents' redundancy, and the low bytes
    a float32 value leaves zero in a float64; smaller parts, written and read in ~2/3 of the CPU),
    every other column as before. Parts written before this read the same."""
    tmp = path.with_name(f".tmp-{path.name}")
    leaves = [leaf for f in table.schema for leaf in _leaves(f.type, f.name)]
    floats = [p for p, t in leaves if pa.types.is_floating(t)]
    pq.write_table(
        table,
        tmp,
        compression="zstd",
        write_page_checksum=True,
        use_dictionary=[p for p, t in leaves if not pa.types.is_floating(t)] if floats else True,
        column_encoding=dict.fromkeys(floats, "BYTE_STREAM_SPLIT") or None,
    )
    os.replace(tmp, path)


def _damaged(path: Path, e: Exception) -> LpfError:
    detail = " ".join(str(e).split())[:160] or type(e).__name__
    return LpfError(
        f"{path} is damaged ({detail}): the run cannot be read completely; move that part away "
        f"and rerun the stage that wrote it (or restore it from a copy)"
    )


_CODED = pa.dictionary(pa.int32(), pa.string())  # request ids as `RunDir.iter_pieces` hands them out
# what reading a damaged part raises: Arrow's and the file system's errors, a footer that decodes to
# nonsense (ValueError, IndexError), and a footer whose schema lost a column's name (pyarrow's
# read_dictionary lookup raises KeyError for it before any column is read)
_DAMAGE = (pa.ArrowException, OSError, ValueError, IndexError, KeyError)


def _open_part(path: Path, want: pa.Schema, table_name: str) -> tuple[pq.ParquetFile, set[str]]:
    """A part opened for `want`'s columns (request ids read as a dictionary), and the columns it has;
    a column an older schema's part lacks may be missing (only the columns `schema.ADDED_LATER`
    names: any other gap is damage, not age)."""
    part = pq.ParquetFile(
        path,
        page_checksum_verification=True,
        read_dictionary=["request_id"] if "request_id" in want.names else None,
    )
    have = set(part.schema_arrow.names)
    unexplained = {n for n in want.names if n not in have} - schema.ADDED_LATER.get(table_name, set())
    if unexplained:
        raise ValueError(f"no column {', '.join(sorted(unexplained))}")
    return part, have


def _as_wanted(table: pa.Table, want: pa.Schema, have: set[str]) -> pa.Table:
    for i, f in enumerate(want):
        if f.name not in have:
            table = table.add_column(i, f, pa.nulls(table.num_rows, f.type))
    return table.select(want.names).cast(want)


def _complete(table: pa.Table, want: pa.Schema, table_name: str) -> pa.Table:
    """`table` cast to `want`, the columns `schema.ADDED_LATER` names filled with nulls where a
    writer that predates them left them out."""
    later = schema.ADDED_LATER.get(table_name, set())
    missing = [n for n in want.names if n in later and n not in table.column_names]
    if missing:
        table = _as_wanted(table, want, set(table.column_names))
    return table.cast(want)


def _read_part(path: Path, want: pa.Schema, table_name: str, use_threads: bool = True) -> pa.Table:
    """One part with exactly `want`'s columns: a column an older schema's part lacks is all nulls.
    `use_threads`: decode on Arrow's pool (False: on the calling thread)."""
    try:
        # request ids read as a dictionary, then cast: the same strings for a fifth of the CPU of
        # Parquet's own string decoding (0.05 + 0.05 vs 0.25-0.87 s for 10M token rows)
        part, have = _open_part(path, want, table_name)
        return _as_wanted(part.read(columns=[n for n in want.names if n in have], use_threads=use_threads), want, have)
    except _DAMAGE as e:
        raise _damaged(path, e) from None


def _read_pieces(path: Path, want: pa.Schema, table_name: str) -> Iterator[pa.Table]:
    """`_read_part` a row group at a time, request ids left dictionary-encoded (`_CODED`)."""
    coded = pa.schema([pa.field(f.name, _CODED) if f.name == "request_id" else f for f in want])
    try:
        part, have = _open_part(path, want, table_name)
        groups = range(part.metadata.num_row_groups)
    except _DAMAGE as e:
        raise _damaged(path, e) from None
    for g in groups:
        try:
            # decoded on the calling thread: the streamed analysis reads both tables on threads of its
            # own (Arrow's pool, one thread under OMP_NUM_THREADS=1, would take them in turn)
            table = part.read_row_group(g, columns=[n for n in want.names if n in have], use_threads=False)
            if "request_id" in have and table.schema.field("request_id").type != _CODED:
                table = table.set_column(  # a writer that left the ids plain: encoded here
                    table.schema.get_field_index("request_id"),
                    "request_id",
                    table.column("request_id").cast(pa.string()).dictionary_encode(),
                )
            piece = _as_wanted(table, coded, have)
        except _DAMAGE as e:
            raise _damaged(path, e) from None
        yield piece


def _read_any(path: Path, columns: list[str] | None) -> pa.Table:
    try:
        return pq.ParquetFile(path, page_checksum_verification=True).read(columns=columns)
    except _DAMAGE as e:
        raise _damaged(path, e) from None


def _holds_files(path: Path, leftovers: set[str]) -> bool:
    """Whether `path` holds anything but what an interrupted `create` leaves: temporaries and, while
    there is no manifest yet, the files it writes first (`leftovers`)."""
    if (path / "manifest.json").exists():
        return True
    return any(
        p.is_file() and not p.name.startswith(".tmp-") and not (p.parent == path and p.name in leftovers)
        for p in path.rglob("*")
    )


def read_part(path: Path | str, table: str, columns: list[str], use_threads: bool = True) -> pa.Table:
    """One part file of run table `table` with `columns` of the current schema (what a worker that
    holds no RunDir reads: the Ray rescorer's actors). `use_threads`: as `_read_part`'s."""
    want = pa.schema([schema.TABLES[table].field(c) for c in columns])
    return _read_part(Path(path), want, table, use_threads)


class RunDir:
    """Handle on one run directory. Create with `create()`, reopen with `open()`."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest

    # -- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path | str, manifest: dict, files: dict[str, bytes] | None = None) -> "RunDir":
        """`files` (name -> bytes, e.g. the tokenized workload) are written before the manifest: a run
        whose manifest exists has them."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or _holds_files(path, set(files or ()))):
            raise LpfError(
                f"{path} already exists and is not empty: choose another --out, or "
                f"`lpf run --resume {path}` to finish it"
            )
        for sub in ("requests", "tokens", "reference", "calibration"):  # the others appear with their first part
            (path / sub).mkdir(parents=True, exist_ok=True)
        for name, data in (files or {}).items():
            _atomic_write_bytes(path / name, data)
        run = cls(path, dict(manifest, schema_version=schema.SCHEMA_VERSION))
        run.save_manifest()
        return run

    @classmethod
    def open(cls, path: Path | str) -> "RunDir":
        path = Path(path)
        mpath = path / "manifest.json"
        if not mpath.is_file():
            raise LpfError(f"{path} is not a run directory (no manifest.json)")
        try:
            manifest = json.loads(mpath.read_bytes().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LpfError(f"{mpath}: unreadable manifest ({getattr(e, 'msg', None) or e.reason})") from None
        if not isinstance(manifest, dict):
            raise LpfError(f"{mpath}: unreadable manifest (not a JSON object)")
        version = manifest.get("schema_version")
        if not isinstance(version, int):
            raise LpfError(f"{mpath}: no schema_version")
        if version > schema.SCHEMA_VERSION:
            raise LpfError(
                f"{path} was written with run schema v{version}; this lpf reads up to "
                f"v{schema.SCHEMA_VERSION}: upgrade logprob-forensics"
            )
        run = cls(path, manifest)
        run._drop_orphans()
        return run

    @contextmanager
    def writer(self) -> Iterator["RunDir"]:
        import fcntl

        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LpfError(
                    f"{self.path} is being written by another lpf process: let it finish (or stop it) first"
                ) from None
            yield self
        finally:
            os.close(fd)  # releases the lock

    def save_manifest(self) -> None:
        _atomic_write_bytes(self.path / "manifest.json", (json.dumps(self.manifest, indent=2) + "\n").encode())

    def _drop_orphans(self) -> None:
        for sub in schema.TABLES:
            d = self.path / sub
            if d.is_dir():
                for f in d.glob(".tmp-*"):
                    f.unlink()
        committed = {p.name for p in self.parts("requests")}
        for p in self.parts("tokens") + self.parts("prompt_tokens"):
            if p.name not in committed:
                p.unlink()
        scored = {p.name for p in self.parts("reference")}
        for p in self.parts("prompt_reference") + self.parts("seeded"):
            if p.name not in scored:
                p.unlink()

    # -- parts -------------------------------------------------------------------------------------
    def parts(self, table: str) -> list[Path]:
        d = self.path / table
        return sorted(p for p in d.glob("part-*.parquet") if _PART.match(p.name)) if d.is_dir() else []

    def _next_index(self, *tables: str) -> int:
        last = -1
        for t in tables:
            for p in self.parts(t):
                last = max(last, int(_PART.match(p.name).group(1)))
        return last + 1

    def append_requests(self, requests: pa.Table, tokens: pa.Table, prompt_tokens: pa.Table | None = None) -> None:
        """Commit completed requests with their tokens (and prompt tokens): requests last, see the contract."""
        i = self._next_index("requests", "tokens", "prompt_tokens")
        name = f"part-{i:06d}.parquet"
        _atomic_write_table(self.path / "tokens" / name, tokens.cast(schema.TOKENS))
        if prompt_tokens is not None and prompt_tokens.num_rows:
            (self.path / "prompt_tokens").mkdir(exist_ok=True)
            _atomic_write_table(self.path / "prompt_tokens" / name, prompt_tokens.cast(schema.PROMPT_TOKENS))
        _atomic_write_table(self.path / "requests" / name, requests.cast(schema.REQUESTS))

    def append_reference(
        self, reference: pa.Table, prompt_reference: pa.Table | None = None, seeded: pa.Table | None = None
    ) -> None:
        """Commit reference scores with their prompt-position scores and seeded draws: reference last,
        see the contract."""
        i = self._next_index("reference", "prompt_reference", "seeded")
        name = f"part-{i:06d}.parquet"
        if seeded is not None and seeded.num_rows:
            (self.path / "seeded").mkdir(exist_ok=True)
            _atomic_write_table(self.path / "seeded" / name, seeded.cast(schema.SEEDED))
        if prompt_reference is not None and prompt_reference.num_rows:
            (self.path / "prompt_reference").mkdir(exist_ok=True)
            _atomic_write_table(
                self.path / "prompt_reference" / name, _complete(prompt_reference, schema.PROMPT_REFERENCE, "reference")
            )
        (self.path / "reference").mkdir(exist_ok=True)  # a run copied without its reference/ folder
        _atomic_write_table(self.path / "reference" / name, _complete(reference, schema.REFERENCE, "reference"))

    def append(self, table: str, data: pa.Table) -> None:
        """Append a self-contained part to a table other than requests/tokens (reference, trace, ...)."""
        (self.path / table).mkdir(exist_ok=True)
        i = self._next_index(table)
        target = schema.TABLES.get(table)
        _atomic_write_table(
            self.path / table / f"part-{i:06d}.parquet", _complete(data, target, table) if target is not None else data
        )

    def read(self, table: str, columns: list[str] | None = None) -> pa.Table:
        """All parts of a table concatenated (empty table with the schema when there are none)."""
        target = schema.TABLES.get(table)
        parts = self.parts(table)
        if not parts:
            if target is None:
                raise LpfError(f"{self.path} has no {table} data")
            empty = target.empty_table()
            return empty.select(columns) if columns else empty
        if target is None:
            return pa.concat_tables([_read_any(p, columns) for p in parts], promote_options="default")
        want = target if columns is None else pa.schema([target.field(c) for c in columns])
        return pa.concat_tables([_read_part(p, want, table) for p in parts])

    def iter_parts(self, table: str, columns: list[str]) -> Iterator[pa.Table]:
        """Each part of a table (of the run schema) read alone, in part order: memory bounded by a part."""
        for p in self.parts(table):
            yield read_part(p, table, columns)

    def iter_pieces(self, table: str, columns: list[str]) -> Iterator[tuple[int, pa.Table]]:
        """(part index, table) for each row group of each part, in order: `iter_parts` in pieces
        (memory bounded by a row group), with request_id left dictionary-encoded
        (dictionary<int32, string>: the rows' strings are never built; `lpf.analysis.columns.Codes`
        turns them into integers)."""
        for i, p in enumerate(self.parts(table)):
            for piece in _read_pieces(p, pa.schema([schema.TABLES[table].field(c) for c in columns]), table):
                yield i, piece

    def has(self, table: str) -> bool:
        return bool(self.parts(table))

    def done_request_ids(self) -> set[str]:
        return set(self.read("requests", ["request_id"]).column("request_id").to_pylist())

    def write_json(self, name: str, obj) -> Path:
        path = self.path / name
        _atomic_write_bytes(path, (json.dumps(obj, indent=2, default=float) + "\n").encode())
        return path
