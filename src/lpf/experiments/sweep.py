"""`lpf sweep`: one audit per cell of a knob grid, and what moves the failure's shape.

Contract:
- `parse_knobs(specs, settings, engine_fields, fixed)` turns `NAME=V1,V2,...` specs into `Knob`s. A
  knob names one of an audit's settings (`settings`: the names `lpf audit` spells them with, dashed:
  cache-mb, n, temperature, inject, ...) or, failing that, an engine option of every engine in play
  (`engine_fields`: engine -> its Options field names, e.g. block_size). Unknown names raise
  `LpfError` with a did-you-mean before anything runs; a knob also given as a fixed setting (`fixed`:
  name -> how it was given, e.g. "--cache-mb" or "-E") is refused (which value would win is unclear).
  Values stay text here: whoever builds a cell's `AuditSpec` converts them (the command line, with
  its own option types), so a bad value is refused while the cells are built, before the first runs.
- `make_cells(knobs)` is the cartesian product, each cell named from its values (filesystem-safe);
  a `Cell` gets its `spec` (an AuditSpec into `DIR/cells/<name>`) from the caller.
- `run_sweep` runs every cell not yet complete (`cells.run_cell`: its own `lpf audit --spec -`
  process, forked from the sweep's kept worker where `kept_cells` serves the engine, an ordinary run directory `DIR/cells/<name>`, its log `DIR/logs/<name>.log`; an
  interrupted cell is finished, not redone), so a rerun of the same sweep redoes nothing.
  `DIR/sweep.json` (rewritten after every cell) and `DIR/sweep.parquet` follow the sweep-dir contract;
  the sweep's identity (what a rerun must match) is its knobs and its cells' specs (`specs_sha256`,
  over each spec without its directory).
- `cell_row` reads a cell's `findings.json` (its `shape` block when present, else counts/flagged);
  `shape_moves` is pure: per knob, with the other knobs fixed, whether rate, onset, first-divergence
  position and period change, each as one sentence with the numbers.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from lpf.analysis.stats import two_proportions
from lpf.core.errors import LpfError, did_you_mean
from lpf.experiments.cells import cell_complete, read_out_doc, run_cell
from lpf.experiments.kept_cells import kept_cells
from lpf.pipeline.spec import with_run

METRICS = ("rate", "onset", "position", "period")
FIELDS = (
    "name",
    "run_dir",
    "verdict",
    "n_requests",
    "n_scored",
    "n_flagged",
    "rate",
    "onset_seq",
    "onset_step",
    "first_divergence_median",
    "period",
    "max_abs_logprob_diff",
)
COUNTS = ("clean", "noise", "divergent", "corrupt")
RATE_ALPHA = 0.01  # the level of Fisher's exact test between the extreme cells for "the rate moved"


@dataclass(frozen=True)
class Knob:
    name: str  # dashed, as `lpf audit` spells the setting (cache-mb), or the engine's own name (block_size)
    values: tuple[str, ...]
    kind: str  # setting | engine (an engine option without a setting of its own: -E NAME=V)


@dataclass
class Cell:
    name: str
    values: dict[str, str]
    spec: object = None  # its AuditSpec (lpf.pipeline.spec), built by the caller from the values


def parse_bool(name: str, value: str) -> bool:
    """A knob's on/off value: 1/true/yes/on or 0/false/no/off."""
    v = value.lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise LpfError(f"knob {name}: expected true/false, got {value!r}")


