"""`DIR/shrink.json`: a shrink's whole state, rewritten atomically after every run.

Contract:
- `State.open(out, identity, header)`: a new state in an empty (or absent) `out`, or the one
  already there when its identity (source run id, target request, `--tries`, `--need`) is this
  shrink's; anything else in `out` is refused in one line (`LpfError`). A changed
  `--budget-runs` is allowed: raising it continues a shrink that ran out.
- The document: `kind: "shrink"`, the identity and `header` (source run, target, signature,
  original size and knobs, engine, model), `status` (running | done | budget-spent |
  not-reproduced), `runs_used`, `deterministic`, `candidates` (every configuration tried: id, key,
  phase, step, config, size, status running | reproduces | gone, and each try's directory and
  outcome), `path` (the ids of the configurations adopted on the way from the original run to
  the minimum) and, once known, `minimal` and `confirmation`.
- `lookup(key)` finds a configuration already judged (or in flight when the shrink was killed), so
  a rerun of the same command never runs a finished candidate again; `charge(name)` counts a run
  once per try directory, so finishing an interrupted try costs nothing extra.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lpf.core.errors import LpfError
from lpf.core.jsonsafe import finite
from lpf.experiments.cells import read_out_doc

IDENTITY = ("source_run_id", "target", "tries", "need")


class State:
    def __init__(self, out: Path, doc: dict):
        self.out, self.doc = Path(out), doc
        self._by_key = {c["key"]: c for c in doc["candidates"]}

    @classmethod
    def open(cls, out: Path, identity: dict, header: dict, budget: int) -> "State":
        out = Path(out)
        doc = read_out_doc(out, "shrink.json")
        if doc is not None:
            old = {k: doc.get(k) for k in IDENTITY}
            if old != {k: identity[k] for k in IDENTITY}:
                what = ", ".join(f"{k} {old[k]!r}, not {identity[k]!r}" for k in IDENTITY if old[k] != identity[k])
                raise LpfError(f"{out} holds another shrink ({what}): choose another --out")
            doc["budget_runs"] = budget
            return cls(out, doc)
        if out.exists() and any(out.iterdir()):
            raise LpfError(f"{out} exists, is not empty and holds no shrink.json: choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "kind": "shrink",
            **identity,
            **header,
            "budget_runs": budget,
            "status": "running",
            "runs_used": 0,
            "charged": [],
            "deterministic": None,
            "candidates": [],
            "path": [],
            "minimal": None,
            "confirmation": None,
        }
        state = cls(out, doc)
        state.save()
        return state

    # -- candidates --------------------------------------------------------------------------------
    def lookup(self, key: str) -> dict | None:
        return self._by_key.get(key)

    def add(self, key: str, phase: str, step: str, config: dict, size: list[int], description: str) -> dict:
        cand = {
            "id": f"c{len(self.doc['candidates']) + 1:03d}",
            "key": key,
            "phase": phase,
            "step": step,
            "config": config,
            "size": size,
            "description": description,
            "status": "running",
            "tries": [],
        }
        self.doc["candidates"].append(cand)
        self._by_key[key] = cand
        self.save()
        return cand

    def record_try(self, cand: dict, outcome: dict) -> None:
        cand["tries"] = [t for t in cand["tries"] if t["dir"] != outcome["dir"]] + [outcome]
        self.save()

    def finish(self, cand: dict, reproduces: bool) -> None:
        cand["status"] = "reproduces" if reproduces else "gone"
        self.save()

    def charge(self, name: str, budget: int) -> bool:
        """Count a run for try directory `name` (once); False when the budget has no run left for it."""
        if name in self.doc["charged"]:
            return True
        if self.doc["runs_used"] >= budget:
            return False
        self.doc["charged"].append(name)
        self.doc["runs_used"] = len(self.doc["charged"])
        self.save()
        return True

    # -- the document ------------------------------------------------------------------------------
    def set(self, **fields) -> None:
        self.doc.update(fields)
        self.save()

    def save(self) -> None:
        tmp = self.out / ".tmp-shrink.json"
        with open(tmp, "w") as f:
            f.write(json.dumps(finite(self.doc), indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out / "shrink.json")
