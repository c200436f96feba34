"""Which architectures llama.cpp's converter and llama-server accept: every recipe of lpf.experiments.conformance.tiny.

For each model type: the tiny checkpoint (its default config, sizes scaled down), `lpf audit --engine
llamacpp` on it (llama.cpp's converter to an f32 GGUF, then llama-server -np 2) over 16 zoo:oracle
prompts, 8 greedy tokens. Prints one JSON line per architecture: where it stopped (convert, load, run)
with the tool's own last line, or the audit's verdict, max |logprob diff| and the run-level test.
Usage: PYTHONPATH=src .venv/bin/python scripts/llamacpp_architectures.py [MODEL_TYPE ...] (needs `make llamacpp`)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def audit(model_dir: Path, workload: Path, out: Path) -> dict:
    exe = Path(sys.executable).with_name("lpf")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            str(exe),
            "audit",
            "--engine",
            "llamacpp",
            "--model",
            str(model_dir),
            "--workload",
            str(workload),
            "--max-tokens",
            "8",
            "-E",
            "parallel=2",
            "-E",
            "threads=1",
            "--out",
            str(out),
            "--json",
            "--fail-on",
            "never",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        line = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.startswith("error:")), proc.stderr[-300:])
        stage = "convert" if "converter" in line else "load" if "before it was ready" in line else "run"
        return {"stage": stage, "error": line.removeprefix("error: ")[:400]}
    f = json.loads(proc.stdout)
    rt = f.get("run_test") or {}
    return {
        "stage": "ran",
        "verdict": f["verdict"],
        "counts": f.get("counts"),
        "errors": f.get("errors"),
        "max_abs_logprob_diff": f["metrics"]["abs_logprob_diff"]["max"],
        "run_test": rt.get("result"),
        "effect_size": rt.get("effect_size"),
    }


def main() -> None:
    from lpf.experiments.conformance.tiny import build_tiny, known_model_types

    from lpf.zoo import registry

    types = sys.argv[1:] or known_model_types()
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "oracle16.jsonl"
        workload.write_text(
            "".join(
                json.dumps({"id": it["id"], "prompt": it["prompt"]}) + "\n"
                for it in registry.workload_items("oracle", seed=0, n=16)
            )
        )
        for mt in types:
            row = {"model_type": mt}
            try:
                row.update(audit(build_tiny(mt), workload, Path(tmp) / mt))
            except Exception as e:  # a recipe transformers cannot build here: say so, go on
                row.update(stage="build", error=f"{type(e).__name__}: {e}"[:300])
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
