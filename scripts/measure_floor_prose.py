"""Widen the shipped bfloat16 floor of zoo:hybrid to prose: the traffic `lpf watch` sees.

`scripts/measure_floors.py` measures the bfloat16/float32 row on zoo:stress (the zoo's trained tasks, 8
tokens). Greedy prose continuations (zoo filler text, which the model was not trained on: flatter
distributions) from an honest bfloat16 engine showed 2.6x that row's top-k spread and 2.5x its settled
rounding (bench/watch_detection.py's clean bfloat16 traffic, 31,376 tokens: `lpf analyze` of the recording
called it `different`, and one window of 64 tokens alarmed). This script audits zoo:hybrid in bfloat16 on
prose prompts (a seed other than the benchmark's: the floor is not fitted to the run it is checked on) on
the built-in engine, the reference itself at bfloat16 (`--calibrate`: HF's kernels) and, with --vllm, vLLM's
CPU build, and folds their floors into floors.json's bfloat16/float32 row of zoo:hybrid (implementations
named `ENGINE[proseN]`, N the tokens per continuation; the rows of other lengths stay), its envelope and
the pair's envelope; `settings` in floors.json says what the row covers. Each audit's per-request verdict counts are printed (the divergent rate an honest engine shows).

    python scripts/measure_floor_prose.py [--out runs/floor-prose] [--prompts 400] [--max-tokens 16] [--vllm]
        [--write]

Session 16 measured it at --max-tokens 64 --vllm: longer continuations drift into loops, where an honest
bfloat16 engine moves a contested top-2 margin by up to 3 nats (vLLM) and the 16-token row's tie margin
(1.11) called one honest vLLM request of 300 `divergent`.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from measure_floors import FIELDS_TO_KEEP, run_floors  # noqa: E402

from lpf.analysis.floors import envelope  # noqa: E402

MODEL, DTYPE, SEED = "zoo:hybrid", "bfloat16", 7
PAIR = f"{DTYPE}/float32"


def workload(path: Path, n: int) -> Path:
    from lpf.zoo.tasks import filler_text

    rng = random.Random(SEED)  # as bench/watch_detection.py builds its prompts, on another seed
    path.write_text(
        "".join(
            json.dumps({"id": f"prose-{i}", "prompt": filler_text(rng, rng.randint(8, 20))}) + "\n" for i in range(n)
        )
    )
    return path


def audit(out: Path, engine: str, prompts: Path, max_tokens: int) -> Path:
    if (out / "findings.json").is_file():
        return out
    lpf = str(Path(sys.executable).with_name("lpf"))
    args = [lpf, "audit", "--engine", engine, "--model", MODEL, "--dtype", DTYPE, "--workload", str(prompts)]
    args += ["--max-tokens", str(max_tokens), "--ignore-eos", "--out", str(out), "--fail-on", "never"]
    args += (
        ["-E", "enable_prefix_caching=false", "-E", "max_model_len=512"] if engine == "vllm" else ["-E", "threads=1"]
    )
    if engine == "vllm":  # vLLM never overlaps another heavy run on this machine
        args = ["flock", "/tmp/lpf-heavy.lock", *args]
    # the reference at bfloat16 (a second honest implementation) once, on the built-in engine's outputs
    for cmd in [args] + ([[lpf, "rescore", str(out), "--calibrate"]] if engine == "builtin" else []):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{out}: {cmd[1]} failed:\n{proc.stderr[-2000:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "floor-prose")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    prompts = workload(a.out / "prose.jsonl", a.prompts)
    path = ROOT / "src" / "lpf" / "analysis" / "floors.json"
    table = json.loads(path.read_text())
    pair = table["pairs"][PAIR]
    row = pair["models"][MODEL]
    impl = dict(row["implementations"])
    for engine in ["builtin"] + (["vllm"] if a.vllm else []):
        run = audit(a.out / f"{engine}-{DTYPE}-{a.max_tokens}", engine, prompts, a.max_tokens)
        counts = json.loads((run / "findings.json").read_text()).get("counts")
        for name, stats in run_floors(run).items():
            label = f"{engine if name == 'engine' else 'hf-reference'}[prose{a.max_tokens}]"
            impl[label] = {f: stats[f] for f in FIELDS_TO_KEEP}
            print(
                f"{label}: token q99 {stats['token']['q99']:.3g}  top-k q99 {stats['topk']['q99']:.3g}  "
                f"settled q99 {stats['settled']['q99']:.3g}  ({stats['n_tokens']} tokens)"
            )
        print(f"{engine}: verdicts against the old row {counts}")
    new_row = envelope(*impl.values())
    new_row["implementations"] = impl
    for k in ("not_measured", "honest"):
        if k in row:
            new_row[k] = row[k]
    pair["models"][MODEL] = new_row
    pair["envelope"] = envelope(*(r for m, r in pair["models"].items() if m.startswith("zoo:")))
    lengths = {}  # tokens per continuation -> the implementations measured at it
    for label in impl:
        if "[prose" in label:
            lengths.setdefault(int(label.split("[prose")[1].rstrip("]")), []).append(label.split("[")[0])
    table.setdefault("settings", {})[PAIR] = {
        MODEL: f"zoo:stress (seed 17) and {a.prompts} greedy prose continuations (zoo filler text, seed {SEED}) of "
        + " and ".join(f"{n} tokens on {', '.join(e)}" for n, e in sorted(lengths.items()))
    }
    print(
        f"{MODEL} {PAIR} row: top-k q99 {row['topk']['q99']:.3g} -> {new_row['topk']['q99']:.3g}; token q99 "
        f"{row['token']['q99']:.3g} -> {new_row['token']['q99']:.3g}; settled q99 {row['settled']['q99']:.3g} -> "
        f"{new_row['settled']['q99']:.3g}; margin q99 {row['margin']['q99']:.3g} -> {new_row['margin']['q99']:.3g}"
    )
    if a.write:
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
