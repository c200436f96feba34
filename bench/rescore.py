"""Benchmark: lpf's reference rescorer against the naive seed-workflow script, in one run.

Naive (what the seed's engineers ran first): pad the batch, one forward, full float32 logits
[batch, seq, vocab], log_softmax over all of it, gather the output positions.
lpf: `lpf.reference.Rescorer` (length-sorted batches under a token budget, hidden states projected
only at output positions, in row chunks).

Cases on a random Llama with vocab 32000 (both methods see identical inputs and must agree):
  speed         64 sequences of 16..1024 tokens, the second half of each is "output" (RL-like):
                output tokens scored per second
  speed-short   the same sequences with outputs of at most 64 tokens (audit-like: long prompts,
                short answers)
  memory        8 sequences of 2048 tokens: peak RSS above the loaded model
Each measurement runs in its own subprocess so peaks do not leak between methods.
Usage: python bench/rescore.py [--quick]   (writes bench/results/rescore.json, prints a table)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 32000
NAIVE_BATCH = 8
CASES = ("speed", "speed-short", "memory")


def build_model(path: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lpf.zoo.registry import tokenizer_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                      initializer_range=0.1, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(path)


def make_case(case: str, quick: bool) -> list[tuple[list[int], list[int]]]:
    import random

    rng = random.Random(0)
    if case.startswith("speed"):
        lengths = [rng.randint(16, 1024) for _ in range(16 if quick else 64)]
    else:
        lengths = [2048] * (4 if quick else 8)
    seqs = []
    for n in lengths:
        ids = [rng.randrange(3, VOCAB) for _ in range(n)]
        cut = n - min(64, n // 2) if case == "speed-short" else n // 2
        seqs.append((ids[:cut], ids[cut:]))
    return seqs


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(method: str, case: str, model_dir: str, quick: bool) -> dict:
    import torch

    from lpf.model_specs import ModelRef
    from lpf.reference import Rescorer, ScoreItem

    torch.set_grad_enabled(False)
    seqs = make_case(case, quick)
    rescorer = Rescorer(ModelRef("bench", Path(model_dir)), topk=5)
    model = rescorer.model
    base = rss_bytes()
    t0 = time.perf_counter()
    if method == "naive":
        out = []
        for i in range(0, len(seqs), NAIVE_BATCH):
            batch = seqs[i:i + NAIVE_BATCH]
            width = max(len(p) + len(o) for p, o in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (p, o) in enumerate(batch):
                ids[row, :len(p) + len(o)] = torch.tensor(p + o)
                mask[row, :len(p) + len(o)] = 1
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
            for row, (p, o) in enumerate(batch):
                pos = torch.arange(len(p) - 1, len(p) - 1 + len(o))
                out.append(logp[row, pos, torch.tensor(o)])
            del logp
        values = torch.cat(out)
    else:
        items = [ScoreItem(f"r{i:04d}", p, o) for i, (p, o) in enumerate(seqs)]
        tables = list(rescorer.score(items))
        by_id = {}
        for t in tables:
            for rid, lp in zip(t.column("request_id").to_pylist(), t.column("ref_logprob").to_pylist()):
                by_id.setdefault(rid, []).append(lp)
        values = torch.tensor([lp for rid in sorted(by_id) for lp in by_id[rid]])
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n_out = sum(len(o) for _, o in seqs)
    return {"method": method, "case": case, "seconds": seconds, "output_tokens": n_out,
            "tokens_per_s": n_out / seconds, "peak_extra_bytes": max(0, peak - base),
            "checksum": values.double().sum().item(), "n": int(values.numel())}


def run_worker(method, case, model_dir, quick) -> dict:
    args = [sys.executable, __file__, "--worker", method, "--case", case, "--model-dir", model_dir]
    proc = subprocess.run(args + (["--quick"] if quick else []), capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--case")
    ap.add_argument("--model-dir")
    ap.add_argument("--quick", action="store_true", help="smaller inputs (a smoke run, not the README numbers)")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.case, a.model_dir, a.quick)))
        return
    from lpf.torch_utils import quiet_transformers

    quiet_transformers()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        for case in CASES:
            for method in ("naive", "lpf"):
                r = run_worker(method, case, tmp, a.quick)
                results[f"{case}/{method}"] = r
                print(f"{case:6s} {method:5s} {r['seconds']:7.2f}s  {r['tokens_per_s']:9.0f} tok/s  "
                      f"peak +{r['peak_extra_bytes'] / 2**20:8.1f} MiB", file=sys.stderr)
    for case in CASES:
        n, o = results[f"{case}/naive"], results[f"{case}/lpf"]
        # same inputs, same model: the two must agree or the comparison means nothing
        assert n["n"] == o["n"] and abs(n["checksum"] - o["checksum"]) < 1e-3 * max(1.0, abs(n["checksum"])), (n, o)
    ratio = {c: results[f"{c}/lpf"]["tokens_per_s"] / results[f"{c}/naive"]["tokens_per_s"] for c in CASES}
    mem = results["memory/lpf"]["peak_extra_bytes"] / max(1, results["memory/naive"]["peak_extra_bytes"])
    summary = {"speedup": ratio, "memory_ratio": mem, "quick": a.quick, "results": results,
               "machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d")}
    Path(__file__).with_name("results").mkdir(exist_ok=True)
    Path(__file__).with_name("results").joinpath("rescore.json").write_text(json.dumps(summary, indent=2))
    print("| case | naive | lpf | lpf / naive | target |")
    print("|---|---|---|---|---|")
    for c, label in (("speed", "outputs = second half of each sequence"), ("speed-short", "outputs <= 64 tokens")):
        n, o = results[f"{c}/naive"], results[f"{c}/lpf"]
        print(f"| speed, output tokens/s: {len(make_case(c, a.quick))} seqs of 16..1024 tokens, {label} | "
              f"{n['tokens_per_s']:.0f} | {o['tokens_per_s']:.0f} | {ratio[c]:.1f}x | >= 3x |")
    mn, ml = results["memory/naive"], results["memory/lpf"]
    print(f"| memory, peak RSS above the model: {len(make_case('memory', a.quick))} seqs of 2048 tokens | "
          f"{mn['peak_extra_bytes'] / 2**20:.0f} MiB | {ml['peak_extra_bytes'] / 2**20:.0f} MiB | {mem:.3f} | <= 0.125 |")


if __name__ == "__main__":
    main()
