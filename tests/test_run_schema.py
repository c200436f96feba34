"""The run directory across schema versions: a v1 run (no evidence columns) still reads and analyzes the
same, a newer schema is refused, and prompt-token parts follow the commit rule of tokens parts;
`schema.table` builds a table of the current schema from the columns a writer has."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lpf.run import schema
from lpf.run.store import RunDir


def _as_v1(src, dst):
    """A copy of a run as schema v1 wrote it: requests parts without the v2 columns, manifest v1."""
    shutil.copytree(src, dst)
    for p in (dst / "requests").glob("part-*.parquet"):
        t = pq.read_table(p)
        pq.write_table(t.drop_columns(["inconsistency", "attempts"]), p)
    m = json.loads((dst / "manifest.json").read_text())
    m["schema_version"] = 1
    (dst / "manifest.json").write_text(json.dumps(m))
    for name in ("findings.json", "summary.parquet", "report.html"):
        (dst / name).unlink(missing_ok=True)


def test_a_v1_run_reads_with_nulls_and_analyzes_the_same(hybrid_audit, tmp_path, lpf_cli):
    run_dir, proc = hybrid_audit
    assert proc.returncode == 0, proc.stderr
    v1 = tmp_path / "v1"
    _as_v1(run_dir, v1)
    assert "inconsistency" not in pq.read_schema(next((v1 / "requests").glob("part-*.parquet"))).names
    run = RunDir.open(v1)
    req = run.read("requests")
    assert req.schema == schema.REQUESTS and req.num_rows == 200
    assert req.column("inconsistency").null_count == 200
    assert run.read("requests", ["request_id", "attempts"]).column_names == ["request_id", "attempts"]
    r = lpf_cli("analyze", v1, "--json")
    assert r.code == 0, r.err
    before = json.loads((run_dir / "findings.json").read_text())
    after = json.loads(r.out)
    for key in ("verdict", "counts", "n_scored_tokens", "metrics", "flagged", "hypotheses"):
        assert after[key] == before[key], key


def test_a_newer_schema_is_refused(hybrid_audit, tmp_path, lpf_cli):
    run_dir, _ = hybrid_audit
    new = tmp_path / "new"
    shutil.copytree(run_dir, new)
    m = json.loads((new / "manifest.json").read_text())
    m["schema_version"] = schema.SCHEMA_VERSION + 1
    (new / "manifest.json").write_text(json.dumps(m))
    r = lpf_cli("analyze", new)
    assert r.code == 2 and f"v{schema.SCHEMA_VERSION + 1}" in r.err and "upgrade" in r.err


def test_prompt_tokens_commit_with_their_requests(tmp_path):
    run = RunDir.create(tmp_path / "run", {"run_id": "x"})
    req = pa.Table.from_pylist(
        [{"request_id": "a", "seq": 0, "prompt_token_ids": [1, 2, 3], "output_token_ids": [4], "attempts": []}],
        schema=schema.REQUESTS,
    )
    tok = pa.Table.from_pylist(
        [{"request_id": "a", "position": 0, "token_id": 4, "engine_logprob": -0.5}], schema=schema.TOKENS
    )
    ptok = pa.Table.from_pylist(
        [{"request_id": "a", "position": p, "token_id": t, "engine_logprob": -1.0} for p, t in ((1, 2), (2, 3))],
        schema=schema.PROMPT_TOKENS,
    )
    run.append_requests(req, tok, ptok)
    assert [p.name for p in run.parts("prompt_tokens")] == [p.name for p in run.parts("requests")]
    assert run.read("prompt_tokens").column("position").to_pylist() == [1, 2]
    # a crash after the prompt tokens, before the requests part: an orphan, dropped on open
    pq.write_table(ptok, run.path / "prompt_tokens" / "part-000001.parquet")
    pq.write_table(tok, run.path / "tokens" / "part-000001.parquet")
    reopened = RunDir.open(run.path)
    assert len(reopened.parts("prompt_tokens")) == 1 and len(reopened.parts("tokens")) == 1


def test_schema_table_fills_what_a_writer_lacks_and_refuses_what_the_schema_lacks(tmp_path):
    req = schema.table(schema.REQUESTS, {"request_id": ["a", "b"], "seq": [0, 1], "output_token_ids": [[4], [5, 6]]})
    assert req.schema == schema.REQUESTS and req.num_rows == 2
    assert req.column("attempts").null_count == 2 and req.column("inconsistency").null_count == 2
    run = RunDir.create(tmp_path / "run", {"run_id": "x"})
    run.append_requests(req, schema.table(schema.TOKENS, {"request_id": ["a", "b", "b"], "position": [0, 0, 1]}))
    assert run.read("tokens").num_rows == 3 and run.read("requests").equals(req)
    assert schema.table(schema.TOKENS, {}).schema == schema.TOKENS
    with pytest.raises(ValueError, match="no column state_slot"):
        schema.table(schema.TOKENS, {"request_id": ["a"], "state_slot": [3]})


def test_a_run_copied_without_its_reference_folder_takes_reference_parts(tmp_path):
    """scripts/gpu_check.sh copies a stored run without reference/ to rescore it: the store makes the
    folder (it used to fail with FileNotFoundError on reference/.tmp-part-000000.parquet)."""
    from pathlib import Path

    stored = Path(__file__).parent / "data" / "gpu-check-run"
    shutil.copytree(stored, tmp_path / "run", ignore=shutil.ignore_patterns("reference"))
    run = RunDir.open(tmp_path / "run")
    ref = pq.read_table(stored / "reference" / "part-000000.parquet")
    run.append_reference(ref)
    assert [p.name for p in run.parts("reference")] == ["part-000000.parquet"]
    # the stored part predates ref_logsumexp (a column added later): it reads back as nulls there
    got = run.read("reference")
    assert got.select(ref.column_names).equals(
        ref.cast(schema.REFERENCE.remove(schema.REFERENCE.get_field_index("ref_logsumexp")))
    )
    assert got.column("ref_logsumexp").null_count == got.num_rows
