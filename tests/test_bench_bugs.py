"""`bench/bugs.py --quick`: the bug-class benchmark's smoke run (one drill, stale-conv-on-reuse, 240
requests of zoo:shared-prefix on tiny:jamba-longmem, no shrink) scores a real audit against its
ground truth: every ground-truth request flagged (the nearly-right conv states included, which the
fixed divergent threshold left `noise` before `analysis.localized`), nothing outside it, and the top
hypothesis names the mechanism."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one audit of 240 requests

ROOT = Path(__file__).resolve().parents[1]


def test_bugs_quick_scores_the_drill_against_its_ground_truth(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bugs.py"), "--quick", "--out", str(tmp_path / "runs"),
                           "--results", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())["results"]["stale-conv-on-reuse"]
    assert r["requests"] == 240 and r["truth"] > 100
    assert r["recall"] == 1.0 and r["false_positives"] == 0 and r["flagged"] == r["truth"]
    assert r["named"] and r["top_feature"] == "first_slot_used_before"
    assert 0 < r["tokens_to_first_flag"] <= 240 * 8
    assert "| stale-conv-on-reuse | 240 |" in proc.stdout
