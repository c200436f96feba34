"""The optional calibration run (`--calibrate`), through the real CLI with real models: the reference
teacher-forced again at the engine's dtype gives the noise floor, and nothing the engine reports can
move the thresholds taken from it.

Measured on the processed-logprobs drill (T = 0.6, 8 tokens past EOS, 300 requests, float32 engine),
before the expected floor replaced the run's own (the own floor is now only the fallback; the tests
compute it directly to show what it would do):
- tiny:hybrid (untrained, flat distributions: the lie is large everywhere): the run's own floor rises
  to its caps (divergent > 2) and flags 8/300; the calibration run keeps the defaults: 299/300.
- zoo:hybrid (trained: most tokens p ~ 1 on both sides, where a temperature barely moves a logprob):
  the run's own floor raises clean_abs_diff to ~5.4e-3 (114 clean, 178 noise, 8 divergent); the
  calibration run keeps the defaults (87 clean, 205 noise, 8 divergent). Most of this lie is below
  divergent_abs_diff (0.5), so only clean -> noise moves; the run-level test calls the run systematic.
"""

import json
import shutil
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conftest import write_prompts

DEFAULTS = {"clean_abs_diff": 1e-3, "divergent_abs_diff": 0.5, "tie_margin": 1e-3}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from lpf.zoo import registry

    def make(n: int, seed: int):
        items = registry.workload_items("oracle", seed=seed, n=n)
        path = tmp_path_factory.mktemp("workloads") / f"oracle{n}.jsonl"
        return write_prompts(
            path, [{"id": it["id"], "prompt": it["prompt"], "expected": it["expected"]} for it in items]
        )

    return make


