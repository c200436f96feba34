"""What a user does with lpf on a GPU, checked in one short run (what `scripts/gpu_check.sh` runs).

Made for a bare GPU machine: its Python has torch, transformers, pyarrow and numpy; lpf's own
pure-Python dependencies come from scripts/gpu_requirements.txt (gpu_check.sh installs them offline).
No network, no stored weights beyond the repository's. One process; each step runs under its own time
limit (SIGALRM; a step past it is recorded as `timed_out` and the next one starts) and the whole under
`--budget` seconds (default 330: a step starts only with its limit cut to what is left). The results
JSON is rewritten after every step, so a run killed from outside keeps what it finished.

Steps (scripts/gpu_check_rescore.py, scripts/gpu_check_audits.py):
  correctness        tests/data/gpu-check-run (64 zoo:stress requests of the built-in engine on
                     zoo:hybrid, reference committed from a CPU) rescored on the device in float32
                     against the stored scores: max |delta ref_logprob| <= 1e-3, top-1, rank.
  head               the [rows x hidden] x [hidden x vocab] head of a 1.24B Llama: float32 (TF32 off),
                     bf16 operands with float32 output (`out_dtype`), bf16 output; time, TFLOP/s, error.
  throughput         a random Llama of Llama-3.2-1B's shape (1.24B, bf16) on the RL-like mix:
                     lpf's Rescorer against the naive HF forward, output tokens/s, peak memory, the
                     FLOPs the work needs and the fraction of the device's bf16 peak that is; on a
                     GPU also the Rescorer with its row statistics as eager passes (fused_rows=False;
                     the GPU default is one compiled kernel), the fused form's speed-up and its
                     distance to the eager passes (<= 1e-4); and the knobs
                     token_budget=65536 and chunk_rows=4096 (speed-up, same scores).
  rescore_profile    torch.profiler over the Rescorer on part of that mix: top ops by device time, the
                     device busy fraction (summed kernel time over the unprofiled wall time), the host
                     syncs and copies to the host per batch.
  audit_*            `lpf audit` as a user runs it (in this process): the built-in engine float32 on
                     zoo:stress (clean), the stale-state drill (caught), quantize-weights:4
                     (systematic), the built-in engine bfloat16 (finishes, no false alarm), the HF engine
                     bfloat16 batched by 64 against a float32 reference (noise at most, run test same).
  engine_dtypes      the built-in engine's steps in float32 and bfloat16 on the device: steps/s and a
                     profile of a few steps each (why bfloat16 is slower, if it is).
  compiled_trunk     (a GPU only) the throughput mix with the Rescorer's trunk compiled (compile_trunk=True,
                     fused_rows=True): first-run (compile) time, best time, speed-up against the naive
                     forward and the default, distance to the default's scores (bf16 rounding).

Usage: python scripts/gpu_check.py [--device cuda] [--small] [--only STEP,...] [--out FILE]
(--device cpu --small: every step in small form on a CPU, a dry run; the test suite runs it).
Writes FILE (default $OUT/gpu_check.json when OUT is set, else gpu_check.json in the system's temp dir,
named on stdout); exit 0 when every step ran and passed its check, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_audits  # noqa: E402
import gpu_check_rescore  # noqa: E402

H200_BF16_DENSE = 989e12  # FLOP/s, NVIDIA's dense bfloat16 figure for the H200 (and H100 SXM)


class StepTimeout(BaseException):
    """Raised by the alarm: a BaseException, so no `except Exception` inside lpf swallows it."""


@dataclass
class Ctx:
    device: str
    small: bool
    tmp: Path
    shared: dict = field(default_factory=dict)  # what one step leaves for the next (a loaded model)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# name, function, limit on a GPU (s), limit in --small (s)
STEPS = [
    ("correctness", gpu_check_rescore.correctness, 40, 60),
    ("head", gpu_check_rescore.head, 20, 30),
    ("throughput", gpu_check_rescore.throughput, 140, 60),
    ("compiled_trunk", gpu_check_rescore.compiled_trunk, 150, 10),
    ("rescore_profile", gpu_check_rescore.profile, 30, 30),
    ("audit_builtin_float32", gpu_check_audits.audit_builtin_float32, 45, 60),
    ("audit_stale_state", gpu_check_audits.audit_stale_state, 40, 60),
    ("audit_quantize4", gpu_check_audits.audit_quantize4, 25, 60),
    ("audit_builtin_bfloat16", gpu_check_audits.audit_builtin_bfloat16, 40, 60),
    ("audit_hf_bfloat16", gpu_check_audits.audit_hf_bfloat16, 30, 60),
    ("engine_dtypes", gpu_check_audits.engine_dtypes, 45, 60),
]


def environment(device: str) -> dict:
    import numpy
    import pyarrow
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pyarrow": pyarrow.__version__,
        "numpy": numpy.__version__,
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    for dist, mod in (
        ("pydantic", "pydantic"),
        ("click", "click"),
        ("rich", "rich"),
        ("plotly", "plotly"),
        ("mambapy", "mambapy"),
    ):
        env[dist] = f"{importlib.metadata.version(dist)} ({Path(importlib.import_module(mod).__file__).parent.parent})"
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        env.update(
            device=p.name,
            capability=f"{p.major}.{p.minor}",
            memory_gib=round(p.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            peak_bf16_flops=H200_BF16_DENSE if "H200" in p.name or "H100" in p.name else None,
        )
    else:
        env.update(device="cpu", peak_bf16_flops=None)
    return env


def run_step(name: str, fn, limit: float, ctx: Ctx) -> dict:
    def on_alarm(signum, frame):
        raise StepTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, limit))
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        out = fn(ctx)
        out["status"] = "passed" if out.get("ok", True) else "failed"
    except StepTimeout:
        out = {"status": "timed_out", "ok": False}
    except Exception as e:  # one step's failure is a result; the next step still runs
        out = {
            "status": "error",
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-3000:],
        }
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["cpu_s"] = round(time.process_time() - c0, 2)  # this process's CPU time: on a busy machine, the cost
    out["limit_s"] = round(limit, 1)
    if out["status"] == "timed_out":
        ctx.shared.clear()  # a model half-used by a killed step is not reused
    gc.collect()
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="every step in small form (a dry run, e.g. on a CPU)")
    ap.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds for all steps together")
    ap.add_argument("--out", type=Path, help="results JSON (default: $OUT/gpu_check.json)")
    a = ap.parse_args()
    names = [s[0] for s in STEPS]
    only = [s for s in a.only.split(",") if s]
    if unknown := [s for s in only if s not in names]:
        print(f"error: unknown step {', '.join(unknown)} (steps: {', '.join(names)})", file=sys.stderr)
        return 2
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: torch {torch.__version__} sees no GPU (--device cpu --small is the dry run)", file=sys.stderr)
        return 2
    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    tmp_root = tempfile.TemporaryDirectory(prefix="gpu-check-")
    out_path = a.out or Path(os.environ.get("OUT") or tempfile.gettempdir()) / "gpu_check.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"small": a.small, "environment": environment(a.device), "steps": {}}
    ctx = Ctx(a.device, a.small, Path(tmp_root.name))
    deadline = time.monotonic() + a.budget
    for name, fn, gpu_limit, small_limit in STEPS:
        if only and name not in only:
            continue
        left = deadline - time.monotonic()
        if left < 3:
            doc["steps"][name] = {"status": "skipped", "ok": False, "why": "the run's budget was spent"}
            continue
        limit = min(small_limit if a.small else gpu_limit, left)
        log(f"{name} (limit {limit:.0f} s)")
        res = run_step(name, fn, limit, ctx)
        doc["steps"][name] = res
        log(
            f"{name}: {res['status']} in {res['seconds']} s (cpu {res['cpu_s']} s)"
            + (f": {res['error']}" if "error" in res else "")
        )
        out_path.write_text(json.dumps(doc, indent=2, default=str))
    ctx.shared.clear()
    doc["ok"] = all(s.get("ok", False) for s in doc["steps"].values())
    doc["summary"] = gpu_check_rescore.summary(doc)
    out_path.write_text(json.dumps(doc, indent=2, default=str))
    for line in doc["summary"]:
        print(line)
    print(f"results: {out_path}")
    tmp_root.cleanup()
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
