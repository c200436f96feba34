"""Measure how far honest implementations outside the reference's own arithmetic depart from the floor.

The shipped floors (`src/lpf/analysis/floors.json`, scripts/measure_floors.py) were measured where engine
and reference mostly run the same torch kernels: the built-in engine's float32 median error is exactly 0.
An honest engine with other kernels (llama.cpp's ggml, another BLAS, other thread counts, flash
attention, a GPU GEMM) departs from that floor by construction, and the run-level test must call that
"other honest arithmetic", not "another model". This script audits the same model honestly on such
engines and writes, per dtype pair and model, the largest departure each showed (`departure.departure`:
per component, the run's 99th percentile over the row's) into the table's `honest` blocks; the run-level
test then needs HONEST_MARGIN times that before it says `different` (`departure.departure_needed`).

    python scripts/measure_honest.py [--out runs/honest] [--requests 400] [--only NAME,...] [--write]

Each configuration is one greedy `lpf audit` (max_tokens 8, top-5 logprobs, float32 reference) of
zoo:stress (seed 17) and of zoo:shared-prefix's long shared prompts; runs complete in --out are reused.
Engines missing here (no .llamacpp, no .venv-vllm) are skipped and said. Without --write it prints the
table of departures; with it, it adds the `honest` blocks to floors.json (the floors themselves unchanged).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lpf.analysis import metrics  # noqa: E402
from lpf.analysis.departure import COMPONENTS, departure, departure_units  # noqa: E402
from lpf.analysis.floors import expected_floor  # noqa: E402
from lpf.analysis.token_evidence import evidence_columns, sensitivity, topk_spread  # noqa: E402

FLOORS = ROOT / "src" / "lpf" / "analysis" / "floors.json"
# name -> (engine, knobs): honest implementations of the float32 model that are not the reference's kernels
CONFIGS = {
    "llamacpp": ("llamacpp", ["-E", "parallel=8"]),  # llama.cpp's f32 kernels, flash attention off (lpf's default)
    "llamacpp[fa]": ("llamacpp", ["-E", "parallel=8", "-E", "flash_attn=on"]),  # flash attention (f16 K/V inside)
    "builtin[threads=2]": ("builtin", ["-E", "threads=2"]),  # another intra-op split of the same GEMMs
    "vllm": ("vllm", ["-E", "enable_prefix_caching=false"]),
    "hf": ("hf", []),  # HF generate: batched, padded, KV-cached, against one teacher-forced pass
}
MODELS = {"zoo:jamba": ["llamacpp", "llamacpp[fa]", "builtin[threads=2]"], "zoo:hybrid": list(CONFIGS)}
WORKLOADS = ("stress", "shared-prefix")


def _workload(out: Path, name: str, n: int) -> Path:
    from lpf.zoo import registry

    path = out / f"{name}.jsonl"
    if not path.is_file():
        items = registry.workload_items(name, seed=17)[:n]
        path.write_text("".join(json.dumps({"id": i["id"], "prompt": i["prompt"]}) + "\n" for i in items))
    return path


def audit(out: Path, model: str, config: str, workload: Path) -> Path | None:
    if (out / "findings.json").is_file():
        return out
    engine, knobs = CONFIGS[config]
    lpf = str(Path(sys.executable).with_name("lpf"))
    args = [lpf, "audit", "--engine", engine, "--model", model, "--dtype", "float32", "--workload", str(workload)]
    args += ["--max-tokens", "8", "--out", str(out), "--fail-on", "never", *knobs]
    t0 = time.time()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {out.name}: skipped ({(proc.stderr.strip().splitlines() or ['?'])[-1]})", file=sys.stderr)
        return None
    print(f"  {out.name}: {time.time() - t0:.0f} s", file=sys.stderr)
    return out


def run_departure(run: Path, table: dict, model: str) -> dict:
    """The run's departure per component from the table's float32/float32 row for `model`."""
    import pyarrow.parquet as pq

    tokens, reference, requests = (pq.read_table(run / t) for t in ("tokens", "reference", "requests"))
    joined, _ = metrics.join_grouped(tokens, reference)
    cols = evidence_columns(joined, tokens, reference, requests)
    floor = expected_floor(_without_honest(table), "float32", "float32", model)
    s = sensitivity(cols["ref_logprob"], cols["token_id"], cols["ref_topk_ids"], cols["ref_topk_logprobs"])
    w = None
    if "engine_topk_ids" in cols:
        spread = topk_spread(
            cols["engine_topk_ids"], cols["engine_topk_logprobs"], cols["ref_topk_ids"], cols["ref_topk_logprobs"]
        )
        w = spread["w"][spread["shared"] >= 2]
    seen = departure(cols["engine_logprob"] - cols["ref_logprob"], s, w, departure_units(floor), cols.get("no_logprob"))
    return {**seen, "n_tokens": int(len(s))}


def _without_honest(table: dict) -> dict:
    out = json.loads(json.dumps(table))
    for entry in out["pairs"].values():
        entry.get("envelope", {}).pop("honest", None)
        for row in entry.get("models", {}).values():
            row.pop("honest", None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "honest")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    table = json.loads(FLOORS.read_text())
    only = set(filter(None, a.only.split(",")))
    pair = table["pairs"]["float32/float32"]
    measured: dict[str, dict] = {}
    for model, configs in MODELS.items():
        for config in configs:
            if only and config not in only:
                continue
            for wl in WORKLOADS:
                workload = _workload(a.out, wl, a.requests)
                name = f"{model.replace(':', '-')}-{config}-{wl}".replace("[", "_").replace("]", "").replace("=", "")
                run = audit(a.out / name, model, config, workload)
                if run is not None:
                    measured.setdefault(model, {})[f"{config}@{wl}"] = run_departure(run, table, model)
    for model, runs in measured.items():
        row = pair["models"][model]
        kept = {**(row.get("honest") or {}).get("implementations", {}), **runs}
        row["honest"] = {
            c: max((r[c] for r in kept.values() if r.get(c) is not None), default=None) for c in COMPONENTS
        }
        row["honest"]["implementations"] = kept
    zoo = [r["honest"] for m, r in pair["models"].items() if m.startswith("zoo:") and r.get("honest")]
    pair["envelope"]["honest"] = {c: max((h[c] for h in zoo if h.get(c) is not None), default=None) for c in COMPONENTS}
    table["honest_method"] = (
        f"scripts/measure_honest.py, {time.strftime('%Y-%m-%d')}: greedy lpf audit (max_tokens 8, top-5) of "
        f"{a.requests} zoo:stress and zoo:shared-prefix prompts (seed 17) on honest float32 engines outside "
        "the reference's kernels (llama.cpp with flash attention off and on, 8 slots; the built-in engine on 2 "
        "threads; vLLM's CPU build; HF generate); per component the largest departure (the run's 99th "
        "percentile over the row's)"
    )
    for model, runs in measured.items():
        for name, r in runs.items():
            parts = ", ".join(f"{c} {r[c]:.3g}x" for c in COMPONENTS if r.get(c) is not None)
            print(f"{model:12s} {name:36s} {parts}  ({r['n_tokens']} tokens)")
    print(f"envelope honest: {pair['envelope']['honest']}")
    if a.write:
        FLOORS.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {FLOORS.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