def _th(f: dict) -> dict:
    return {k: f["thresholds"][k] for k in DEFAULTS}


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_bf16_engine_calibration_run(prompts, tmp_path, lpf_cli):
    """(1) bfloat16 engine, float32 reference: the floor comes from the reference at bfloat16, above
    float32's (~0); nothing corrupt; resumable; and engine logprobs cannot move the thresholds."""
    run = tmp_path / "bf16"
    r = lpf_cli(
        "audit",
        "--model",
        "tiny:hybrid",
        "--dtype",
        "bfloat16",
        "--workload",
        prompts(60, 11),
        "--max-tokens",
        8,
        "--ignore-eos",
        "--token-budget",
        512,
        "--calibrate",
        "--out",
        run,
        "--json",
        "--fail-on",
        "corrupt",
    )
    assert r.code == 0, r.err  # --fail-on corrupt: nothing corrupt
    f = json.loads(r.out)
    th = f["thresholds"]
    floor = th["noise_floor"]
    assert f["counts"]["corrupt"] == 0 and f["n_requests"] == 60
    assert th["source"] == "calibration-run" and floor["dtype"] == "bfloat16" and floor["reference_dtype"] == "float32"
    assert floor["n_requests"] == 60 and floor["n_tokens"] == 480
    assert floor["token_abs_diff"]["median"] > 1e-3  # bf16 rounding; float32 vs itself is 0 (test 3)
    assert th["clean_abs_diff"] > DEFAULTS["clean_abs_diff"]
    assert "from a calibration run, reference at bfloat16" in r.err
    cal = pq.read_table(run / "calibration")
    assert cal.schema.names == pq.read_table(run / "reference").schema.names and cal.num_rows == 480

    # the engine lies about every logprob (+3 nats, and one request wildly): the floor must not move
    for part in sorted((run / "tokens").glob("part-*.parquet")):
        t = pq.read_table(part)
        lp = pc.add(t.column("engine_logprob"), 3.0)
        pq.write_table(t.set_column(t.schema.get_field_index("engine_logprob"), "engine_logprob", lp), part)
    # and the calibration run was interrupted: its last parts are missing
    parts = sorted((run / "calibration").glob("part-*.parquet"))
    assert len(parts) >= 3
    for p in parts[len(parts) // 2 :]:
        p.unlink()
    r2 = lpf_cli("rescore", run, "--calibrate", "--token-budget", 512)
    assert r2.code == 0, r2.err
    cal2 = pq.read_table(run / "calibration")
    assert (
        cal2.num_rows == 480
        and len(set(zip(cal2.column("request_id").to_pylist(), cal2.column("position").to_pylist()))) == 480
    )
    r3 = lpf_cli("analyze", run, "--json", "--fail-on", "never")
    assert r3.code == 0, r3.err
    lied = json.loads(r3.out)
    assert _th(lied) == _th(f) and lied["thresholds"]["noise_floor"] == floor
    assert lied["counts"]["clean"] == 0  # the lie itself is still seen: every request is off by 3 nats


@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_float32_engine_keeps_defaults(prompts, tmp_path, lpf_cli):
    """(3) float32 engine: the calibration run would be the reference itself; floor 0, defaults."""
    run = tmp_path / "f32"
    r = lpf_cli(
        "audit",
        "--model",
        "tiny:hybrid",
        "--workload",
        prompts(30, 12),
        "--max-tokens",
        8,
        "--calibrate",
        "--out",
        run,
        "--json",
        "--fail-on",
        "never",
    )
    assert r.code == 0, r.err
    f = json.loads(r.out)
    th = f["thresholds"]
    assert th["source"] == "calibration-run" and th["noise_floor"]["same_as_reference"] is True
    assert th["noise_floor"]["token_abs_diff"] == {"median": 0.0, "mad": 0.0}
    assert _th(f) == DEFAULTS
    assert "like the reference" in r.err and not list((run / "calibration").glob("part-*.parquet"))
    # an engine whose dtype is not known (a server's "auto") cannot be calibrated: one line, exit 2
    m = json.loads((run / "manifest.json").read_text())
    m["engine"]["options"]["dtype"] = "auto"
    (run / "manifest.json").write_text(json.dumps(m))
    r = lpf_cli("rescore", run, "--calibrate")
    assert r.code == 2 and "the engine's dtype is auto" in r.err and "Traceback" not in r.err


def _own_floor_thresholds(run):
    """What the run's own floor (`calibration.calibrate`, now only the fallback) would have set."""
    from lpf.analysis import metrics
    from lpf.analysis.calibration import calibrate
    from lpf.analysis.thresholds import Thresholds

    joined, starts = metrics.join_grouped(pq.read_table(run / "tokens"), pq.read_table(run / "reference"))
    ad = abs(joined.column("engine_logprob").to_numpy() - joined.column("ref_logprob").to_numpy())
    th, info = calibrate(ad, starts, Thresholds())
    assert info["source"] == "calibrated"
    return th


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_processed_logprobs_drill_with_calibration_run(prompts, tmp_path, lpf_cli):
    """(2) every request's logprobs are post-temperature: the run's own floor would absorb part of
    the lie (its thresholds rise above the defaults); the expected floor (the shipped table, and a
    calibration run alike) keeps the defaults, and the run-level test calls the run systematic."""
    run = tmp_path / "p"
    r = lpf_cli(
        "audit",
        "--workload",
        prompts(300, 13),
        "--max-tokens",
        8,
        "--ignore-eos",
        "--temperature",
        0.6,
        "--inject",
        "processed-logprobs",
        "--out",
        run,
        "--json",
        "--fail-on",
        "never",
    )
    assert r.code == 0, r.err
    table = json.loads(r.out)
    own = _own_floor_thresholds(run)
    assert own.clean_abs_diff > DEFAULTS["clean_abs_diff"]  # the lie would have moved its own floor
    assert table["thresholds"]["source"] == "table" and _th(table) == DEFAULTS
    assert table["run_test"]["result"] == "different" and table["verdict"] == "systematic"
    r = lpf_cli("rescore", run, "--calibrate")
    assert r.code == 0 and "like the reference" in r.err, r.err
    r = lpf_cli("analyze", run, "--json", "--fail-on", "never")
    assert r.code == 0, r.err
    cal = json.loads(r.out)
    assert cal["thresholds"]["source"] == "calibration-run" and _th(cal) == DEFAULTS
    assert cal["counts"] == table["counts"] and cal["run_test"]["result"] == "different"
    print(
        f"processed-logprobs, {cal['n_requests']} requests: expected floor {cal['counts']} "
        f"(own floor would set clean <= {own.clean_abs_diff:.3g}); run test: {cal['run_test']['sentence']}"
    )
    assert cal["counts"]["clean"] < cal["n_requests"] // 2


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_processed_logprobs_drill_where_the_lie_is_large(prompts, tmp_path, lpf_cli):
    """(2b) the same drill on tiny:hybrid (untrained: flat distributions, so a temperature moves
    nearly every logprob by more than 0.5): the run's own floor would rise to its caps; the
    calibration run and the shipped table keep the defaults and flag (almost) every request.
    Measured: own floor 8/300 flagged, calibration run 299/300."""
    run = tmp_path / "t"
    r = lpf_cli(
        "audit",
        "--model",
        "tiny:hybrid",
        "--workload",
        prompts(300, 13),
        "--max-tokens",
        8,
        "--ignore-eos",
        "--temperature",
        0.6,
        "--inject",
        "processed-logprobs",
        "--calibrate",
        "--out",
        run,
        "--json",
        "--fail-on",
        "never",
    )
    assert r.code == 0, r.err
    cal = json.loads(r.out)
    shutil.rmtree(run / "calibration")  # the same run judged by the shipped table
    m = json.loads((run / "manifest.json").read_text())
    m.pop("calibration")
    (run / "manifest.json").write_text(json.dumps(m))
    r = lpf_cli("analyze", run, "--json", "--fail-on", "never")
    assert r.code == 0, r.err
    table = json.loads(r.out)
    flagged = lambda f: f["counts"]["divergent"] + f["counts"]["corrupt"]  # noqa: E731
    print(
        f"tiny:hybrid processed-logprobs, {cal['n_requests']} requests: table {table['counts']}; "
        f"calibration run {cal['counts']}"
    )
    assert table["thresholds"]["source"] == "table" and cal["thresholds"]["source"] == "calibration-run"
    assert _th(cal) == _th(table) == DEFAULTS and _own_floor_thresholds(run).divergent_abs_diff > 1.0
    assert flagged(cal) >= 0.95 * cal["n_requests"] and flagged(table) == flagged(cal)
