"""gpu_check's audit steps: `lpf audit` as a user runs it on a GPU, and the built-in engine's dtypes.

Each audit is the real command line (`lpf.cli.cli`, in this process: one torch import for the whole
check) writing a real run directory; its findings.json is read back and judged against what the
audit must show. Sizes: what fits the check's budget on one GPU; --small cuts the workloads down so a
CPU runs every step in seconds (the same code, the same checks).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

# the stale-state drill's imposter budget (tests/test_engine_drills.py): a long-memory Jamba in a small
# cache, few tokens a step, so slots recycle and brand-new requests are run as decodes
STALE = ["--model", "tiny:jamba-longmem", "--n", "4", "--max-tokens", "16", "--cache-mb", "3"]
STALE += ["--max-num-seqs", "16", "--max-num-batched-tokens", "32", "--inject", "stale-state"]


def _workload(ctx, name: str, n: int) -> str:
    """The first n items of zoo workload `name` as a JSONL file (the whole workload: its zoo: name)."""
    from lpf.zoo import registry

    if n >= registry.WORKLOADS[name]["default_n"]:
        return f"zoo:{name}"
    path = ctx.tmp / f"{name}-{n}.jsonl"
    if not path.exists():
        items = registry.workload_items(name, seed=0, n=n)
        path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return str(path)


def audit(ctx, name: str, args: list[str]) -> dict:
    """`lpf audit ARGS --out DIR --fail-on never` in this process; the findings' essentials."""
    from lpf.cli import cli

    out_dir = ctx.tmp / name
    argv = ["audit", *args, "--reference-device", ctx.device, "--out", str(out_dir), "--fail-on", "never"]
    t0 = time.perf_counter()
    cli.main(args=argv, prog_name="lpf", standalone_mode=False)
    seconds = time.perf_counter() - t0
    f = json.loads((out_dir / "findings.json").read_text())
    top = (f.get("hypotheses") or [{}])[0]
    return {
        "command": "lpf " + " ".join(argv),
        "audit_s": seconds,
        "verdict": f["verdict"],
        "n_requests": f["n_requests"],
        "n_scored_tokens": f["n_scored_tokens"],
        "counts": f["counts"],
        "run_test": (f.get("run_test") or {}).get("result"),
        "run_test_sentence": (f.get("run_test") or {}).get("sentence"),
        "top_hypothesis": top.get("feature"),
        "top_hypothesis_sentence": top.get("sentence"),
        "faults": _faults(out_dir),
    }


def _faults(run: Path) -> int | None:
    """Ground-truth rows a drill wrote (tests and drills read them; analysis never does)."""
    import pyarrow.parquet as pq

    parts = sorted((run / "faults").glob("*.parquet")) if (run / "faults").exists() else []
    return sum(pq.read_metadata(p).num_rows for p in parts) if parts else None


def _engine(ctx, dtype: str) -> list[str]:
    return ["--engine", "builtin", "--dtype", dtype, "-E", f"device={ctx.device}"]


def audit_builtin_float32(ctx) -> dict:
    """zoo:stress on the built-in engine in float32: every request clean."""
    wl = _workload(ctx, "stress", 32 if ctx.small else 2000)
    r = audit(ctx, "builtin-float32", [*_engine(ctx, "float32"), "--model", "zoo:hybrid", "--workload", wl])
    r["ok"] = r["verdict"] == "clean" and r["counts"]["clean"] == r["n_requests"]
    return r


def audit_stale_state(ctx) -> dict:
    """The stale-state drill: imposters flagged, the top hypothesis names the mechanism."""
    wl = _workload(ctx, "oracle", 24 if ctx.small else 60)
    r = audit(ctx, "stale-state", [*_engine(ctx, "float32"), "--workload", wl, *STALE])
    flagged = r["counts"]["divergent"] + r["counts"]["corrupt"]
    r["flagged"] = flagged
    r["ok"] = bool(r["faults"] and flagged and r["top_hypothesis"] in ("first_decode_uncomputed", "first_phase_decode"))
    return r


def audit_quantize4(ctx) -> dict:
    """4-bit weights served under the full-precision name: a systematic difference."""
    wl = _workload(ctx, "oracle", 24 if ctx.small else 60)
    args = [*_engine(ctx, "float32"), "--model", "zoo:hybrid", "--workload", wl, "--max-tokens", "8"]
    r = audit(ctx, "quantize4", [*args, "--inject", "quantize-weights:4"])
    r["ok"] = r["verdict"] == "systematic" and r["run_test"] == "different"
    return r


