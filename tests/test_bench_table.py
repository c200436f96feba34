"""docs/benchmarks.md opens with today's numbers, generated from bench/results/*.json by scripts/bench_table.py
(`make bench-table`): the block in the doc must be exactly what the script generates from the JSON now,
so a bench that rewrote its results file, or a new one, fails here until the table is regenerated; and a
stale analysis or engine row (its sources changed after the commit it measured) fails until re-measured
or accepted with a reason in bench/accepted_stale.json. The staleness rules are checked on throwaway git
repositories (a shallow clone included)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
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


_WHO = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env={**os.environ, **_WHO})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _repo(tmp_path: Path) -> tuple[Path, str]:
    """A git repo with an analysis source file and an analysis result measured at its first commit."""
    repo = tmp_path / "repo"
    (repo / "src" / "lpf" / "analysis").mkdir(parents=True)
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "src" / "lpf" / "analysis" / "x.py").write_text("a = 1\n")
    (repo / "README").write_text("r\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    measured = _git(repo, "rev-parse", "HEAD")
    (repo / "bench" / "results" / "brandnew.json").write_text(json.dumps({"date": "2026-12-07", "commit": measured}))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "the result")
    return repo, measured


def test_a_row_is_stale_once_a_covered_path_changes_after_the_measured_commit(tmp_path):
    t = _table()
    repo, measured = _repo(tmp_path)
    covers = ["src/lpf/analysis", "bench/analysis.py"]
    assert t.staleness(measured, covers, repo)[0] == "fresh"  # the result's own commit touches no source
    (repo / "README").write_text("r2\n")
    _git(repo, "commit", "-qam", "docs only")
    assert t.staleness(measured, covers, repo)[0] == "fresh"
    (repo / "src" / "lpf" / "analysis" / "x.py").write_text("a = 2\n")
    _git(repo, "commit", "-qam", "analysis changed")
    status, words = t.staleness(measured, covers, repo)
    assert status == "stale" and "1 commit(s)" in words
    assert t.staleness(None, covers, repo)[0] == "unknown"
    assert t.staleness("0" * 40, covers, repo)[0] == "unknown"
    assert t.staleness(measured, covers, tmp_path / "not-a-repo")[0] == "unknown"


def test_a_shallow_clone_says_unknown_instead_of_failing(tmp_path):
    t = _table()
    repo, measured = _repo(tmp_path)
    (repo / "src" / "lpf" / "analysis" / "x.py").write_text("a = 3\n")
    _git(repo, "commit", "-qam", "analysis changed")
    shallow = tmp_path / "shallow"
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow))
    assert t.staleness(measured, ["src/lpf/analysis"], shallow)[0] == "unknown"


def test_a_stale_gated_row_fails_the_check_until_accepted_and_a_remeasure_retires_the_acceptance(tmp_path):
    t = _table()
    repo, measured = _repo(tmp_path)
    results = repo / "bench" / "results"
    (results / "brandnew.json").rename(results / "analysis.json")
    (results / "analysis.json").write_text(json.dumps({"date": "2026-12-07", "commit": measured}))
    accepted = repo / "bench" / "accepted_stale.json"
    assert t.check(results, accepted, repo)[1] == []
    (repo / "src" / "lpf" / "analysis" / "x.py").write_text("a = 4\n")
    _git(repo, "commit", "-qam", "analysis changed")
    (problem,) = t.check(results, accepted, repo)[1]
    assert problem.startswith("analysis (analysis.json) is stale")
    accepted.write_text(json.dumps({"analysis": {"commit": measured, "reason": "a docstring only"}}))
    assert t.check(results, accepted, repo)[1] == []
    assert "stale, accepted: a docstring only" in t._measured(
        "analysis", {"commit": measured}, "2026-12-07", t.accepted(accepted)
    )
    assert "with uncommitted changes" in t._measured("x", {"commit": measured, "dirty": True}, "2026-12-07", {})
    head = _git(repo, "rev-parse", "HEAD")
    (results / "analysis.json").write_text(json.dumps({"date": "2026-12-08", "commit": head}))
    (problem,) = t.check(results, accepted, repo)[1]
    assert "retire it" in problem


def test_the_gated_rows_of_this_checkout_are_fresh_or_accepted():
    """make test's table check: a stale analysis or engine row fails until re-measured or accepted (unknown
    where git cannot say, e.g. a shallow clone: never a failure)."""
    t = _table()
    report, problems = t.check()
    assert not problems, "\n".join(problems)
    assert len(report) == len(t.latest())
