"""Measure the expected-floor table shipped as `src/lpf/analysis/floors.json`.

For every model of the zoo and the tiny set, every engine that runs it here (the built-in engine for
GraniteMoeHybrid and Jamba, vLLM's CPU build for GraniteMoeHybrid and Llama when .venv-vllm exists,
HF `generate` for Llama), and every engine dtype (float32, bfloat16, float16), one greedy `lpf audit`
of zoo:stress against the float32 reference; below float32 also with `--calibrate` (the reference at
that dtype: HF's own kernels, a second honest implementation). Each implementation's floor is
`lpf.analysis.floors.floor_stats` of its logprob errors (a calibration the reference cannot run at
that dtype, e.g. HF's Jamba scan in bfloat16 on CPU, is left out and noted); a model's row is the envelope (field by
field maximum) over its implementations, and each pair's `envelope` the maximum over the trained (zoo)
models, which is what a model outside the table gets (widened by floors.UNMEASURED_MARGIN).

    python scripts/measure_floors.py [--out runs/floors] [--requests 1000] [--max-tokens 8] [--write]

Runs already complete in --out are reused. Without --write it prints the table; with it, it rewrites
src/lpf/analysis/floors.json. Slow: ~40 audits, about an hour on a 2-core machine.
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

from lpf.adapters.vllm import vllm_python  # noqa: E402
from lpf.analysis import metrics  # noqa: E402
from lpf.analysis.floors import envelope  # noqa: E402
from lpf.analysis.token_evidence import calibration_floor, engine_floor, evidence_columns  # noqa: E402
from lpf.core.errors import LpfError  # noqa: E402

MODELS = {  # model -> engines that run it here
    "zoo:hybrid": ["builtin", "vllm"],
    "zoo:jamba": ["builtin"],
    "zoo:llama": ["hf", "vllm"],
    "tiny:hybrid": ["builtin", "vllm"],
    "tiny:hybrid-longmem": ["builtin", "vllm"],
    "tiny:jamba": ["builtin"],
    "tiny:jamba-longmem": ["builtin"],
    "tiny:llama": ["hf", "vllm"],
}
DTYPES = ("float32", "bfloat16", "float16")
FIELDS_TO_KEEP = ("token", "settled", "topk", "margin", "token_abs_diff", "n_tokens")


def audit(out: Path, model: str, engine: str, dtype: str, requests: int, max_tokens: int, workload: Path) -> Path:
    if (out / "findings.json").is_file():
        return out
    lpf = str(Path(sys.executable).with_name("lpf"))
    args = [
        lpf,
        "audit",
        "--engine",
        engine,
        "--model",
        model,
        "--dtype",
        dtype,
        "--workload",
        str(workload),
        "--max-tokens",
        str(max_tokens),
        "--out",
        str(out),
        "--fail-on",
        "never",
    ]
    if engine == "vllm":
        args += ["-E", "enable_prefix_caching=false"]
    if engine == "builtin":
        args += ["-E", "threads=1"]
    t0 = time.time()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{out}: audit failed:\n{proc.stderr[-2000:]}")
    if dtype != "float32":  # the reference at the engine's dtype: a second honest implementation
        cal = subprocess.run([lpf, "rescore", str(out), "--calibrate"], capture_output=True, text=True)
        if cal.returncode != 0:
            (out / "calibration-failed.txt").write_text(cal.stderr[-2000:])
            print(f"  {out.name}: no calibration run: {cal.stderr.strip().splitlines()[-1]}", file=sys.stderr)
    print(f"  {out.name}: {time.time() - t0:.0f} s", file=sys.stderr)
    return out


def run_floors(run: Path) -> dict[str, dict]:
    """{implementation: floor_stats} of a run: the engine's, and the calibration run's when there is one."""
    import pyarrow.parquet as pq

    tokens, reference, requests = (pq.read_table(run / t) for t in ("tokens", "reference", "requests"))
    joined, _ = metrics.join_grouped(tokens, reference)
    cols = evidence_columns(joined, tokens, reference, requests)
    out = {"engine": engine_floor(cols)}
    if list((run / "calibration").glob("*.parquet")):
        out["calibration"] = calibration_floor(cols, joined, pq.read_table(run / "calibration"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "floors")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    try:
        vllm_python()
        have_vllm = True
    except LpfError:
        have_vllm = False
    from lpf.zoo import registry

    a.out.mkdir(parents=True, exist_ok=True)
    workload = a.out / "stress.jsonl"
    items = registry.workload_items("stress", seed=17, n=a.requests)
    workload.write_text("".join(json.dumps({"id": i["id"], "prompt": i["prompt"]}) + "\n" for i in items))
    pairs: dict[str, dict] = {}
    for dtype in DTYPES:
        pair = f"{dtype}/float32"
        models = {}
        for model, engines in MODELS.items():
            impl, notes = {}, {}
            for engine in engines:
                if engine == "vllm" and not have_vllm:
                    continue
                run = audit(
                    a.out / f"{model.replace(':', '-')}-{engine}-{dtype}",
                    model,
                    engine,
                    dtype,
                    a.requests,
                    a.max_tokens,
                    workload,
                )
                for name, stats in run_floors(run).items():
                    impl[engine if name == "engine" else "hf-reference"] = stats
                if (run / "calibration-failed.txt").is_file():
                    notes["hf-reference"] = (run / "calibration-failed.txt").read_text().strip().splitlines()[-1]
            row = envelope(*impl.values())
            row["implementations"] = {k: {f: v[f] for f in FIELDS_TO_KEEP} for k, v in impl.items()}
            if notes:
                row["not_measured"] = notes
            models[model] = row
        # the envelope stands for models outside the table, which are trained models: the tiny random
        # ones (flat distributions, large init) err far more in bfloat16 and keep their own rows only
        pairs[pair] = {"envelope": envelope(*(r for m, r in models.items() if m.startswith("zoo:"))), "models": models}
    table = {
        "about": "Expected floors: how far honest implementations at an engine dtype depart from a float32 "
        "reference (lpf.analysis.floors). Measured by scripts/measure_floors.py.",
        "measured": time.strftime("%Y-%m-%d"),
        "method": f"greedy lpf audit of {a.requests} zoo:stress requests (seed 17), max_tokens {a.max_tokens}, "
        f"top-5 logprobs, per model and engine dtype, on every engine that runs the model here "
        f"(builtin, vLLM {'0.32.0 CPU' if have_vllm else 'absent'}, HF generate for Llama), plus "
        f"the reference itself at the engine dtype (--calibrate: 'hf-reference'); float32 reference",
        "pairs": pairs,
    }
    text = json.dumps(table, indent=1, sort_keys=False)
    if a.write:
        (ROOT / "src" / "lpf" / "analysis" / "floors.json").write_text(text + "\n")
        print("wrote src/lpf/analysis/floors.json", file=sys.stderr)
    for pair, entry in pairs.items():
        e = entry["envelope"]
        print(
            f"{pair}: token median {e['token']['median']:.3g} q99 {e['token']['q99']:.3g}, settled q99 "
            f"{e['settled']['q99']:.3g}, top-k median {e['topk']['median']:.3g} q99 {e['topk']['q99']:.3g}"
        )
        for model, row in entry["models"].items():
            print(
                f"    {model:20s} token q99 {row['token']['q99']:.3g}  top-k q99 {row['topk']['q99']:.3g}  "
                f"({', '.join(row['implementations'])})"
            )


if __name__ == "__main__":
    main()
