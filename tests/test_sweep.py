"""`lpf sweep`: one real `lpf audit` subprocess per cell, resumable, and what moves the shape.

The required demonstration (issue 6): a sweep over the built-in engine's cache size with the
`stale-state` drill shows the imposter rate moving with cache size, as in the seed: fewer slots
recycle sooner, so more new requests land on a slot holding an earlier request's state. Judged twice:
by the fault ground truth of every cell (faults/*.parquet, which analysis never reads) and by the
findings the sweep reports.
"""

import json

import pyarrow.parquet as pq
import pytest

from conftest import write_prompts
from lpf.views.query import run_query
from lpf.experiments.sweep import shape_moves

CACHES = ("1", "4", "16")


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=3, n=120)
    return write_prompts(
        tmp_path_factory.mktemp("w") / "w120.jsonl", [{"id": i["id"], "prompt": i["prompt"]} for i in items]
    )


def sweep_args(workload, out):
    # tiny:jamba: the seed's architecture, where a stale Mamba1 state visibly corrupts the output.
    # A 17-token budget makes "1 token left for a new request" frequent; 240 requests against
    # 13..215 state slots make slot reuse go from almost every request to almost none.
    return [
        "sweep",
        "--knob",
        "cache-mb=" + ",".join(CACHES),
        "--inject",
        "stale-state",
        "--model",
        "tiny:jamba",
        "--workload",
        workload,
        "--n",
        2,
        "--max-tokens",
        8,
        "--max-num-batched-tokens",
        17,
        "--out",
        out,
        "--fail-on",
        "never",
        "--json",
    ]


@pytest.fixture(scope="module")
def stale_sweep(tmp_path_factory, workload):
    from conftest import lpf_main

    out = tmp_path_factory.mktemp("sweep") / "s"
    proc = lpf_main(*sweep_args(workload, out))
    assert proc.returncode == 0, proc.stderr
    return out, proc


def _truth(run):
    if not (run / "faults").is_dir():
        return set()
    return {r[0] for r in run_query(run, "SELECT DISTINCT request_id FROM faults")[1]}


@pytest.mark.slow
def test_cache_size_moves_the_stale_state_rate(stale_sweep):
    out, proc = stale_sweep
    doc = json.loads(proc.stdout)
    assert doc == json.loads((out / "sweep.json").read_text())
    assert doc["kind"] == "sweep" and doc["complete"]
    assert doc["knobs"] == [{"name": "cache-mb", "values": list(CACHES)}]
    cells = {c["values"]["cache-mb"]: c for c in doc["cells"]}
    assert set(cells) == set(CACHES)
    truth, flagged = {}, {}
    for v, c in cells.items():
        run = out / c["run_dir"]
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["status"] == "complete" and manifest["engine"]["options"]["cache_mb"] == float(v)
        findings = json.loads((run / "findings.json").read_text())
        truth[v] = _truth(run)
        flagged[v] = {f["request_id"] for f in findings["flagged"]}
        assert flagged[v] <= truth[v], "only imposters are flagged"
        assert c["n_requests"] == 240 and c["n_flagged"] == len(flagged[v])
    # ground truth: smaller cache -> more imposters, clearly
    t = [len(truth[v]) for v in CACHES]
    assert t[0] > t[1] > t[2] and t[0] >= 4 * max(t[2], 1), t
    # the findings see the same ordering, with most imposters caught
    rates = [cells[v]["rate"] for v in CACHES]
    assert rates[0] > rates[1] > rates[2], rates
    assert sum(len(f) for f in flagged.values()) >= 0.8 * sum(t)
    # and the sweep says so in words, with the numbers
    rate_move = next(m for m in doc["moves"] if m["knob"] == "cache-mb" and m["metric"] == "rate")
    assert rate_move["moves"]
    for v in CACHES:
        assert f"({cells[v]['n_flagged']}/240)" in rate_move["sentence"]
    assert {m["metric"] for m in doc["moves"]} == {"rate", "onset", "position", "period"}
    # the imposter's lie starts at its first output token, whatever the cache size
    assert all(cells[v]["first_divergence_median"] == 0 for v in CACHES if cells[v]["n_flagged"])
    table = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [r["rate"] for r in table] == [c["rate"] for c in doc["cells"]]
    assert [r["cache-mb"] for r in table] == list(CACHES)
    assert "cache-mb moves the rate" in proc.stderr  # the table and sentences are printed