def parse_knobs(
    specs: list[str], settings: set[str], engine_fields: dict[str, set[str]], fixed: dict[str, str]
) -> list[Knob]:
    if not specs:
        raise LpfError("give at least one --knob NAME=V1,V2,...")
    knobs, seen = [], set()
    engine_names = sorted({f for fs in engine_fields.values() for f in fs})
    for spec in specs:
        raw, sep, vals = spec.partition("=")
        name = raw.strip().lstrip("-")
        if not sep or not name:
            raise LpfError(f"--knob expects NAME=V1,V2,..., got {spec!r}")
        values = tuple(v.strip() for v in vals.split(","))
        if not values or any(not v for v in values):
            raise LpfError(f"--knob {name}: empty value in {vals!r}")
        if len(set(values)) != len(values):
            raise LpfError(f"--knob {name}: a value is listed twice")
        dashed, under = name.replace("_", "-"), name.replace("-", "_")
        if dashed in settings:
            knob = Knob(dashed, values, "setting")
        elif under in engine_names:
            missing = [e for e, fs in engine_fields.items() if under not in fs]
            if missing:
                raise LpfError(f"knob {name}: engine {missing[0]} has no option {under}")
            knob = Knob(under, values, "engine")
        else:
            known = sorted(settings) + engine_names
            raise LpfError(
                f"unknown knob {name!r}{did_you_mean(dashed, known)}; knobs are lpf audit options "
                f"({', '.join(sorted(settings))}) and engine options ({', '.join(engine_names)})"
            )
        if knob.name in seen:
            raise LpfError(f"knob {knob.name} is given twice")
        seen.add(knob.name)
        if knob.name in fixed:
            how = fixed[knob.name]
            raise LpfError(
                f"{knob.name} is both a knob and a fixed -E option: drop one"
                if how == "-E"
                else f"{knob.name} is both a knob and a fixed option ({how}): drop one"
            )
        knobs.append(knob)
    return knobs


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


def make_cells(knobs: list[Knob]) -> list[Cell]:
    cells, used = [], set()
    for combo in itertools.product(*(k.values for k in knobs)):
        name = "__".join(f"{_safe(k.name)}-{_safe(v)}" for k, v in zip(knobs, combo))
        base, i = name, 2
        while name in used:  # two values that differ only in unsafe characters
            name, i = f"{base}-{i}", i + 1
        used.add(name)
        cells.append(Cell(name, {k.name: v for k, v in zip(knobs, combo)}))
    return cells


def identity(knobs: list[Knob], cells: list[Cell]) -> dict:
    """What a rerun of the sweep must match: its knobs, and its cells' specs (without their directories)."""
    digest = hashlib.sha256(
        json.dumps([[c.name, c.spec.identity()] for c in cells], sort_keys=True, default=str).encode()
    ).hexdigest()
    return {"knobs": [{"name": k.name, "values": list(k.values)} for k in knobs], "specs_sha256": digest}


def check_out(out: Path, spec: dict) -> dict:
    """Refuses an --out holding anything but this same sweep (`identity`); returns `spec`."""
    out = Path(out)
    old = read_out_doc(out, "sweep.json")
    if old is not None:
        if {"knobs": old.get("knobs"), "specs_sha256": old.get("specs_sha256")} != spec:
            same_knobs = old.get("knobs") == spec["knobs"]
            raise LpfError(
                f"{out} holds a different sweep (knobs {old.get('knobs')}"
                f"{', other options' if same_knobs else ''}): choose another --out"
            )
    elif out.exists() and any(out.iterdir()):
        raise LpfError(f"{out} exists, is not empty and holds no sweep.json: choose another --out")
    return spec


def run_sweep(
    out: Path, knobs: list[Knob], cells: list[Cell], on_start=lambda total, done: None, tick=lambda n: None
) -> dict:
    """Run every incomplete cell; returns (and writes) the sweep document."""
    out = Path(out)
    spec = check_out(out, identity(knobs, cells))
    (out / "cells").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    done = {c.name for c in cells if cell_complete(out / "cells" / c.name)}
    write_sweep(out, spec, cells, done)  # from now on the directory is recognisably this sweep's
    on_start(len(cells), len(done))
    try:
        with kept_cells():  # the cells fork one process that imported torch once (`kept_cells`)
            for c in cells:
                if c.name not in done:
                    run_cell(with_run(c.spec, out=out / "cells" / c.name), out / "logs" / f"{c.name}.log", c.name)
                    done.add(c.name)
                    tick(1)
                    write_sweep(out, spec, cells, done)
    finally:
        doc = write_sweep(out, spec, cells, done)  # whatever finished is recorded, even on error/Ctrl-C
    return doc


