"""Forensics through the real CLI: thresholds from the expected floor, shape and hypotheses in findings.json and
the terminal, `--threshold` pinning, and a bfloat16 engine that must never be called corrupt.

The drills judged against fault ground truth live in test_engine_drills.py (they share its runs).
"""

import json

import pytest

from conftest import lpf_main

pytestmark = pytest.mark.slow  # long end-to-end runs: `make test-fast` skips them


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """The built-in engine in bfloat16 against the float32 reference: 2000 requests, no fault, on
    tiny:hybrid, whose random-init distributions are not peaked enough to hide rounding (on the
    trained zoo:hybrid most tokens have p ~ 1 on both sides, where bf16 cannot move a logprob: its
    token-level floor stays at float32's; measured there: 861 clean, 1096 noise, 43 divergent, 0
    corrupt)."""
    out = tmp_path_factory.mktemp("bf16") / "run"
    proc = lpf_main(
        "audit",
        "--engine",
        "builtin",
        "--model",
        "tiny:hybrid",
        "--dtype",
        "bfloat16",
        "--workload",
        "zoo:oracle",
        "--n",
        4,
        "--max-tokens",
        8,
        "--ignore-eos",
        "--out",
        out,
        "--json",
        "--fail-on",
        "corrupt",
    )
    return out, proc


def test_bf16_engine_is_never_corrupt(bf16_run):
    out, proc = bf16_run
    assert proc.returncode == 0, proc.stderr  # --fail-on corrupt: exit 0 means nothing corrupt
    f = json.loads(proc.stdout)
    assert f["n_requests"] == 2000 and f["counts"]["corrupt"] == 0
    assert f["counts"]["noise"] > 0, "bf16 rounding is visible against a float32 reference"
    th = f["thresholds"]
    # the floor is bf16's expected one (tiny:hybrid's row of the shipped table), far above float32's
    # ~1e-6, and the thresholds rose with it; the run-level test finds the engine on that floor
    assert th["source"] == "table" and th["noise_floor"]["pair"] == "bfloat16/float32"
    assert th["noise_floor"]["token_abs_diff"]["median"] > 1e-3
    assert th["clean_abs_diff"] > 1e-3 and th["divergent_abs_diff"] > 0.5 and th["tie_margin"] > 1e-3
    assert "thresholds (from the expected floor of bfloat16/float32" in " ".join(proc.stderr.split())
    assert f["run_test"]["result"] == "same" and f["verdict"] != "systematic"


def test_analyze_reports_shape_and_hypotheses_and_pins_thresholds(bf16_run, tmp_path, lpf_cli):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(bf16_run[0], run)
    r = lpf_cli("analyze", run, "--json", "--fail-on", "never", "--threshold", "divergent_abs_diff=0.05")
    assert r.code == 0, r.err
    f = json.loads(r.out)
    th = f["thresholds"]
    assert th["divergent_abs_diff"] == 0.05 and th["pinned"] == ["divergent_abs_diff"]
    shape = f["shape"]
    assert set(shape) >= {"rate", "n_flagged", "onset", "first_divergence", "periodicity", "clusters"}
    assert shape["n_flagged"] == f["counts"]["divergent"] + f["counts"]["corrupt"] > 0
    assert shape["periodicity"]["over"] == "step"
    assert all(
        set(h)
        >= {
            "rank",
            "feature",
            "sentence",
            "flagged_with",
            "flagged_total",
            "clean_with",
            "clean_total",
            "p_value",
            "score",
        }
        for h in f["hypotheses"]
    )
    summary = json.loads((run / "findings.json").read_text())
    assert summary["thresholds"]["pinned"] == ["divergent_abs_diff"]
    import pyarrow.parquet as pq

    cols = pq.read_table(run / "summary.parquet").column_names
    assert "gibberish_score" in cols
