"""Benchmark: speculative decoding's wall-clock speed-up where a decode step is memory-bound.

bench/engine.py --only spec measures speculation on the zoo's models, whose decode steps on this CPU cost
what their arithmetic and Python cost: a verify step of 1 + K positions then costs more than the step it
saves (issue 43: no wall-clock speed-up there). Speculation pays where a step costs what reading the
weights costs: one sequence at a time on a model too big for the caches. This bench makes one without
changing what it computes: zoo:hybrid (trained: it copies and recalls, so n-gram drafts get accepted) with
its shared MLPs padded to --units units per layer, the new units inert (zero weights; the outputs are
zoo:hybrid's token for token), saved under --out. It runs the built-in engine one sequence at a time on
zoo:oracle (greedy, 24 tokens) without speculation and with -E speculative=ngram:K, interleaved repeats,
and reports per arm: drafted and accepted tokens, engine steps, the in-engine window (median, best) and
its ratio to no speculation, and whether every request's tokens equal the run without speculation.

Usage: python bench/spec_speed.py [--requests N] [--repeats R] [--units U] [--k K] [--out DIR] [--quick]
       (writes bench/results/spec_speed.json; --quick: 2 requests, 1 repeat, no results file)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from engine import in_engine_window, spec_counts  # noqa: E402


def build(out: Path, units: int) -> Path:
    """zoo:hybrid with its shared MLPs padded to UNITS units, the new ones inert (zero weights in and out:
    gate 0 and up 0 give 0, and nothing reads them): the same function, token for token, and a decode step
    that reads UNITS x 3 x 128 weights per layer."""
    import torch
    from safetensors.torch import load_file, save_file

    from lpf.core.model_specs import resolve_model

    src = resolve_model("zoo:hybrid").path
    path = out / f"hybrid-mlp{units}"
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, path / f.name)
    cfg = json.loads((src / "config.json").read_text())
    old = cfg["shared_intermediate_size"]
    cfg["shared_intermediate_size"] = units
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(f))
    for name, w in list(weights.items()):
        if name.endswith("shared_mlp.input_linear.weight"):  # [2 x old, H]: gate rows, then up rows
            new = torch.zeros(2 * units, w.shape[1], dtype=w.dtype)
            new[:old], new[units : units + old] = w[:old], w[old:]
            weights[name] = new
        elif name.endswith("shared_mlp.output_linear.weight"):  # [H, old]
            new = torch.zeros(w.shape[0], units, dtype=w.dtype)
            new[:, :old] = w
            weights[name] = new
    save_file(weights, path / "model.safetensors")
    return path


def measure(model: Path | str, tag: str, a, workload: Path, knobs: list[str]) -> dict:
    """Per arm (no speculation, ngram:K), interleaved repeats: the in-engine windows, and from the first
    repeat the engine steps, drafted and accepted tokens and the outputs."""

    exe = Path(sys.executable).with_name("lpf")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    arms = {"off": [], f"ngram:{a.k}": ["-E", f"speculative=ngram:{a.k}"]}
    rows: dict[str, dict] = {arm: {"window_s": []} for arm in arms}
    for rep in range(a.repeats):
        for arm, extra in arms.items():
            out = a.out / f"{tag}-{arm.replace(':', '')}-{rep}"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(
                [str(exe), "run", "--engine", "builtin", "--model", str(model), "--workload", str(workload)]
                + ["--out", str(out), *knobs, *extra],
                check=True,
                capture_output=True,
                text=True,
                env=env,
            )
            rows[arm]["window_s"].append(in_engine_window(out))
            if rep == 0:
                rows[arm].update(spec_counts(out))
            print(f"{tag} {arm} repeat {rep}: window {rows[arm]['window_s'][-1]:.2f} s", flush=True)
    plain = rows["off"]["outputs"]
    for r in rows.values():
        r["median_window_s"] = statistics.median(r["window_s"])
        r["window_ratio_vs_off"] = r["median_window_s"] / rows["off"]["median_window_s"]
        r["best_window_ratio_vs_off"] = min(r["window_s"]) / min(rows["off"]["window_s"])
        r["steps_ratio_vs_off"] = r["engine_steps"] / rows["off"]["engine_steps"]
        r["identical_greedy_outputs"] = sum(x == y for x, y in zip(plain, r["outputs"]))
        r["output_tokens"] = sum(len(o) for o in r["outputs"])
        if r.get("drafted"):
            r["acceptance_rate"] = r["accepted"] / r["drafted"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--units", type=int, default=32768, help="the padded model's shared MLP units per layer")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-spec-speed")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "spec_speed.json")
    ap.add_argument("--quick", action="store_true", help="2 requests, one repeat, 1,024 units; no results file")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.repeats, a.units = 2, 1, 1024
    from lpf.zoo import registry

    a.out.mkdir(parents=True, exist_ok=True)
    workload = a.out / "oracle.jsonl"
    items = registry.workload_items("oracle", seed=0, n=a.requests)
    workload.write_text("".join(json.dumps(i) + "\n" for i in items))
    knobs = ["--max-num-seqs", "1", "--max-tokens", "24"]
    models = {"zoo:hybrid": "zoo:hybrid", f"zoo:hybrid, MLP padded to {a.units}": build(a.out, a.units)}
    runs = {}
    for i, (name, model) in enumerate(models.items()):
        runs[name] = {"arms": measure(model, f"m{i}", a, workload, knobs)}
    # the padding changes nothing the model computes: the same tokens as zoo:hybrid's
    outputs = [r["arms"]["off"]["outputs"] for r in runs.values()]
    same = sum(x == y for x, y in zip(*outputs))
    for r in runs.values():
        for arm in r["arms"].values():
            arm.pop("outputs")
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "workload": "zoo:oracle",
        "requests": a.requests,
        "knobs": knobs,
        "repeats": a.repeats,
        "padded_units": a.units,
        "padded_identical_to_zoo_hybrid": same,
        "models": runs,
        "load_average": os.getloadavg(),
    }
    if not a.quick:
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        a.results.write_text(json.dumps(stamp(doc), indent=1))
    print(f"padded model vs zoo:hybrid: {same}/{a.requests} requests with the same tokens")
    for name, r in runs.items():
        for arm, x in r["arms"].items():
            print(
                f"{name} {arm}: drafted {x.get('drafted', 0)}, accepted {x.get('accepted', 0)}, "
                f"steps {x['engine_steps']}, window {x['median_window_s']:.2f} s ({x['window_ratio_vs_off']:.2f}x, "
                f"best {x['best_window_ratio_vs_off']:.2f}x), identical {x['identical_greedy_outputs']}/{a.requests}"
            )


if __name__ == "__main__":
    main()