def audit_builtin_bfloat16(ctx) -> dict:
    """zoo:stress (its first 500) on the built-in engine in bfloat16 against the float32 reference:
    it finishes within the step's limit and raises no false alarm (bf16 noise at most)."""
    wl = _workload(ctx, "stress", 16 if ctx.small else 500)
    r = audit(ctx, "builtin-bfloat16", [*_engine(ctx, "bfloat16"), "--model", "zoo:hybrid", "--workload", wl])
    r["ok"] = r["verdict"] in ("clean", "noise") and r["run_test"] == "same"
    return r


def audit_hf_bfloat16(ctx) -> dict:
    """The HF engine in bfloat16, batched by 64, against the float32 reference: real GPU kernels'
    batch noise is not called a lie (no divergent request, run test same)."""
    wl = _workload(ctx, "oracle", 32 if ctx.small else 500)
    args = ["--engine", "hf", "-E", "dtype=bfloat16", "-E", f"device={ctx.device}", "-E", "batch_size=64"]
    r = audit(ctx, "hf-bfloat16", [*args, "--model", "zoo:hybrid", "--workload", wl])
    r["ok"] = r["counts"]["divergent"] == 0 and r["counts"]["corrupt"] == 0 and r["run_test"] == "same"
    return r


# -- the built-in engine's dtypes ------------------------------------------------------------------
def _requests(n: int):
    from lpf.builtin.request import Request
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.core.sampling import SamplingParams
    from lpf.core.workload import expand, load_prompts

    model = resolve_model("zoo:hybrid")
    tok = load_tokenizer(model)
    prompts, _ = load_prompts("zoo:stress", tok, len(tok), None)
    sampling = SamplingParams()
    reqs = expand(prompts[:n], 1, sampling)
    return model, [
        Request(r.request_id, list(r.prompt_token_ids), sampling, r.max_tokens, r.seed, tok.eos_token_id, seq=r.seq)
        for r in reqs
    ]


def _run_engine(ctx, dtype: str, n_requests: int, max_steps: int, seconds: float) -> dict:
    """Steps of the built-in engine over the first zoo:stress requests: timed steps, then a profile
    of a few more."""
    from torch.profiler import ProfilerActivity, profile

    from gpu_check_rescore import top_ops
    from lpf.builtin.config import EngineConfig
    from lpf.builtin.llm_engine import LLMEngine

    model, reqs = _requests(n_requests)
    engine = LLMEngine(model.path, EngineConfig(dtype=dtype, device=ctx.device))
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):  # warm
        engine.step()
    on_device = ctx.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    profiled = 0
    with profile(activities=activities) as prof:
        while engine.has_unfinished() and profiled < 5:
            engine.step()
            profiled += 1
        ctx.sync()
    out = {"profiled_steps": profiled}
    out["profile"] = top_ops(prof, on_device, n=12)
    if on_device:
        out["profile_cpu"] = top_ops(prof, False, n=12)  # host-side cost: launches, syncs, Python-side casts
    syncs = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaMemcpyAsync")
    out["host_syncs_per_step"] = {e.key: e.count / max(1, profiled) for e in prof.key_averages() if e.key in syncs}
    ctx.sync()
    t0, steps, finished = time.perf_counter(), 0, 0
    while engine.has_unfinished() and steps < max_steps and time.perf_counter() - t0 < seconds:
        finished += len(engine.step())
        steps += 1
    ctx.sync()
    wall = time.perf_counter() - t0
    trace = engine.drain_trace()
    out.update(steps=steps, seconds=wall, steps_per_s=steps / wall, finished_in_timed_steps=finished)
    # every step's scheduled tokens, warm and profiled ones included (the same for both dtypes)
    out["scheduled_tokens"] = int(sum(trace.column("num_scheduled_tokens").to_pylist())) if trace is not None else None
    del engine
    return out


def engine_dtypes(ctx) -> dict:
    """The built-in engine in float32 and bfloat16 on the device, the same requests and step budget:
    steps/s, and a profile of 5 steps each (issue 42: bf16 did not finish zoo:stress in 70 s, float32
    did in 32 s)."""
    n, max_steps, seconds = (4, 6, 10.0) if ctx.small else (256, 400, 10.0)
    out = {"requests": n}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = _run_engine(ctx, dtype, n, max_steps, seconds)
        if ctx.device.startswith("cuda"):
            torch.cuda.empty_cache()
    out["bfloat16_over_float32_step_time"] = out["float32"]["steps_per_s"] / out["bfloat16"]["steps_per_s"]
    out["ok"] = all(out[d]["steps"] > 0 and out[d]["profile"]["aten"] for d in ("float32", "bfloat16"))
    return out
