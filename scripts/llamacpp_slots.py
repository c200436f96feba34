"""llama-server's parallel slots under cache pressure: one `lpf audit --engine llamacpp` per cell.

Workloads: `shared-prefix` (written here: 10 filler passages of ~40-120 words, each followed by 20
different zoo tasks, the passages interleaved in arrival order so consecutive requests share no
prefix and a slot's cached prefix is usually someone else's), `rollouts` (zoo:oracle's first 100
prompts, `--n 4`: identical prompts, RL-style) and zoo:stress. Cells: `-np` 1, 4 and 8 with a per-slot
context just above the longest request (768 tokens: every slot's memory is reused by every request it
serves), the host-memory prompt cache at llama.cpp's default and off (`cache_ram=0`). Prints one JSON
line per cell: verdicts, max |logprob diff|, the run-level test, and from the slot trace how many
requests reused cached prompt tokens (`timings.cache_n` > 0) and how many.
Usage: PYTHONPATH=src .venv/bin/python scripts/llamacpp_slots.py MODEL OUT_DIR [WORKLOAD ...] [--np 1,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path


def shared_prefix(path: Path, seed: int = 0) -> Path:
    from lpf.zoo import registry, tasks

    rng = random.Random(f"shared-prefix:{seed}")
    passages = [tasks.filler_text(rng, rng.randint(40, 120)) for _ in range(10)]
    items = registry.workload_items("oracle", seed=seed, n=200)
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"prefix{i % 10}-{it['id']}",
                    "prompt": passages[i % 10] + "\n" + it["prompt"],
                    "expected": it["expected"],
                }
            )
            + "\n"
            for i, it in enumerate(items)
        )
    )
    return path


def audit(model: str, workload: str, out: Path, extra: list[str]) -> dict:
    exe = Path(sys.executable).with_name("lpf")
    proc = subprocess.run(
        [
            str(exe),
            "audit",
            "--engine",
            "llamacpp",
            "--model",
            model,
            "--workload",
            workload,
            "-E",
            "threads=1",
            "--out",
            str(out),
            "--json",
            "--fail-on",
            "never",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1][:300]}
    f = json.loads(proc.stdout)
    import duckdb

    hits = (
        duckdb.connect()
        .execute(f"""SELECT count(*) FILTER (WHERE num_computed_tokens > 0), max(num_computed_tokens),
        count(DISTINCT state_slot) FROM '{out}/trace/*.parquet'""")
        .fetchone()
    )
    rt = f.get("run_test") or {}
    return {
        "verdict": f["verdict"],
        "counts": f.get("counts"),
        "errors": f.get("errors"),
        "n_requests": f["n_requests"],
        "max_abs_logprob_diff": f["metrics"]["abs_logprob_diff"]["max"],
        "run_test": rt.get("result"),
        "run_test_side": rt.get("test"),
        "requests_with_cached_prompt": hits[0],
        "max_cache_n": hits[1],
        "slots_used": hits[2],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out", type=Path)
    ap.add_argument("workloads", nargs="*", default=["shared-prefix", "rollouts", "stress"])
    ap.add_argument("--np", default="1,4,8")
    ap.add_argument("--cache-ram", default="default,0")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from lpf.zoo import registry

    oracle100 = a.out / "oracle100.jsonl"
    oracle100.write_text(
        "".join(
            json.dumps({"id": it["id"], "prompt": it["prompt"], "expected": it["expected"]}) + "\n"
            for it in registry.workload_items("oracle", seed=0, n=100)
        )
    )
    sources = {
        "shared-prefix": (str(shared_prefix(a.out / "shared-prefix.jsonl")), []),
        "rollouts": (str(oracle100), ["--n", "4"]),
        "stress": ("zoo:stress", []),
    }
    for name in a.workloads:
        workload, wargs = sources[name]
        for np_ in [int(x) for x in a.np.split(",")]:
            for ram in a.cache_ram.split(","):
                cell = f"{name}-np{np_}-cram{ram}"
                extra = [*wargs, "-E", f"parallel={np_}", "-E", f"ctx_size={np_ * 768}"]
                if ram != "default":
                    extra += ["-E", f"cache_ram={ram}"]
                print(
                    json.dumps({"model": a.model, "cell": cell, **audit(a.model, workload, a.out / cell, extra)}),
                    flush=True,
                )


if __name__ == "__main__":
    main()
