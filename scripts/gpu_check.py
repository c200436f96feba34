"""The reference rescorer on a GPU, checked in one short run (what `scripts/gpu_check.sh` runs).

Made for a bare GPU machine whose Python has torch, transformers, pyarrow and numpy only (no vLLM,
duckdb, plotly; no network, no stored weights beyond the repository's):

1. Correctness: `tests/data/gpu-check-run` (64 zoo:stress requests of the built-in engine on
   zoo:hybrid, its reference scored on a CPU and committed) is rescored by the rescore stage with
   `--reference-device cuda` in float32, and compared with the stored CPU scores: every token
   scored once, max |delta ref_logprob|, top-1 and rank agreement. Fails above 1e-3.
2. Throughput: a random Llama of Llama-3.2-1B's shape (hidden 2048, 16 layers, vocab 128256,
   1.24B parameters) built from its config in bfloat16, on the RL-like mix (sequences of 128..2048
   tokens, the second half of each is output): `Rescorer` (bf16 weights, float32 head) against a
   plain HF forward of the same batches order (pad 8 sequences, `model(...).logits.float()`,
   log_softmax, gather), output tokens/s, the ratio, and each one's peak GPU memory.

Usage: python scripts/gpu_check.py [--device cuda] [--small]   (--device cpu --small: a dry run of
the same code on a CPU). Prints a summary, writes $OUT/gpu_check.json when OUT is set; exit 1 on a
failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from rescore import naive_logprobs  # noqa: E402 - the naive baseline bench/rescore.py measures against

STORED = REPO / "tests" / "data" / "gpu-check-run"
KEY = [("request_id", "ascending"), ("position", "ascending")]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def correctness(device: str, tmp: Path) -> dict:
    from lpf.pipeline.rescore import RescoreSettings, rescore_run
    from lpf.run.store import RunDir

    run_dir = tmp / "run"
    shutil.copytree(STORED, run_dir, ignore=shutil.ignore_patterns("reference", "calibration"))
    t0 = time.perf_counter()
    rescore_run(RunDir.open(run_dir), settings=RescoreSettings(device=device))
    seconds = time.perf_counter() - t0
    cpu = pq.read_table(STORED / "reference").sort_by(KEY)
    gpu = pq.read_table(run_dir / "reference").sort_by(KEY)
    same_keys = cpu.select(["request_id", "position"]).equals(gpu.select(["request_id", "position"]))
    out = {"tokens": gpu.num_rows, "stored_tokens": cpu.num_rows, "same_tokens": same_keys, "seconds": seconds}
    if same_keys:
        a, b = (t.column("ref_logprob").to_numpy() for t in (cpu, gpu))
        out["max_abs_logprob_diff"] = float(abs(a - b).max())
        out["top1_agreement"] = float(
            (cpu.column("ref_top1_id").to_numpy() == gpu.column("ref_top1_id").to_numpy()).mean()
        )
        out["rank_agreement"] = float((cpu.column("ref_rank").to_numpy() == gpu.column("ref_rank").to_numpy()).mean())
    out["ok"] = bool(same_keys and out["max_abs_logprob_diff"] <= 1e-3)
    return out


def build_llama(path: Path, small: bool, device: str) -> int:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lpf.zoo.registry import tokenizer_dir

    if small:
        cfg = LlamaConfig(
            vocab_size=32000,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    else:  # Llama-3.2-1B's shape
        cfg = LlamaConfig(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            tie_word_embeddings=True,
        )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def rl_mix(small: bool, vocab: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(0)
    seqs = []
    for _ in range(16 if small else 256):
        n = rng.randint(16, 256) if small else rng.randint(128, 2048)
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        seqs.append((ids[: n // 2], ids[n // 2 :]))
    return seqs


def throughput(device: str, small: bool, tmp: Path) -> dict:
    from lpf.core.model_specs import ModelRef
    from lpf.pipeline.reference import Rescorer, ScoreItem

    path = tmp / "llama"
    t0 = time.perf_counter()
    n_params = build_llama(path, small, device)
    log(f"random Llama built and saved: {n_params / 1e9:.2f}B parameters ({time.perf_counter() - t0:.0f} s)")
    rescorer = Rescorer(ModelRef("gpu-check-llama", path), dtype="bfloat16", device=device, topk=5)
    model = rescorer.model
    seqs = rl_mix(small, rescorer.vocab_size)
    items = [ScoreItem(f"r{i:04d}", p, o) for i, (p, o) in enumerate(seqs)]
    n_out = sum(len(o) for _, o in seqs)
    result = {
        "parameters": n_params,
        "sequences": len(seqs),
        "output_tokens": n_out,
        "input_tokens": sum(len(p) + len(o) for p, o in seqs),
    }
    with torch.inference_mode():
        for name, fn in (
            ("lpf", lambda: rescorer.score(items)),
            ("naive", lambda: naive_logprobs(model, seqs, device)),
        ):
            best, values = None, None
            for _ in range(2):  # the first run warms kernels and allocators up; the best run counts
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                sync(device)
                t0 = time.perf_counter()
                res = fn()
                if name == "lpf":
                    tables = list(res)
                    by_id = {}
                    for t in tables:
                        for rid, lp in zip(t.column("request_id").to_pylist(), t.column("ref_logprob").to_pylist()):
                            by_id.setdefault(rid, []).append(lp)
                    res = torch.tensor([lp for rid in sorted(by_id) for lp in by_id[rid]], dtype=torch.float64)
                sync(device)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
                values = res.double().cpu()
            peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
            result[name] = {"seconds": best, "tokens_per_s": n_out / best, "peak_gpu_bytes": peak}
            result[f"{name}_values"] = values
            log(
                f"{name}: {n_out / best:,.0f} output tokens/s ({best:.2f} s)"
                + (f", peak GPU memory {peak / 2**30:.1f} GiB" if peak else "")
            )
    a, b = result.pop("lpf_values"), result.pop("naive_values")
    # naive's head is bfloat16, lpf's float32: they differ by bfloat16's rounding of the logits
    result["max_abs_logprob_diff_vs_naive"] = float((a - b).abs().max())
    result["mean_abs_logprob_diff_vs_naive"] = float((a - b).abs().mean())
    result["speedup"] = result["lpf"]["tokens_per_s"] / result["naive"]["tokens_per_s"]
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny Llama and 16 sequences (a dry run)")
    a = ap.parse_args()
    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: torch {torch.__version__} sees no GPU", file=sys.stderr)
        return 2
    doc = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        log(f"correctness: {STORED.name} rescored on {a.device} against its stored CPU reference")
        doc["correctness"] = correctness(a.device, Path(tmp))
        log(json.dumps(doc["correctness"]))
        log("throughput: lpf vs a plain HF forward, bfloat16, RL-like mix")
        doc["throughput"] = throughput(a.device, a.small, Path(tmp))
    t = doc["throughput"]
    log(
        f"lpf / naive: {t['speedup']:.2f}x output tokens/s; max |lpf - naive| logprob {t['max_abs_logprob_diff_vs_naive']:.3g}"
    )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))
    return 0 if doc["correctness"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
