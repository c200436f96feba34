"""Benchmark: lpf's reference rescorer against the naive seed-workflow script, and the Ray executor.

Naive (what the seed's engineers ran first): pad the batch (8 sequences in arrival order), one
forward, full float32 logits [batch, seq, vocab], log_softmax over all of it, gather the outputs.
lpf: `lpf.pipeline.reference.Rescorer` (length-sorted batches under a token budget, hidden states projected
only at output positions, in row chunks, top-k / rank / entropy / log-softmax in a few fused passes).

Cases on a random Llama with vocab 32000 (every method sees identical inputs and must agree):
  rl      64 sequences of 16..1024 tokens, the second half of each is "output" (RL-like)
  audit   the same sequences with outputs of at most 64 tokens (audit-like: long prompts, short answers)
  memory  8 sequences of 2048 tokens: peak RSS above the loaded model
  ray     the rl sequences stored as a run directory and rescored by the rescore stage: local
          executor, then Ray Data with 1 and 2 actors (a local Ray of this machine's cores, started
          before the clock; the actors' model loads are inside it, as in a real job)
Each measurement runs in its own subprocess so peaks do not leak between methods; the speed cases
are repeated `--repeats` times, the methods interleaved, and each method's best run is its result
(on a shared machine the least disturbed run is the closest to its cost). Every worker runs with
`--threads` torch threads (default 1: the same for every method, and stable on a busy machine).
`--quick` is the smoke run `make test` does (seconds; nothing timed is asserted, no results file):
6 sequences of 16..160 tokens, 2 of 256 for memory, one repeat, every worker in this process (so
peaks are not separated), and of the Ray rows only the local executor's (Ray itself not started).
Usage: python bench/rescore.py [--quick] [--repeats N] [--threads T] [--no-ray]
       (writes bench/results/rescore.json, prints the tables)
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
SPEED = ("rl", "audit")


def build_model(path: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lpf.zoo.registry import tokenizer_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(path)


def make_case(case: str, quick: bool) -> list[tuple[list[int], list[int]]]:
    import random

    rng = random.Random(0)
    if case in ("rl", "audit", "ray"):
        lengths = [rng.randint(16, 160 if quick else 1024) for _ in range(6 if quick else 64)]
    else:
        lengths = [256 if quick else 2048] * (2 if quick else 8)
    seqs = []
    for n in lengths:
        ids = [rng.randrange(3, VOCAB) for _ in range(n)]
        cut = n - min(64, n // 2) if case == "audit" else n // 2
        seqs.append((ids[:cut], ids[cut:]))
    return seqs


def naive_logprobs(model, seqs, device: str = "cpu"):
    """The seed's script: batches of 8 in arrival order, padded, full float32 logits, log_softmax."""
    import torch

    out = []
    for i in range(0, len(seqs), NAIVE_BATCH):
        batch = seqs[i : i + NAIVE_BATCH]
        width = max(len(p) + len(o) for p, o in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, o) in enumerate(batch):
            ids[row, : len(p) + len(o)] = torch.tensor(p + o)
            mask[row, : len(p) + len(o)] = 1
        logp = torch.log_softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), dim=-1)
        for row, (p, o) in enumerate(batch):
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(o), device=device)
            out.append(logp[row, pos, torch.tensor(o, device=device)])
        del logp
    return torch.cat(out)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_run(path: Path, model_dir: Path, seqs) -> None:
    """The sequences as a schema-true run directory (what `lpf rescore` reads)."""
    import pyarrow as pa

    from lpf.core.model_specs import load_tokenizer, resolve_model, tokenizer_fingerprint
    from lpf.run import schema
    from lpf.run.store import RunDir

    model = resolve_model(str(model_dir))
    # no engine sampled these (random tokens): a name whose sampler lpf does not replay
    run = RunDir.create(
        path,
        {
            "run_id": "bench",
            "status": "complete",
            "engine": {"name": "bench"},
            "model": {"spec": str(model_dir)},
            "tokenizer_sha256": tokenizer_fingerprint(load_tokenizer(model)),
            "sampling": {"logprobs": 5},
        },
    )
    for start in range(0, len(seqs), 8):  # parts of 8 requests, as `lpf run --part-size 8` writes them
        reqs, toks = [], []
        for i, (p, o) in enumerate(seqs[start : start + 8], start):
            reqs.append({"request_id": f"r{i:04d}", "seq": i, "prompt_token_ids": p, "output_token_ids": o})
            toks += [
                {"request_id": f"r{i:04d}", "position": j, "token_id": t, "engine_logprob": 0.0}
                for j, t in enumerate(o)
            ]
        run.append_requests(
            pa.Table.from_pylist(reqs, schema=schema.REQUESTS), pa.Table.from_pylist(toks, schema=schema.TOKENS)
        )