@pytest.mark.slow
def test_rerun_resumes_without_redoing_cells(stale_sweep, workload):
    from conftest import lpf_main

    out, first = stale_sweep
    before = json.loads((out / "sweep.json").read_text())
    run_ids = {
        c["name"]: json.loads((out / c["run_dir"] / "manifest.json").read_text())["run_id"] for c in before["cells"]
    }
    # an interrupted cell: its analysis and part of its reference scores are gone
    victim = out / before["cells"][0]["run_dir"]
    (victim / "findings.json").unlink()
    parts = sorted((victim / "reference").glob("part-*.parquet"))
    parts[-1].unlink()
    proc = lpf_main(*sweep_args(workload, out))
    assert proc.returncode == 0, proc.stderr
    after = json.loads(proc.stdout)
    assert {
        c["name"]: json.loads((out / c["run_dir"] / "manifest.json").read_text())["run_id"] for c in after["cells"]
    } == run_ids, "no cell was re-created"
    for a, b in zip(before["cells"], after["cells"]):
        assert (a["name"], a["counts"], a["n_flagged"]) == (b["name"], b["counts"], b["n_flagged"])
    # the victim was finished (its own spec, rescored and analysed again), the complete cells not touched
    log = (out / "logs" / f"{before['cells'][0]['name']}.log").read_text()
    assert "(finishing the interrupted run)" in log and log.count("$ lpf audit") == 2
    for c in before["cells"][1:]:
        assert (out / "logs" / f"{c['name']}.log").read_text().count("$ lpf audit") == 1
    # the same --out with other knobs is refused, and nothing is touched
    other = lpf_main("sweep", "--knob", "cache-mb=2,3", "--out", out, "--max-tokens", 4)
    assert other.returncode == 2 and "different sweep" in other.stderr and "Traceback" not in other.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--knob", "cache_mbb=1,2"], "did you mean 'cache-mb'"),
        (["--knob", "max-num-seq=1,2"], "did you mean 'max-num-seqs'"),
        (["--knob", "blok_size=8,16"], "did you mean 'block_size'"),
        (["--knob", "cache-mb=1,-2"], "cache_mb must be > 0"),
        (["--knob", "cache-mb=1,4", "--cache-mb", "2"], "both a knob and a fixed option"),
        (["--knob", "inject=none,stale-sate"], "did you mean 'stale-state'"),
        (["--knob", "enable-chunked-prefill=true,maybe"], "expected true/false"),
        (["--knob", "cache-mb"], "NAME=V1,V2"),
        (["--knob", "n=1,2", "--no-such-option", "3"], "No such option"),
    ],
)
def test_bad_knobs_fail_before_anything_runs(lpf_cli, tmp_path, args, message):
    r = lpf_cli("sweep", *args, "--out", tmp_path / "s")
    assert r.code == 2 and message in r.err, r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_engine_knobs_run_as_cells(lpf_cli, tmp_path, workload):
    """-E options are knobs too; each cell is a real audit in a child process (also from the
    in-process CLI)."""
    small = write_prompts(tmp_path / "w.jsonl", [json.loads(x) for x in workload.read_text().splitlines()[:12]])
    r = lpf_cli(
        "sweep",
        "--knob",
        "block_size=8,16",
        "--model",
        "tiny:hybrid",
        "--workload",
        small,
        "--max-tokens",
        3,
        "--out",
        tmp_path / "s",
        "--fail-on",
        "never",
        "--json",
        "-E",
        "threads=1",
    )
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert [c["name"] for c in doc["cells"]] == ["block_size-8", "block_size-16"]
    for c in doc["cells"]:
        m = json.loads((tmp_path / "s" / c["run_dir"] / "manifest.json").read_text())
        assert m["engine"]["options"]["block_size"] == int(c["values"]["block_size"])
        assert m["engine"]["options"]["threads"] == 1  # fixed options reach every cell
        assert c["n_requests"] == 12 and c["verdict"] == "clean" and c["rate"] == 0
    assert {(m["knob"], m["metric"]) for m in doc["moves"]} == {
        ("block_size", x) for x in ("rate", "onset", "position", "period")
    }
    assert not any(m["moves"] for m in doc["moves"])


