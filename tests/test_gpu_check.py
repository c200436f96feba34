"""scripts/gpu_check.sh's dry run (`--device cpu --small`): every step of the GPU check, small, on a CPU,
so the script a GPU machine runs cannot rot unnoticed (it once failed at its first step on every machine).

The real script in its own process with this interpreter (PYTHON=sys.executable: lpf's dependencies
present, so no install). Each step must have run and passed its own check: the stored run rescored to
the committed CPU scores, lpf against the naive forward over the same tokens, the profiles, and the five
audits through the real command line with their verdicts (float32 clean, stale-state caught and
explained, 4-bit systematic, bfloat16 built-in and HF engines without a false alarm), the engine's two
dtypes stepped and profiled. ~27 s of CPU (the steps' `cpu_s`), minutes of wall time on a loaded machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

pytestmark = pytest.mark.slow


def test_the_gpu_check_dry_run_runs_every_step(tmp_path):
    import gpu_check

    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", LPF_CACHE=str(tmp_path / "cache"))
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu", "--small", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    steps = doc["steps"]
    assert list(steps) == [name for name, *_ in gpu_check.STEPS]
    assert {s["status"] for s in steps.values()} == {"passed"}, {k: s.get("error") for k, s in steps.items()}
    c = steps["correctness"]
    assert c["tokens"] == c["stored_tokens"] > 0 and c["max_abs_logprob_diff"] <= 1e-3
    t = steps["throughput"]
    assert t["lpf"]["tokens_per_s"] > 0 and t["naive"]["tokens_per_s"] > 0 and t["flops"]["total"] > 0
    assert steps["rescore_profile"]["aten"] and steps["head"]["float32"]["seconds"] > 0
    prof = steps["rescore_profile"]
    assert prof["wall_s_unprofiled"] > 0 and prof["batches"] >= 1  # on a GPU: device_busy_fraction, host syncs
    assert steps["audit_builtin_float32"]["verdict"] == "clean"
    stale = steps["audit_stale_state"]
    assert stale["faults"] and stale["flagged"] and stale["top_hypothesis"] == "first_decode_uncomputed"
    assert steps["audit_quantize4"]["verdict"] == "systematic"
    assert steps["audit_hf_bfloat16"]["run_test"] == "same" and steps["audit_hf_bfloat16"]["counts"]["divergent"] == 0
    assert all(steps["engine_dtypes"][d]["profile"]["aten"] for d in ("float32", "bfloat16"))
    assert doc["ok"] and len(doc["summary"]) == len(steps) + 1