def worker(method: str, case: str, model_dir: str, quick: bool, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    seqs = make_case(case, quick)
    n_out = sum(len(o) for _, o in seqs)
    if case == "ray":
        return ray_worker(method, seqs, Path(model_dir), n_out)
    from lpf.core.model_specs import ModelRef
    from lpf.pipeline.reference import Rescorer, ScoreItem

    rescorer = Rescorer(ModelRef("bench", Path(model_dir)), topk=5)
    model = rescorer.model
    base = rss_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    if method == "naive":
        values = naive_logprobs(model, seqs)
    else:
        items = [ScoreItem(f"r{i:04d}", p, o) for i, (p, o) in enumerate(seqs)]
        by_id = {}
        for t in rescorer.score(items):
            for rid, lp in zip(t.column("request_id").to_pylist(), t.column("ref_logprob").to_pylist()):
                by_id.setdefault(rid, []).append(lp)
        values = torch.tensor([lp for rid in sorted(by_id) for lp in by_id[rid]])
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "method": method,
        "case": case,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "output_tokens": n_out,
        "tokens_per_s": n_out / seconds,
        "peak_extra_bytes": max(0, peak - base),
        "checksum": values.double().sum().item(),
        "n": int(values.numel()),
    }


def ray_worker(method: str, seqs, model_dir: Path, n_out: int) -> dict:
    """`rescore_run` over a fresh copy of the run: method local, ray1 or ray2."""
    import logging

    import pyarrow.parquet as pq

    from lpf.pipeline.rescore import RayOptions, RescoreSettings, rescore_run
    from lpf.run.store import RunDir

    with tempfile.TemporaryDirectory() as tmp:
        write_run(Path(tmp) / "run", model_dir, seqs)
        run = RunDir.open(Path(tmp) / "run")
        if method == "local":
            settings = RescoreSettings(device="cpu")
        else:
            import ray

            ray.init(
                address="local",
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                logging_level=logging.ERROR,
                log_to_driver=False,
            )
            settings = RescoreSettings(device="cpu", executor="ray", ray=RayOptions(actors=int(method[3:])))
        t0 = time.perf_counter()
        rescore_run(run, settings=settings)
        seconds = time.perf_counter() - t0
        ref = pq.read_table(Path(tmp) / "run" / "reference").sort_by(
            [("request_id", "ascending"), ("position", "ascending")]
        )
    return {
        "method": method,
        "case": "ray",
        "seconds": seconds,
        "output_tokens": n_out,
        "tokens_per_s": n_out / seconds,
        "checksum": sum(ref.column("ref_logprob").to_pylist()),
        "n": ref.num_rows,
    }


