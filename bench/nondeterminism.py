"""Benchmark: nondeterminism on trial (Cai et al., arXiv 2504.04715) -- does production-like batching make lpf cry wolf?

The same greedy requests (every prompt 4 times: `--n 4` identical rollouts) audited on honest engines under
load settings that change what each request is batched with: the built-in engine and vLLM's CPU build
(offline) with 1 or 32 sequences per step and a 16-token or a large step budget (chunked prefill), vLLM also
with prefix caching, and `lpf serve` over HTTP with 1 or 32 requests in flight (open-loop Poisson arrivals
at two rates). Per run: requests flagged (divergent or corrupt), the run-level test's result, and how often
identical requests came back with different tokens or logprobs (the nondeterminism itself: max |logprob
difference| between rollouts of one prompt). The false-alarm rate is flagged requests over all requests,
and runs the run-level test calls `different` over all runs, against the float32 floor lpf ships.
Workload: 24 zoo:oracle prompts and 24 prose prompts (contested greedy positions), 12 tokens each.
Usage: python bench/nondeterminism.py [--out runs/bench-nondeterminism] [--no-vllm] [--quick]
(writes bench/results/nondeterminism.json, prints the table; --quick: one built-in load on 4 prompts, no file)
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
LOADS = {  # name -> (engine, knobs)
    "builtin seqs=1 budget=512": ("builtin", ["--max-num-seqs", "1", "--max-num-batched-tokens", "512"]),
    "builtin seqs=32 budget=16": ("builtin", ["--max-num-seqs", "32", "--max-num-batched-tokens", "16"]),
    "builtin seqs=32 budget=512": ("builtin", ["--max-num-seqs", "32", "--max-num-batched-tokens", "512"]),
    "vllm seqs=1 budget=2048": ("vllm", ["--max-num-seqs", "1", "-E", "enable_prefix_caching=false"]),
    "vllm seqs=16 budget=16": (
        "vllm",
        [
            "--max-num-seqs",
            "16",
            "--max-num-batched-tokens",
            "16",
            "--enable-chunked-prefill",
            "-E",
            "enable_prefix_caching=false",
        ],
    ),
    "vllm seqs=16 budget=16 prefix-cache": (
        "vllm",
        [
            "--max-num-seqs",
            "16",
            "--max-num-batched-tokens",
            "16",
            "--enable-chunked-prefill",
            "-E",
            "enable_prefix_caching=true",
        ],
    ),
    "lpf serve 1 in flight": ("serve", ["-E", "concurrency=1"]),
    "lpf serve 32 in flight, 50 req/s": ("serve", ["-E", "concurrency=32", "-E", "arrival_rate=50"]),
    "lpf serve 32 in flight, 5 req/s": ("serve", ["-E", "concurrency=32", "-E", "arrival_rate=5"]),
}


def workload(path: Path, n: int = 24) -> Path:
    from lpf.zoo import registry
    from lpf.zoo.tasks import filler_text

    rng = random.Random(9)
    items = [{"id": it["id"], "prompt": it["prompt"]} for it in registry.workload_items("oracle", seed=9, n=n)]
    items += [{"id": f"prose-{i:02d}", "prompt": filler_text(rng, rng.randint(8, 20))} for i in range(n)]
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


def audit(out: Path, engine: str, knobs: list[str], prompts: Path, url: str | None) -> dict:
    if not (out / "findings.json").is_file():
        lpf = str(Path(sys.executable).with_name("lpf"))
        args = [
            lpf,
            "audit",
            "--model",
            "zoo:hybrid",
            "--workload",
            str(prompts),
            "--n",
            "4",
            "--max-tokens",
            "12",
            "--out",
            str(out),
            "--fail-on",
            "never",
            "--dtype",
            "float32",
            *knobs,
        ]
        if engine == "serve":
            args[2:2] = ["--engine", "openai", "--base-url", url]
        else:
            args[2:2] = ["--engine", engine]
        if engine == "vllm":
            args += ["-E", "max_model_len=512"]
        if engine == "builtin":
            args += ["-E", "threads=1"]
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{out}: audit failed:\n{proc.stderr[-2000:]}")
    return json.loads((out / "findings.json").read_text())


def spread(run: Path) -> dict:
    """How identical requests (rollouts of one prompt) differed: prompts whose rollouts' tokens differ, and
    the largest logprob difference between rollouts at one position."""
    import pyarrow.parquet as pq

    req = pq.read_table(run / "requests", columns=["request_id", "prompt_id", "output_token_ids"]).to_pylist()
    tok = pq.read_table(run / "tokens", columns=["request_id", "position", "engine_logprob"]).to_pylist()
    by_prompt: dict = {}
    for r in req:
        by_prompt.setdefault(r["prompt_id"], set()).add(tuple(r["output_token_ids"] or ()))
    prompt_of = {r["request_id"]: r["prompt_id"] for r in req}
    at: dict = {}
    for t in tok:
        if t["engine_logprob"] is not None:
            at.setdefault((prompt_of[t["request_id"]], t["position"]), []).append(t["engine_logprob"])
    diffs = [max(v) - min(v) for v in at.values() if len(v) > 1]
    return {
        "prompts_with_differing_tokens": sum(len(v) > 1 for v in by_prompt.values()),
        "n_prompts": len(by_prompt),
        "max_logprob_spread": float(max(diffs)) if diffs else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-nondeterminism")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    prompts = workload(a.out / "prompts.jsonl", 2 if a.quick else 24)
    rows = {}
    from lpf.serve.process import served

    loads = {k: v for k, v in LOADS.items() if v[0] == "builtin"} if a.quick else LOADS
    for name, (engine, knobs) in list(loads.items())[:1] if a.quick else loads.items():
        if engine == "vllm" and a.no_vllm:
            continue
        out = a.out / name.replace(" ", "-").replace("=", "").replace(",", "").replace("/", "")
        t0 = time.time()
        if engine == "serve":
            with served("--model", "zoo:hybrid", "--max-num-seqs", "32", env={"OMP_NUM_THREADS": "1"}) as server:
                f = audit(out, engine, knobs, prompts, server.base_url + "/v1")
        else:
            f = audit(out, engine, knobs, prompts, None)
        rt = f.get("run_test") or {}
        rows[name] = {
            "requests": f["n_requests"],
            "flagged": f["counts"]["divergent"] + f["counts"]["corrupt"],
            "verdict": f["verdict"],
            "run_test": rt.get("result"),
            "effect_size": rt.get("effect_size"),
            "topk_effect_size": rt.get("topk_effect_size"),
            "floor_sentence": rt.get("floor_sentence"),
            **spread(out),
            "seconds": round(time.time() - t0),
        }
        print(f"  {name}: {rows[name]}", file=sys.stderr)
    n_req = sum(r["requests"] for r in rows.values())
    result = {
        "measured": time.strftime("%Y-%m-%d"),
        "workload": "24 zoo:oracle + 24 prose prompts x 4 identical greedy rollouts, 12 tokens, zoo:hybrid float32",
        "runs": rows,
        "false_alarm_requests": sum(r["flagged"] for r in rows.values()) / max(n_req, 1),
        "false_alarm_runs": sum(r["run_test"] == "different" for r in rows.values()) / max(len(rows), 1),
        "floor_sentences": sum(bool(r["floor_sentence"]) for r in rows.values()),
    }
    if not a.quick:
        (ROOT / "bench" / "results").mkdir(exist_ok=True)
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        (ROOT / "bench" / "results" / "nondeterminism.json").write_text(json.dumps(stamp(result), indent=1) + "\n")
    print(
        "| load | requests | flagged | run-level test | top-k effect | prompts whose 4 identical requests differed "
        "(tokens) | max logprob spread between them |\n|---|---|---|---|---|---|---|"
    )
    for name, r in rows.items():
        eff = "-" if r["topk_effect_size"] is None else f"{r['topk_effect_size']:.2f}x"
        print(
            f"| {name} | {r['requests']} | {r['flagged']} | {r['run_test']} | {eff} | "
            f"{r['prompts_with_differing_tokens']}/{r['n_prompts']} | {r['max_logprob_spread']:.2g} |"
        )
    print(f"false alarms: {result['false_alarm_requests']:.4f} of requests, {result['false_alarm_runs']:.3f} of runs")


if __name__ == "__main__":
    main()
