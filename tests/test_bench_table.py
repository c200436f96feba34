"""docs/benchmarks.md opens with today's numbers, generated from bench/results/*.json by scripts/bench_table.py
(`make bench-table`): the block in the doc must be exactly what the script generates from the JSON now,
so a bench that rewrote its results file, or a new one, fails here until the table is regenerated."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _table():
    spec = importlib.util.spec_from_file_location("bench_table", ROOT / "scripts" / "bench_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_doc_s_table_is_what_the_script_generates_from_the_results():
    t = _table()
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert t.replace_block(doc, t.table()) == doc, "docs/benchmarks.md is stale: run `make bench-table`"
    families = {p.stem.split("-", 1)[0] for p in (ROOT / "bench" / "results").glob("*.json")}
    block = doc[doc.index(t.BEGIN) : doc.index(t.END)]
    assert all(f"| {f} |" in block for f in families)


def test_the_newest_file_of_a_family_is_today_s_and_a_family_without_a_row_still_shows(tmp_path):
    t = _table()
    (tmp_path / "conformance.json").write_text(
        json.dumps(
            {
                "date": "2026-12-01",
                "model": "m",
                "ratio": 2.0,
                "seconds_per_cell": {
                    "lpf conformance (in-process, kept worker)": 5.0,
                    "lpf audit per cell (sweep's way)": 10.0,
                },
            }
        )
    )
    newer = {
        "date": "2026-12-04",
        "model": "m2",
        "ratio": 3.0,
        "seconds_per_cell": {
            "lpf conformance (in-process, kept worker)": 4.0,
            "lpf audit per cell (sweep's way)": 12.0,
        },
    }
    (tmp_path / "conformance-2026-12-04-x.json").write_text(json.dumps(newer))
    (tmp_path / "brandnew.json").write_text(json.dumps({"date": "2026-12-04"}))
    rows = t.table(tmp_path).splitlines()[2:]
    assert len(rows) == 2
    assert "3.00x faster" in rows[0] and "`conformance-2026-12-04-x.json`" in rows[0]
    assert rows[1].startswith("| brandnew |") and "no summary row" in rows[1]
