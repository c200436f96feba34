"""Widen the shipped `float32/float32 kv=float16` floor over chat-template prompts and llama.cpp's f16 KV cache.

scripts/measure_floor_config.py measures that row on llama-server with flash attention on an f32 KV cache (its
f16 copy of K and V), on zoo:stress through /completion: the zoo models on their own tasks, sure of most tokens.
llama-cpp-python's server as it ships (an f16 KV cache, no flash attention: K and V stored in f16, and ggml's
f16 matrix products round Q and the attention weights to f16 as well) audited on the chat route (the zoo
models' chat template takes them off their tasks: flatter distributions, longer answers) departed from that row
by 1.9x (zoo:stress) and 3.1x (zoo:shared-prefix) on zoo:hybrid, and the run-level test called the second
`different`. Re-evaluating the same tokens with the same llama.cpp build showed the whole departure is the f16
rounding: with an f32 KV cache the server's arithmetic sits at float32's floor (max |d| 2.2e-5 against 0.018),
and flash attention's f16 copy of an f32 cache, the row's own configuration, departs as much on these prompts
(docs/real-engines.md). So the row was measured over too narrow a set of prompts, not a fault.

This script folds into the row, per model, the floors of llama-cpp-python 0.3.36's server (`make
llamacpp-python`) audited on prompts other than the ones the matrix runs use (zoo:stress's generator at seed 5,
written to a JSONL file; the zoo workload itself is seed 0): its default f16 KV cache on the completions and
chat routes, and `--flash_attn true --type_k 0 --type_v 0` (the row's own configuration) on chat; the rows'
implementations are named, the envelope and `settings` say what the row covers. The held-out check is the
matrix's runs (zoo:stress and zoo:shared-prefix, both routes) judged against the widened row.

    python scripts/measure_floor_chat.py RUNS_DIR [--held-out DIR ...] [--write]

RUNS_DIR holds `{default,fa32}-MODEL-{chat,completions}-stress5/` audits (lpf audit --engine openai --base-url
... --model zoo:MODEL --workload stress-seed5.jsonl --limit 300 --max-tokens 32 --api API; --held-out: runs named
MODEL-API-WORKLOAD/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from measure_floor_config import columns, held_out  # noqa: E402
from measure_floors import FIELDS_TO_KEEP  # noqa: E402

from lpf.analysis.floors import envelope  # noqa: E402
from lpf.analysis.token_evidence import engine_floor  # noqa: E402

PAIR = "float32/float32 kv=float16"
MODELS = ("zoo:jamba", "zoo:hybrid")
CONFIGURATION = {"kv": "float16", "why": "an f16 KV copy"}
# run directory prefix -> (routes, the implementation's name in the row)
RUNS = {
    "default": (("completions", "chat"), "llama-cpp-python 0.3.36 server, f16 KV cache, no flash attention"),
    "fa32": (("chat",), "llama-cpp-python 0.3.36 server, flash attention on an f32 KV cache"),
}
OLD = "llama-server -fa on -ctk f32 -ctv f32 -np 8 [zoo:stress completions]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path)
    ap.add_argument("--held-out", type=Path, nargs="*", default=[])
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    path = ROOT / "src" / "lpf" / "analysis" / "floors.json"
    table = json.loads(path.read_text())
    entry = table["pairs"][PAIR]
    for model in MODELS:
        row = entry["models"][model]
        impl = dict(row.get("implementations") or {OLD: {f: row[f] for f in FIELDS_TO_KEEP if f in row}})
        name = model.removeprefix("zoo:")
        for prefix, (routes, how) in RUNS.items():
            for route in routes:
                run = a.runs / f"{prefix}-{name}-{route}-stress5"
                if not (run / "findings.json").is_file():
                    raise SystemExit(f"{run}: no finished audit")
                stats = engine_floor(columns(run))
                impl[f"{how} [zoo:stress seed 5 {route}]"] = {f: stats[f] for f in FIELDS_TO_KEEP}
                print(
                    f"{model} {prefix} {route}: token q99 {stats['token']['q99']:.3g}  top-k q99 "
                    f"{stats['topk']['q99']:.3g}  margin q99 {stats['margin']['q99']:.3g}  ({stats['n_tokens']} tokens)"
                )
        new = envelope(*impl.values())
        new["implementations"] = impl
        new["n_tokens"] = sum(v["n_tokens"] for v in impl.values())
        print(
            f"{model} {PAIR}: token q99 {row['token']['q99']:.3g} -> {new['token']['q99']:.3g}; top-k q99 "
            f"{row['topk']['q99']:.3g} -> {new['topk']['q99']:.3g}; margin q99 {row['margin']['q99']:.3g} -> "
            f"{new['margin']['q99']:.3g}"
        )
        entry["models"][model] = new
    entry["envelope"] = envelope(*entry["models"].values())
    covered = (
        "zoo:stress (seed 17) through llama-server's /completion with flash attention on an f32 KV cache, and 300 "
        "zoo:stress prompts of seed 5 through llama-cpp-python's server (its f16 KV cache on completions and chat, "
        "flash attention on an f32 KV cache on chat: the zoo chat template's off-task answers)"
    )
    table.setdefault("settings", {})[PAIR] = {model: covered for model in MODELS}
    table["configurations"][PAIR] = (
        "llama.cpp computing attention over f16 K and V: llama-server (lpf's managed build, llama-cpp-python 0.3.36's "
        "llama.cpp) with flash attention on a float32 KV cache (-fa on -ctk f32 -ctv f32 -np 8: its f16 copy), "
        "measured by scripts/measure_floor_config.py on zoo:stress; widened by scripts/measure_floor_chat.py over "
        "llama-cpp-python's server with its default f16 KV cache (no flash attention) and with flash attention on an "
        "f32 KV cache, completions and chat, 300 zoo:stress prompts of seed 5"
    )
    for run in a.held_out:
        model = "zoo:" + run.name.split("-")[0]
        seen = held_out(columns(run), table, model, PAIR, CONFIGURATION)
        print(f"held out {run.name}: departure { ({k: v and round(v, 2) for k, v in seen.items()}) }")
    if a.write:
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