def run_worker(method, case, model_dir, quick, threads) -> dict:
    if quick:  # the smoke run: no process per measurement (the numbers mean nothing there anyway)
        return worker(method, case, model_dir, quick, threads)
    args = [
        sys.executable,
        __file__,
        "--worker",
        method,
        "--case",
        case,
        "--model-dir",
        model_dir,
        "--threads",
        str(threads),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(args + (["--quick"] if quick else []), capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{method}/{case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def agree(a: dict, b: dict) -> None:
    # same inputs, same model: the methods must agree or the comparison means nothing
    assert a["n"] == b["n"] and abs(a["checksum"] - b["checksum"]) < 1e-3 * max(1.0, abs(a["checksum"])), (a, b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--case")
    ap.add_argument("--model-dir")
    ap.add_argument("--quick", action="store_true", help="tiny inputs, in this process, no results file (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each speed measurement (best counts)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every worker")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray executor rows")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.case, a.model_dir, a.quick, a.threads)))
        return
    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    if a.quick:
        a.repeats = 1
    plan = [(c, m) for _ in range(a.repeats) for c in SPEED for m in ("naive", "lpf")] + [
        ("memory", "naive"),
        ("memory", "lpf"),
    ]
    if a.quick:
        plan.append(("ray", "local"))  # the run-directory path, without starting Ray
    elif not a.no_ray:
        try:
            import ray  # noqa: F401

            plan += [("ray", m) for _ in range(a.repeats) for m in ("local", "ray1", "ray2")]
        except ImportError:
            print("ray rows skipped: Ray is not installed (pip install 'logprob-forensics[ray]')", file=sys.stderr)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        for case, method in plan:
            r = run_worker(method, case, tmp, a.quick, a.threads)
            runs.setdefault(f"{case}/{method}", []).append(r)
            print(
                f"{case:6s} {method:5s} {r['seconds']:7.2f}s (cpu {r.get('cpu_seconds', 0):6.2f}s) "
                f"{r['tokens_per_s']:9.0f} tok/s"
                + (f"  peak +{r['peak_extra_bytes'] / 2**20:8.1f} MiB" if "peak_extra_bytes" in r else ""),
                file=sys.stderr,
            )
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items()}
    for case in (*SPEED, "memory"):
        agree(best[f"{case}/naive"], best[f"{case}/lpf"])
    if "ray/local" in best:
        agree(best["ray/local"], best["rl/lpf"])
    for m in ("ray1", "ray2"):
        if f"ray/{m}" in best:
            agree(best["ray/local"], best[f"ray/{m}"])
    ratio = {c: best[f"{c}/lpf"]["tokens_per_s"] / best[f"{c}/naive"]["tokens_per_s"] for c in SPEED}
    # the same ratio on process CPU time (best run each): a cross-check that is blind to waiting for a core
    cpu_ratio = {
        c: min(r["cpu_seconds"] for r in runs[f"{c}/naive"]) / min(r["cpu_seconds"] for r in runs[f"{c}/lpf"])
        for c in SPEED
    }
    mem = best["memory/lpf"]["peak_extra_bytes"] / max(1, best["memory/naive"]["peak_extra_bytes"])
    summary = {
        "speedup": ratio,
        "speedup_cpu_time": cpu_ratio,
        "memory_ratio": mem,
        "quick": a.quick,
        "repeats": a.repeats,
        "threads": a.threads,
        "best": best,
        "runs": runs,
        "machine": f"{os.cpu_count()} cores",
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if "ray/ray1" in best:
        summary["ray"] = {
            m: best[f"ray/{m}"]["tokens_per_s"] / best["ray/local"]["tokens_per_s"] for m in ("ray1", "ray2")
        }
    if not a.quick:
        Path(__file__).with_name("results").mkdir(exist_ok=True)
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        Path(__file__).with_name("results").joinpath("rescore.json").write_text(json.dumps(stamp(summary), indent=2))
    n_speed = len(make_case("rl", a.quick))
    print("| case | naive | lpf | lpf / naive | target |")
    print("|---|---|---|---|---|")
    for c, label in (
        ("rl", "outputs = second half of each sequence (RL-like)"),
        ("audit", "outputs <= 64 tokens (audit-like)"),
    ):
        n, o = best[f"{c}/naive"], best[f"{c}/lpf"]
        print(
            f"| speed, output tokens/s: {n_speed} seqs of 16..{160 if a.quick else 1024} tokens, {label} | "
            f"{n['tokens_per_s']:.0f} | {o['tokens_per_s']:.0f} | {ratio[c]:.1f}x | >= 3x |"
        )
    mn, ml = best["memory/naive"], best["memory/lpf"]
    print(
        f"| memory, peak RSS above the model: {len(make_case('memory', a.quick))} seqs of "
        f"{len(make_case('memory', a.quick)[0][0]) * 2} tokens | "
        f"{mn['peak_extra_bytes'] / 2**20:.0f} MiB | {ml['peak_extra_bytes'] / 2**20:.0f} MiB | {mem:.3f} | <= 0.125 |"
    )
    if "ray" in summary:
        loc = best["ray/local"]["tokens_per_s"]
        print("\n| `lpf rescore` of the RL-like run | output tokens/s | vs local |")
        print("|---|---|---|")
        print(f"| --executor local | {loc:.0f} | 1.00x |")
        for m in ("ray1", "ray2"):
            print(
                f"| --executor ray --actors {m[3:]} | {best[f'ray/{m}']['tokens_per_s']:.0f} | {summary['ray'][m]:.2f}x |"
            )


if __name__ == "__main__":
    main()
