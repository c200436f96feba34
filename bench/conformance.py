"""Benchmark: the cost of one conformance cell, run the way `lpf sweep` runs cells (one `lpf audit`
process each, a fresh vLLM process each) against the way `lpf conformance` runs them (in one process,
one kept vLLM worker per architecture that rebuilds `vllm.LLM` per cell), in the same run.

Same cells both ways: GraniteMoeHybrid's tiny checkpoint, the conformance workload (16 prompts,
144-172 tokens), the cells fp32, fp32-chunk16, fp32-seqs1 (prompt logprobs on, rescored, analysed,
report written). Wall time per cell, and the ratio. Needs vLLM's venv (`make vllm`).
`--quick` is the smoke run `make test` does (nothing timed is asserted, no results file): the fp32
cell alone on 4 prompts, both ways.
Usage: python bench/conformance.py [--quick]   (writes bench/results/conformance.json)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CELLS = ("fp32", "fp32-chunk16", "fp32-seqs1")


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="the fp32 cell alone, 4 prompts, no results file (a smoke run)"
    )
    quick = ap.parse_args().quick
    from lpf.adapters.vllm import vllm_python
    from lpf.experiments.conformance.grid import PROMPTS, grid_cells, write_workload
    from lpf.experiments.conformance.tiny import build_tiny
    from lpf.core.errors import LpfError

    try:
        vllm_python()
    except LpfError as e:
        print(f"skipped: {e}")
        return 0
    names = CELLS[:1] if quick else CELLS
    model = build_tiny("granitemoehybrid")
    cells = [c for c in grid_cells("full") if c.name in names]
    root = Path(tempfile.mkdtemp(prefix="lpf-bench-conf-"))
    try:
        from lpf.core.model_specs import ModelRef, load_tokenizer
        from lpf.zoo.registry import tokenizer_dir

        tok = load_tokenizer(ModelRef("zoo tokenizer", tokenizer_dir()))  # the workload lpf conformance writes
        n_prompts = 4 if quick else PROMPTS["full"]
        wl = write_workload(root / "workload.jsonl", n_prompts, len(tok), bos=tok.bos_token_id)
        exe = Path(sys.executable).with_name("lpf")
        common = [
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--workload",
            str(wl),
            "--prompt-logprobs",
            "--max-tokens",
            "12",
            "-E",
            "max_model_len=512",
            "-E",
            "enable_prefix_caching=false",
            "--fail-on",
            "never",
        ]
        t0 = time.perf_counter()
        for c in cells:  # the baseline: one process per cell, as lpf sweep runs them
            subprocess.run(
                [str(exe), "audit", *common, *c.args, "--out", str(root / "sub" / c.name)],
                check=True,
                capture_output=True,
                text=True,
            )
        per_process = (time.perf_counter() - t0) / len(cells)
        t0 = time.perf_counter()
        subprocess.run(
            [
                str(exe),
                "conformance",
                "--engine",
                "vllm",
                "--arch",
                "GraniteMoeHybrid",
                *[a for c in cells for a in ("--cell", c.name)],
                "--prompts",  # the baseline's workload size (lpf conformance's own default is 8)
                str(n_prompts),
                "--out",
                str(root / "conf"),
                "--fail-on",
                "never",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        # the conformance command also asks vLLM's registry (~15 s) and builds nothing new: count it in, honestly
        in_process = (time.perf_counter() - t0) / len(cells)
        doc = {
            "date": time.strftime("%Y-%m-%d"),
            "cells": list(names),
            "model": "conformance tiny granitemoehybrid",
            "seconds_per_cell": {
                "lpf audit per cell (sweep's way)": round(per_process, 1),
                "lpf conformance (in-process, kept worker)": round(in_process, 1),
            },
            "ratio": round(per_process / in_process, 2),
        }
        if not quick:
            out = Path(__file__).with_name("results") / "conformance.json"
            from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

            out.write_text(json.dumps(stamp(doc), indent=2) + "\n")
        print(json.dumps(doc, indent=2))
        print(
            f"conformance cell: {per_process:.1f} s one process per cell, {in_process:.1f} s in-process: "
            f"{doc['ratio']:.2f}x"
        )
    finally:  # the runs are measured, not kept (~15 MB each time)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
