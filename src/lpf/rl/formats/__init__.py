"""Readers for the dumps RL frameworks write, one module per framework, all producing `lpf.rl.dump.Dump`.

`read_dump(path, fmt="auto", strict=False)`: `path` is a file or a directory (searched
`files.MAX_DEPTH` levels deep). Each file's format is told by its content (Parquet / torch / JSON
lines, then the fields of its first record), never by its name: lpf's layout (`lpf_layout`), verl's
rollout_data_dir with per-token fields (`verl`), prime-rl token exports (`primerl`), NeMo-RL
train_data_step{N}.jsonl (`nemorl`), slime's --dump-details (`slime`). `fmt` forces one. Files of no
known layout in a directory are listed in `Dump.ignored_files`; two known formats in one directory,
a file that is none of them, or a dump missing a format's required fields are one-line `LpfError`s
naming what is missing. Malformed rows become `Dump.bad_rows` (see `lpf.rl.dump`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from lpf.core.errors import LpfError
from lpf.rl import FORMAT_NAMES
from lpf.rl.dump import Dump, RawRow, build_dump
from lpf.rl.formats import files, lpf_layout, nemorl, primerl, slime, verl
from lpf.rl.formats.common import BadRow, Ctx, Skipped

FORMATS = {"lpf": lpf_layout, "verl": verl, "prime-rl": primerl, "nemo-rl": nemorl, "slime": slime}
NAMES = tuple(FORMATS)
assert NAMES == FORMAT_NAMES, "lpf.rl.FORMAT_NAMES (the command line's choices) must list every reader"
_DETECT_ORDER = ("prime-rl", "nemo-rl", "lpf", "verl")  # most specific layout first
_KNOWN = (
    "lpf (response_token_ids, rollout_logprobs, trainer_logprobs), prime-rl token exports, "
    "NeMo-RL train_data_step{N}.jsonl, slime --dump-details .pt, verl rollout_data_dir with per-token fields"
)


def detect(keys: set[str]) -> str | None:
    return next((name for name in _DETECT_ORDER if FORMATS[name].matches(keys)), None)


def _not_a_dump(path: Path, keys: set[str]) -> LpfError:
    if verl.text_only(keys):
        return LpfError(f"{path}: {verl.TEXT_ONLY}")
    # the layout whose required fields overlap most names what is missing
    name = max(_DETECT_ORDER, key=lambda n: (len(set(FORMATS[n].REQUIRED) & keys), n == "lpf"))
    gone = FORMATS[name].missing(keys)
    return LpfError(f"{path}: missing required column(s) {', '.join(gone)} for the {name} layout (readable: {_KNOWN})")


def _not_forced(f: Path, kind: str, keys_of: dict, fmt: str) -> LpfError:
    if fmt == "slime":
        return LpfError(
            f"{f}: not a torch file, and slime's --dump-details writes torch .pt files "
            f"(rollout_data/{{id}}.pt, train_data/{{id}}.pt)"
        )
    if kind == "torch":
        return LpfError(f"{f}: a torch file; of the readable dumps only slime's are torch files (--format slime)")
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
        if kind == "torch":
            name = "slime"
        else:
            keys_of[f] = files.first_keys(f, kind)
            name = detect(keys_of[f]) if fmt == "auto" else None if fmt == "slime" else fmt  # slime writes torch files
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
        if fmt == "slime":
            raise LpfError(
                f"{path}: no torch files here (slime's --dump-details writes rollout_data/{{id}}.pt and "
                f"train_data/{{id}}.pt)"
            )
        data = [f for f in ignored if f in keys_of]
        if data:
            if fmt == "auto":
                raise _not_a_dump(data[0], keys_of[data[0]])
            raise LpfError(f"{path}: no file here has the {fmt} layout; {_not_forced(data[0], '', keys_of, fmt)}")
        raise LpfError(f"{path}: no dump files here (readable: {_KNOWN})")
    ((name, chosen),) = found.items()
    module = FORMATS[name]
    if name != "slime":
        union = set().union(*(keys_of[f] for f in chosen))
        if name == "verl" and verl.text_only(union):
            raise LpfError(f"{path}: {verl.TEXT_ONLY}")
        gone = module.missing(union)
        if gone:
            raise LpfError(f"{path}: {name} dump is missing required column(s) {', '.join(gone)}")
    multi = len(chosen) > 1 or path.is_dir()

    def label(f: Path) -> dict:
        return {"file": _rel(path, f)} if multi else {}

    meta: dict = {}
    rows = list(slime.raw_rows(chosen, label, ignored)) if name == "slime" else _rows(module, chosen, label, meta)
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
