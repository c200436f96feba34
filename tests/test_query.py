"""`lpf query`: DuckDB views over the parts."""

import json


def test_query_views(lpf_cli, hybrid_audit):
    run = hybrid_audit[0]
    r = lpf_cli("query", run, "SELECT count(*) AS n FROM requests", "--format", "json")
    assert r.code == 0, r.err
    assert json.loads(r.out) == [{"n": 200}]
    r = lpf_cli(
        "query",
        run,
        """
        SELECT count(*) AS n, max(abs(t.engine_logprob - f.ref_logprob)) AS worst
        FROM tokens t JOIN reference f USING (request_id, position)""",
        "--format",
        "json",
    )
    row = json.loads(r.out)[0]
    findings = json.loads((run / "findings.json").read_text())
    assert row["n"] == findings["n_scored_tokens"]
    assert abs(row["worst"] - findings["metrics"]["abs_logprob_diff"]["max"]) < 1e-12
    r = lpf_cli("query", run, "SELECT verdict, count(*) FROM summary GROUP BY 1", "--format", "csv")
    assert r.out.splitlines() == ["verdict,count_star()", "clean,200"]