def write_sweep(out: Path, spec: dict, cells: list[Cell], done: set[str]) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for c in cells:
        if c.name in done:
            findings = json.loads((out / "cells" / c.name / "findings.json").read_text())
            rows.append(cell_row(c.name, c.values, f"cells/{c.name}", findings))
    doc = {
        "kind": "sweep",
        **spec,
        "complete": len(rows) == len(cells),
        "n_cells": len(cells),
        "cells": rows,
        "moves": shape_moves(spec["knobs"], rows),
    }
    tmp = out / ".tmp-sweep.json"
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out / "sweep.json")
    flat = [
        {
            **{f: r[f] for f in FIELDS},
            **{f"count_{k}": r["counts"].get(k, 0) for k in COUNTS},
            **{(k if k not in FIELDS else f"knob_{k}"): str(v) for k, v in r["values"].items()},
        }
        for r in rows
    ]
    schema = pa.schema(
        [
            ("name", pa.string()),
            ("run_dir", pa.string()),
            ("verdict", pa.string()),
            ("n_requests", pa.int64()),
            ("n_scored", pa.int64()),
            ("n_flagged", pa.int64()),
            ("rate", pa.float64()),
            ("onset_seq", pa.int64()),
            ("onset_step", pa.int64()),
            ("first_divergence_median", pa.float64()),
            ("period", pa.float64()),
            ("max_abs_logprob_diff", pa.float64()),
            *[(f"count_{k}", pa.int64()) for k in COUNTS],
            *[((k["name"] if k["name"] not in FIELDS else f"knob_{k['name']}"), pa.string()) for k in spec["knobs"]],
        ]
    )
    tmp = out / ".tmp-sweep.parquet"
    pq.write_table(pa.Table.from_pylist(flat, schema=schema), tmp)
    tmp.replace(out / "sweep.parquet")
    return doc


# -- reading cells ----------------------------------------------------------------------------------
def cell_row(name: str, values: dict, run_dir: str, findings: dict) -> dict:
    """The sweep's flat fields for one cell, from its findings (shape block first, then fallbacks)."""
    counts = findings.get("counts") or {}
    n = findings.get("n_requests") or 0
    scored = n - (findings.get("errors") or 0) - (findings.get("unscored") or 0)
    flagged = findings.get("flagged") or []
    shape = findings.get("shape") or {}
    scored = shape.get("n_scored", scored)
    n_flagged = shape.get("n_flagged", counts.get("divergent", 0) + counts.get("corrupt", 0))
    rate = shape.get("rate", n_flagged / scored if scored else None)
    onset = shape.get("onset") or {}
    seqs = [f["seq"] for f in flagged if f.get("seq") is not None]
    onset_seq = onset["seq"] if "seq" in onset else (min(seqs) if seqs else None)
    fd = shape.get("first_divergence") or {}
    pos = [f["first_divergence"] for f in flagged if f.get("first_divergence") is not None]
    fd_median = fd["median"] if "median" in fd else (float(median(pos)) if pos else None)
    return {
        "name": name,
        "values": dict(values),
        "run_dir": run_dir,
        "verdict": findings.get("verdict"),
        "counts": {k: counts.get(k, 0) for k in COUNTS},
        "n_requests": n,
        "n_scored": scored,
        "n_flagged": n_flagged,
        "rate": rate,
        "onset_seq": onset_seq,
        "onset_step": onset.get("step"),
        "first_divergence_median": fd_median,
        "period": (shape.get("periodicity") or {}).get("period"),
        "max_abs_logprob_diff": ((findings.get("metrics") or {}).get("abs_logprob_diff") or {}).get("max"),
    }


# -- what moves the shape (pure) ----------------------------------------------------------------------
def fmt_rate(r: dict) -> str:
    return "-" if r["rate"] is None else f"{100 * r['rate']:.1f}% ({r['n_flagged']}/{r['n_scored']})"


