"""The reference column alone: transformers against itself on every stateful architecture it ships.

For each architecture discovery finds in the installed transformers (`discover.reference_architectures`),
or only the model types named on the command line: `reference_column.reference_column` on its tiny
checkpoint over the first 4 prompts of the matrix's 16-prompt workload, 12 greedy tokens (as
`lpf conformance --grid full` runs it, without an engine). Rows are kept in OUT/reference/<arch>.json
(a rerun reads them back). Prints one line per architecture (status, each path's max |d|) and the CPU
and wall seconds of each check.
Usage: PYTHONPATH=src .venv/bin/python scripts/reference_column.py OUT [MODEL_TYPE ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lpf.core.model_specs import ModelRef, load_tokenizer
from lpf.experiments.conformance.discover import reference_architectures
from lpf.experiments.conformance.grid import write_workload
from lpf.experiments.conformance.reference_column import reference_column
from lpf.zoo.registry import tokenizer_dir

PATHS = ("decode", "recurrent", "teacher-forced", "eager")


def line(row: dict) -> str:
    nums = [f"{p} {row['paths'][p]['max_abs']:.2g}" if p in row.get("paths", {}) else f"{p} -" for p in PATHS]
    why = row.get("departing") or row.get("error") or row.get("reason") or ""
    return f"{row['architecture']:28s} {row['status']:24s} {'  '.join(nums)}  {why}"


if __name__ == "__main__":
    out, wanted = Path(sys.argv[1]), set(sys.argv[2:])
    out.mkdir(parents=True, exist_ok=True)
    workload = out / "workload.jsonl"
    if not workload.is_file():
        tok = load_tokenizer(ModelRef("zoo tokenizer", tokenizer_dir()))
        write_workload(workload, 16, len(tok), bos=tok.bos_token_id)
    archs = [
        {"architecture": a, "model_type": mt}
        for a, mt in sorted(reference_architectures().items())
        if not wanted or mt in wanted
    ]
    for a in archs:
        wall, cpu = time.perf_counter(), time.process_time()
        (row,) = reference_column(out, [a], workload, max_tokens=12, n_prompts=4)
        print(
            f"{line(row)}  [{time.process_time() - cpu:.0f} s CPU, {time.perf_counter() - wall:.0f} s wall]", flush=True
        )
