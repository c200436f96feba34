"""Changing one stored engine logprob flags exactly that request, at that position."""

import json
import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


def test_one_edited_logprob_flags_exactly_that_request(hybrid_audit, tmp_path, lpf_cli):
    src, proc = hybrid_audit
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "edited"
    shutil.copytree(src, run)
    part = sorted((run / "tokens").glob("part-*.parquet"))[1]
    table = pq.read_table(part)
    # the 4th output token of some request in the middle of the part
    victim = table.column("request_id")[table.num_rows // 2].as_py()
    rows = pc.equal(table.column("request_id"), victim).to_numpy(zero_copy_only=False)
    target = [i for i, hit in enumerate(rows) if hit][3]
    assert table.column("position")[target].as_py() == 3
    lp = table.column("engine_logprob").to_pylist()
    lp[target] -= 2.0
    table = table.set_column(
        table.schema.get_field_index("engine_logprob"), "engine_logprob", pa.array(lp, pa.float64())
    )
    pq.write_table(table, part)

    r = lpf_cli("analyze", run, "--json")
    assert r.code == 1, r.err  # divergent >= the default --fail-on
    findings = json.loads(r.out)
    assert [f["request_id"] for f in findings["flagged"]] == [victim]
    assert findings["flagged"][0]["first_divergence"] == 3
    assert findings["flagged"][0]["verdict"] == "divergent"
    assert abs(findings["flagged"][0]["max_abs_logprob_diff"] - 2.0) < 1e-3
    assert findings["counts"]["clean"] == 199

    assert lpf_cli("analyze", run, "--fail-on", "corrupt").code == 0
    # the edit left the token's own top-k entry as it was: the answer contradicts itself, divergent whatever
    # the thresholds (issue 52)
    r = lpf_cli("analyze", run, "--threshold", "divergent_abs_diff=3", "--json")
    assert r.code == 1 and "topk_mismatch at position 3" in json.loads(r.out)["flagged"][0]["self_contradiction"]

    # an engine that returned no top-k there: a threshold above the edit makes it noise (thresholds are
    # honoured, and printed)
    empty_ids = pa.array([[] if i == target else v for i, v in enumerate(table.column("engine_topk_ids").to_pylist())])
    empty_lps = [[] if i == target else v for i, v in enumerate(table.column("engine_topk_logprobs").to_pylist())]
    table = table.set_column(
        table.schema.get_field_index("engine_topk_ids"),
        "engine_topk_ids",
        empty_ids.cast(table.schema.field("engine_topk_ids").type),
    )
    table = table.set_column(
        table.schema.get_field_index("engine_topk_logprobs"),
        "engine_topk_logprobs",
        pa.array(empty_lps, table.schema.field("engine_topk_logprobs").type),
    )
    pq.write_table(table, part)
    r = lpf_cli("analyze", run, "--threshold", "divergent_abs_diff=3", "--json")
    assert r.code == 0 and json.loads(r.out)["counts"]["noise"] == 1
    assert json.loads(r.out)["thresholds"]["divergent_abs_diff"] == 3.0