def test_cells_are_the_product_of_the_knobs(tmp_path):
    """Each cell is the sweep's options with its values put in, as one AuditSpec (a multi-valued option
    joins parts with +, none = no part; switches and flags take on/off; engine options go in as -E)."""
    from lpf.cli.experiments import plan_sweep, sweep

    args = [
        "--knob",
        "cache-mb=1,2",
        "--knob",
        "inject=none,stale-state+offset-wrap:18",
        "--knob",
        "enable_chunked_prefill=on,off",
        "--knob",
        "ignore-eos=false,true",
        "--knob",
        "block_size=8",
        "--n",
        "2",
        "--out",
        str(tmp_path / "s"),
    ]
    ctx = sweep.make_context("sweep", args)
    knobs, cells = plan_sweep(
        ctx,
        list(ctx.params["knobs"]),
        tmp_path / "s",
        {k: v for k, v in ctx.params.items() if k not in ("knobs", "out_dir", "as_json", "fail_on")},
    )
    assert [k.name for k in knobs] == ["cache-mb", "inject", "enable-chunked-prefill", "ignore-eos", "block_size"]
    assert len(cells) == 16 and len({c.name for c in cells}) == 16
    c = next(
        c
        for c in cells
        if c.values
        == {
            "cache-mb": "2",
            "inject": "stale-state+offset-wrap:18",
            "enable-chunked-prefill": "off",
            "ignore-eos": "true",
            "block_size": "8",
        }
    )
    assert (
        c.name
        == "cache-mb-2__inject-stale-state_offset-wrap_18__enable-chunked-prefill-off__ignore-eos-true__block_size-8"
    )
    assert c.spec.run.out == tmp_path / "s" / "cells" / c.name and c.spec.run.n == 2 and c.spec.run.sampling.ignore_eos
    assert c.spec.run.engine_options == {
        "cache_mb": 2.0,
        "inject": "stale-state,offset-wrap:18",
        "enable_chunked_prefill": False,
        "block_size": 8,
    }
    plain = next(c for c in cells if c.values["inject"] == "none" and c.values["ignore-eos"] == "false")
    assert "inject" not in plain.spec.run.engine_options and not plain.spec.run.sampling.ignore_eos


def _row(values, flagged, scored=200, onset=None, pos=None, period=None):
    return {
        "values": values,
        "n_flagged": flagged,
        "n_scored": scored,
        "rate": flagged / scored,
        "onset_seq": onset,
        "onset_step": None,
        "first_divergence_median": pos,
        "period": period,
    }


def test_shape_moves_is_judged_with_other_knobs_fixed():
    knobs = [{"name": "a", "values": ["1", "2"]}, {"name": "b", "values": ["x", "y"]}]
    rows = [
        _row({"a": "1", "b": "x"}, 20, onset=5, pos=0.0, period=12.0),
        _row({"a": "2", "b": "x"}, 1, onset=150, pos=0.0, period=None),
        _row({"a": "1", "b": "y"}, 20, onset=7, pos=4.0, period=12.0),
        _row({"a": "2", "b": "y"}, 1, onset=160, pos=4.0, period=None),
    ]
    moves = {(m["knob"], m["metric"]): m for m in shape_moves(knobs, rows)}
    rate = moves[("a", "rate")]
    assert rate["moves"] and "in 2 of 2 settings" in rate["sentence"]
    assert "10.0% (20/200); 0.5% (1/200)" in rate["sentence"] and "with b=x" in rate["sentence"]
    assert moves[("a", "onset")]["moves"] and "7; 160" in moves[("a", "onset")]["sentence"]
    assert moves[("a", "period")]["moves"] and "12; none" in moves[("a", "period")]["sentence"]
    assert not moves[("a", "position")]["moves"]
    assert moves[("b", "position")]["moves"] and "0; 4" in moves[("b", "position")]["sentence"]
    assert not moves[("b", "rate")]["moves"] and not moves[("b", "period")]["moves"]
    assert not moves[("b", "onset")]["moves"], "5 vs 7 of 200 arrivals is not a move"
