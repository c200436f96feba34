"""Reading the dumps RL frameworks write: one reader module per framework (`lpf.rl.readers`: the `Reader`
protocol and the one registry), all producing `lpf.rl.dump.Dump`.

`read_dump(path, fmt="auto", strict=False)`: `path` is a file or a directory (searched
`files.MAX_DEPTH` levels deep). Each file's format is told by its content (Parquet / torch / JSON
lines, then the fields of its first record), never by its name: lpf's layout (`lpf_layout`), verl's
rollout_data_dir with per-token fields (`verl`), prime-rl token exports (`primerl`), NeMo-RL
train_data_step{N}.jsonl (`nemorl`), slime's --dump-details (`slime`). `fmt` forces one. Files of no
known layout in a directory are listed in `Dump.ignored_files`; row layouts are tried in their readers'
`DETECT` order, torch files go to the reader of that kind; two known formats in one directory,
a file that is none of them, or a dump missing a format's required fields are one-line `LpfError`s
naming what is missing. Malformed rows become `Dump.bad_rows` (see `lpf.rl.dump`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from lpf.core.errors import LpfError
from lpf.rl.dump import Dump, RawRow, build_dump
from lpf.rl.formats import files
from lpf.rl.formats.common import BadRow, Ctx, Skipped
from lpf.rl.readers import FileReader, readers

FORMATS = readers()
NAMES = tuple(FORMATS)
_DETECT_ORDER = tuple(sorted((n for n, r in FORMATS.items() if r.DETECT is not None), key=lambda n: FORMATS[n].DETECT))
_BY_KIND = {kind: n for n, r in FORMATS.items() if r.DETECT is None for kind in r.KINDS}  # torch -> slime
_KNOWN = ", ".join(r.LAYOUT for r in FORMATS.values())


def _refused(name: str, keys: set[str]) -> str | None:
    refuse = getattr(FORMATS[name], "refuse", None)
    return refuse(keys) if refuse else None


def detect(keys: set[str]) -> str | None:
    return next((name for name in _DETECT_ORDER if FORMATS[name].matches(keys)), None)


def _not_a_dump(path: Path, keys: set[str]) -> LpfError:
    why = next((w for n in _DETECT_ORDER if (w := _refused(n, keys))), None)
    if why:
        return LpfError(f"{path}: {why}")
    # the layout whose required fields overlap most names what is missing
    name = max(_DETECT_ORDER, key=lambda n: (len(set(FORMATS[n].REQUIRED) & keys), n == "lpf"))
    gone = FORMATS[name].missing(keys)
    return LpfError(f"{path}: missing required column(s) {', '.join(gone)} for the {name} layout (readable: {_KNOWN})")


def _not_forced(f: Path, kind: str, keys_of: dict, fmt: str) -> LpfError:
    if FORMATS[fmt].DETECT is None:  # a file reader, given a file of another kind
        return LpfError(f"{f}: {FORMATS[fmt].NOT_ITS_KIND}")
    if kind in _BY_KIND:
        return LpfError(
            f"{f}: a {kind} file; of the readable dumps only {_BY_KIND[kind]}'s are {kind} files "
            f"(--format {_BY_KIND[kind]})"
        )
    return LpfError(f"{f}: {fmt} dump is missing required column(s) {', '.join(FORMATS[fmt].missing(keys_of[f]))}")


def _classify(path: Path, fmt: str) -> tuple[dict[str, list[Path]], list[Path], dict[Path, set]]:
    """({format: files}, ignored files, {file: first-record keys}) for every file under `path`."""
    found: dict[str, list[Path]] = {}
    ignored, keys_of = [], {}
    single = path.is_file()
    for f in files.candidates(path):
        kind = files.kind(f)
        if kind == "torch-damaged":
            raise LpfError(f"{f}: not a readable torch file, perhaps cut off (its zip archive does not open)")
        if kind is None:
            if single:
                raise LpfError(
                    f"{f}: the dump has no rows"
                    if files.is_blank(f)
                    else f"{f}: neither Parquet, JSON lines nor a torch file: not a dump lpf can read"
                )
            if not files.is_blank(f):  # empty markers (prime-rl's STABLE) are no data at all
                ignored.append(f)
            continue
        if kind in _BY_KIND:  # a file reader's kind (torch: slime)
            name = _BY_KIND[kind]
        else:
            keys_of[f] = files.first_keys(f, kind)
            # a forced file reader takes no row file
            name = detect(keys_of[f]) if fmt == "auto" else None if FORMATS[fmt].DETECT is None else fmt
            if name and fmt != "auto" and not single and not FORMATS[name].matches(keys_of[f]):
                name = None  # forced, in a directory: a file without that layout's fields is not part of the dump
        if fmt != "auto" and name != fmt:
            name = None  # forced format, file of another kind
        if name is None:
            if single:
                raise _not_a_dump(f, keys_of.get(f, set())) if fmt == "auto" else _not_forced(f, kind, keys_of, fmt)
            ignored.append(f)
            continue
        found.setdefault(name, []).append(f)
    return found, ignored, keys_of


def read_dump(path: str | Path, fmt: str = "auto", strict: bool = False) -> Dump:
    if fmt != "auto" and fmt not in FORMATS:
        raise LpfError(f"unknown dump format {fmt!r} (auto, {', '.join(NAMES)})")
    path = Path(path)
    found, ignored, keys_of = _classify(path, fmt)
    if len(found) > 1:
        parts = "; ".join(
            f"{n}: {', '.join(_rel(path, f) for f in fs[:3])}{' ...' if len(fs) > 3 else ''}" for n, fs in found.items()
        )
        raise LpfError(f"{path}: mixed dump formats ({parts}); point lpf at one of them, or pass --format")
    if not found:
        if fmt != "auto" and FORMATS[fmt].DETECT is None:
            raise LpfError(f"{path}: {FORMATS[fmt].NO_FILES}")
        data = [f for f in ignored if f in keys_of]
        if data:
            if fmt == "auto":
                raise _not_a_dump(data[0], keys_of[data[0]])
            raise LpfError(f"{path}: no file here has the {fmt} layout; {_not_forced(data[0], '', keys_of, fmt)}")
        raise LpfError(f"{path}: no dump files here (readable: {_KNOWN})")
    ((name, chosen),) = found.items()
    module = FORMATS[name]
    if not isinstance(module, FileReader):
        union = set().union(*(keys_of[f] for f in chosen))
        why = _refused(name, union)
        if why:
            raise LpfError(f"{path}: {why}")
        gone = module.missing(union)
        if gone:
            raise LpfError(f"{path}: {name} dump is missing required column(s) {', '.join(gone)}")
    multi = len(chosen) > 1 or path.is_dir()

    def label(f: Path) -> dict:
        return {"file": _rel(path, f)} if multi else {}

    meta: dict = {}
    rows = (
        list(module.raw_rows(chosen, label, ignored))
        if isinstance(module, FileReader)
        else _rows(module, chosen, label, meta)
    )
    dump = build_dump(str(path), name, rows, strict, meta, [_rel(path, f) for f in ignored])
    if hasattr(module, "after"):
        module.after(dump)
    return dump


def _rows(module, chosen: list[Path], label, meta: dict) -> Iterator[RawRow]:
    for f in chosen:
        if files.kind(f) == "parquet":
            raw, m = files.parquet_rows(f)
            meta.update(m)
        else:
            raw = files.jsonl_rows(f)
        for n, rec, why in raw:
            loc = {**label(f), "row": n}
            if rec is None:
                yield RawRow(loc, problem=why)
                continue
            try:
                for out in module.convert(rec, Ctx(f, n)):
                    yield RawRow(loc, record=out)
            except BadRow as e:
                yield RawRow(loc, problem=str(e))
            except Skipped as e:
                yield RawRow(loc, skipped=str(e))


def _rel(root: Path, f: Path) -> str:
    return str(f.relative_to(root)) if root.is_dir() else f.name
