"""`lpf inspect DIR REQUEST_ID`: a request token by token and its trace, on a real drill run.

The run is a small `stale-state` audit of the built-in engine: an imposter request's inspection must
show what the seed's engineers had to dig out by hand: its lie starts at output position 0, and its
first scheduled step ran as a decode with nothing computed yet.
"""

import json
import shutil

import pytest

from conftest import lpf_main, write_prompts


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    from lpf.zoo import registry

    base = tmp_path_factory.mktemp("inspect")
    items = registry.workload_items("oracle", seed=3, n=60)
    w = write_prompts(base / "w.jsonl", [{"id": i["id"], "prompt": i["prompt"]} for i in items])
    run = base / "run"
    proc = lpf_main(
        "audit",
        "--model",
        "tiny:jamba",
        "--workload",
        w,
        "--n",
        2,
        "--max-tokens",
        6,
        "--cache-mb",
        1,
        "--max-num-batched-tokens",
        17,
        "--inject",
        "stale-state",
        "--out",
        run,
        "--fail-on",
        "never",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(proc.stdout)
    assert findings["flagged"], "the drill must produce at least one imposter"
    return run, findings


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_imposter_token_by_token_and_step_by_step(lpf_cli, stale_run):
    run, findings = stale_run
    rid = findings["flagged"][0]["request_id"]
    r = lpf_cli("inspect", run, rid, "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    req = info["request"]
    assert req["request_id"] == rid and req["summary"]["verdict"] in ("divergent", "corrupt")
    toks = info["tokens"]
    assert [t["position"] for t in toks] == list(range(len(req["output_token_ids"])))
    assert [t["token_id"] for t in toks] == req["output_token_ids"]
    for t in toks:
        assert t["abs_diff"] == pytest.approx(abs(t["engine_logprob"] - t["ref_logprob"]))
        assert t["ref_rank"] >= 1 and isinstance(t["token"], str)
        assert len(t["engine_topk"]) == 5 and len(t["ref_topk"]) == 5
        assert all(isinstance(x["token"], str) and x["logprob"] <= 0 for x in t["engine_topk"] + t["ref_topk"])
        assert t["engine_topk"][0]["logprob"] >= t["engine_topk"][-1]["logprob"]
    first = req["summary"]["first_divergence"]
    assert first == 0 and toks[0]["abs_diff"] > 0.5
    trace = info["trace"]
    assert trace[0]["phase"] == "decode" and trace[0]["num_computed_tokens"] == 0, "the imposter's first step"
    steps = [s for s in trace if not s["preempted"]]
    for a, b in zip(steps, steps[1:]):
        assert (
            b["step"] > a["step"] and b["num_computed_tokens"] == a["num_computed_tokens"] + a["num_scheduled_tokens"]
        )
    assert all(s["state_slot"] == steps[0]["state_slot"] for s in steps)
    # its mechanism, as findings.json has it: the imposter's first step (no write log entry: nothing strayed)
    assert info["mechanism"] == findings["flagged"][0]["mechanism"]
    assert info["mechanism"]["feature"] in ("first_decode_uncomputed", "first_phase_decode", "admitted_as_decode")
    assert info["overwritten_by"] == [] and all(s["stray_writes"] == [] for s in steps)
    # the table form says the same things
    t = lpf_cli("inspect", run, rid)
    assert t.code == 0 and rid in t.out and "first divergence at position 0" in t.out
    assert "trace" in t.out and "decode" in t.out and "ref top-3" in t.out
    assert f"mechanism: {info['mechanism']['feature']}" in t.out


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_clean_request_without_trace_or_reference(lpf_cli, stale_run, tmp_path):
    run, findings = stale_run
    flagged = {f["request_id"] for f in findings["flagged"]}
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "trace")
    shutil.rmtree(copy / "reference")
    (copy / "summary.parquet").unlink()
    from lpf.views.query import run_query

    rid = next(r[0] for r in run_query(run, "SELECT request_id FROM requests ORDER BY seq")[1] if r[0] not in flagged)
    info = json.loads(lpf_cli("inspect", copy, rid, "--json").out)
    assert info["trace"] is None and not info["rescored"]
    assert all(t["ref_logprob"] is None and t["abs_diff"] is None and t["ref_topk"] == [] for t in info["tokens"])
    assert all(t["engine_logprob"] is not None for t in info["tokens"])
    t = lpf_cli("inspect", copy, rid)
    assert t.code == 0 and "not rescored yet" in t.out and "no trace" in t.out


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_unknown_request_and_bad_dir(lpf_cli, stale_run, tmp_path):
    run, findings = stale_run
    rid = findings["flagged"][0]["request_id"]
    typo = rid[:-1] + ("9" if rid[-1] != "9" else "8")
    r = lpf_cli("inspect", run, typo)
    assert r.code == 2 and f"did you mean {rid!r}" in r.err and "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) == 1
    r = lpf_cli("inspect", tmp_path, rid)
    assert r.code == 2 and "not a run directory" in r.err


def test_unexplained_is_said_once_and_a_whole_answer_flag_has_no_position():
    """`lpf inspect` printed "mechanism: unexplained: unexplained: ..."; the flagged table "None"."""
    from rich.console import Console

    from lpf.analysis.mechanisms import UNEXPLAINED
    from lpf.analysis.thresholds import Thresholds
    from lpf.cli.render import print_summary
    from lpf.cli.render_views import print_request

    info = {
        "request": {"request_id": "r1", "summary": {"verdict": "divergent", "first_divergence": None}},
        "mechanism": {"feature": None, "sentence": UNEXPLAINED, "rank": None},
        "tokens": [],
        "trace": [],
        "rescored": True,
        "tokenizer": None,
        "overwritten_by": None,
    }
    console = Console(record=True, width=200)
    print_request(info, console)
    text = console.export_text()
    assert text.count("unexplained") == 1 and f"mechanism: {UNEXPLAINED}" in text
    assert "as a whole" in text

    flagged = {"request_id": "r1", "seq": 0, "verdict": "divergent", "first_divergence": None}
    findings = {
        "verdict": "divergent",
        "counts": {"clean": 0, "noise": 0, "divergent": 1, "corrupt": 0, "error": 0, "unscored": 0},
        "n_requests": 1,
        "n_tokens": 4,
        "n_scored_tokens": 4,
        "thresholds": Thresholds().to_dict(),
        "metrics": {},
        "flagged": [{**flagged, "max_abs_logprob_diff": 0.5, "mechanism": info["mechanism"]}],
    }
    console = Console(record=True, width=200)
    print_summary(findings, "RUN", console)
    text = console.export_text()
    row = next(line for line in text.splitlines() if " r1 " in line)
    assert "None" not in row and "whole answer" in row and "not at one position" in text