def _num_moved(vals: list, rel: float, scale: float | None = None) -> bool:
    """Present in some cells and not others, or a spread of at least 1 and `rel` of `scale` (default:
    the largest value)."""
    present = [v for v in vals if v is not None]
    if len(present) != len(vals):
        return bool(present)
    if not present:
        return False
    spread = max(present) - min(present)
    return spread >= 1 and spread >= rel * (scale if scale is not None else max(abs(v) for v in present))


def _group_verdict(metric: str, rows: list[dict]) -> tuple[bool, str, float]:
    """(moved, 'numbers at each value', strength) for one knob's cells with the other knobs fixed."""
    if metric == "rate":
        lo = min(rows, key=lambda r: r["rate"] if r["rate"] is not None else math.inf)
        hi = max(rows, key=lambda r: r["rate"] if r["rate"] is not None else -math.inf)
        p = two_proportions(lo["n_flagged"], lo["n_scored"], hi["n_flagged"], hi["n_scored"])
        return p < RATE_ALPHA, "; ".join(fmt_rate(r) for r in rows) + f" (Fisher's exact test, extremes: p={p:.2g})", -p
    key, unit, rel = {
        "onset": ("onset_seq", "first flagged arrival index", 0.1),
        "position": ("first_divergence_median", "median first-divergence position", 0.25),
        "period": ("period", "period in steps", 0.1),
    }[metric]
    vals = [r[key] for r in rows]
    fmt = [("none" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))) for v in vals]
    if metric == "onset":
        fmt = [f + (f" (step {r['onset_step']})" if r.get("onset_step") is not None else "") for f, r in zip(fmt, rows)]
    # an onset is an arrival index: judged against the cell's size, not against itself
    moved = _num_moved(vals, rel, max(r["n_scored"] or 0 for r in rows) if metric == "onset" else None)
    present = [v for v in vals if v is not None]
    return moved, f"{unit} " + "; ".join(fmt), (max(present) - min(present)) if len(present) > 1 else 0.0


def shape_moves(knobs: list[dict], rows: list[dict]) -> list[dict]:
    """For each knob with 2+ values and each metric: one sentence saying whether varying the knob
    (other knobs fixed) changes it, with the numbers at each value."""
    moves = []
    names = [k["name"] for k in knobs]
    for k in knobs:
        if len(k["values"]) < 2:
            continue
        others = [n for n in names if n != k["name"]]
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            groups.setdefault(tuple(r["values"].get(o) for o in others), []).append(r)
        order = {v: i for i, v in enumerate(k["values"])}
        groups = {
            g: sorted(rs, key=lambda r: order.get(r["values"].get(k["name"]), 0))
            for g, rs in groups.items()
            if len({r["values"].get(k["name"]) for r in rs}) >= 2
        }
        for metric in METRICS:
            if not groups:
                moves.append(
                    {
                        "knob": k["name"],
                        "metric": metric,
                        "moves": False,
                        "sentence": f"{k['name']}: not enough completed cells to compare its values yet",
                    }
                )
                continue
            judged = [(g, rs, *_group_verdict(metric, rs)) for g, rs in groups.items()]
            n_moved = sum(1 for j in judged if j[2])
            g, rs, moved, numbers, _ = max(judged, key=lambda j: (j[2], j[4]))
            at = ", ".join(f"{r['values'][k['name']]}" for r in rs)
            where = "" if not others else (" with " + ", ".join(f"{o}={v}" for o, v in zip(others, g)))
            label = {
                "rate": "the rate",
                "onset": "the onset",
                "position": "the first-divergence position",
                "period": "the period",
            }[metric]
            verb = f"moves {label}" if moved else f"does not move {label}"
            if len(judged) > 1:
                verb += f" (in {n_moved} of {len(judged)} settings of the other knobs)"
            moves.append(
                {
                    "knob": k["name"],
                    "metric": metric,
                    "moves": moved,
                    "sentence": f"{k['name']} {verb}: at {k['name']} = {at}{where}: {numbers}.",
                }
            )
    return moves
