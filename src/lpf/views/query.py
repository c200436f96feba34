"""`lpf query`: DuckDB SQL over a run directory's Parquet parts.

Views: `requests`, `tokens`, `reference` (and `trace`, `faults`, `calibration`, `summary` when present), each over
the glob of its parts, so a query sees exactly what has been committed.
"""

from __future__ import annotations

from pathlib import Path

from lpf.core.errors import LpfError
from lpf.run.store import RunDir


def connect(run: RunDir):
    import duckdb

    con = duckdb.connect()
    for sub in sorted(p.name for p in run.path.iterdir() if p.is_dir()):
        if run.parts(sub):
            glob = str(run.path / sub / "part-*.parquet").replace("'", "''")
            con.execute(f"CREATE VIEW {sub} AS SELECT * FROM read_parquet('{glob}', union_by_name=true)")
    summary = run.path / "summary.parquet"
    if summary.is_file():
        con.execute(
            f"CREATE VIEW summary AS SELECT * FROM read_parquet('{str(summary).replace(chr(39), chr(39) * 2)}')"
        )
    return con


def run_query(path: Path | str, sql: str):
    """(column names, rows) of a query. Raises LpfError with DuckDB's message on a bad query."""
    import duckdb

    con = connect(RunDir.open(path))
    try:
        cur = con.execute(sql)
        return [d[0] for d in cur.description or []], cur.fetchall()
    except duckdb.Error as e:
        raise LpfError(f"query failed: {str(e).splitlines()[0]}") from None
