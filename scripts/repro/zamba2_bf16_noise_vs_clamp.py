"""Zamba2 in bfloat16: why no per-position test of a bf16 cell can find bug 4 (the missing dt clamp) on
the tiny checkpoints. On each checkpoint below, the first 8 conformance prompts are teacher-forced four
ways: float32 with transformers' clamp (the reference), float32 without it (bug 4 at full precision),
bfloat16 with the clamp (an honest bf16 run) and bfloat16 without it (what vLLM's bf16 computes). It
prints the median |d| against the reference per position band, for the honest bf16 run ("noise") and
the two unclamped runs ("bug"), and the share of positions where the unclamped bf16 run is further from
the reference than the honest one (0.5: the two cannot be told apart).

Checkpoints: the conformance recipe (initializer_range 0.25), smaller initializer ranges, a larger
`time_step_min` (the clamp acts on more steps), the shared attention block's q/k scaled down (its
near-hard softmax is where bf16 rounding grows), and the dt path in float32 (as fused kernels do).

Run with lpf's Python (transformers of the reference):
  PYTHONPATH=src python scripts/repro/zamba2_bf16_noise_vs_clamp.py
"""

import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers.models.zamba2.modeling_zamba2 as zamba2
from transformers import AutoModelForCausalLM

from lpf.core.model_specs import ModelRef, load_tokenizer
from lpf.experiments.conformance.grid import write_workload
from lpf.experiments.conformance.tiny import build_tiny
from lpf.zoo.registry import tokenizer_dir

BANDS = ((0, 4), (4, 16), (16, 48), (48, 200))
CHECKPOINTS = (  # (what, recipe overrides, q/k scale, dt path in float32)
    ("recipe (init 0.25)", {}, 1.0, False),
    ("init 0.15", {"initializer_range": 0.15}, 1.0, False),
    ("init 0.10", {"initializer_range": 0.1}, 1.0, False),
    ("init 0.05", {"initializer_range": 0.05}, 1.0, False),
    ("init 0.15, time_step_min 0.01", {"initializer_range": 0.15, "time_step_min": 0.01}, 1.0, False),
    ("init 0.10, time_step_min 0.05", {"initializer_range": 0.1, "time_step_min": 0.05}, 1.0, False),
    ("recipe, shared q/k x 0.5", {}, 0.5, False),
    ("recipe, shared q/k x 0.25", {}, 0.25, False),
    ("recipe, dt path in float32", {}, 1.0, True),
)
SCAN = zamba2.mamba2_chunk_scan


def scan_dt_float32(hidden_states, dt, *args, dt_bias=None, **kwargs):
    return SCAN(hidden_states, dt.float(), *args, dt_bias=None if dt_bias is None else dt_bias.float(), **kwargs)


def prompts(n: int = 8) -> list[list[int]]:
    tok = load_tokenizer(ModelRef("zoo tokenizer", tokenizer_dir()))
    path = write_workload(Path(tempfile.mkdtemp()) / "w.jsonl", 16, len(tok), bos=tok.bos_token_id)
    return [json.loads(line)["prompt_token_ids"] for line in path.read_text().splitlines()[:n]]


def set_clamp(model, on: bool) -> None:
    for layer in model.model.layers:
        mixer = getattr(getattr(layer, "mamba_decoder", layer), "mamba", None)
        if mixer is not None:
            mixer.time_step_limit = (model.config.time_step_min if on else 0.0, float("inf"))


def scored(model, ids) -> np.ndarray:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def runs(path: Path, qk_scale: float, dt_float32: bool, ids: list[list[int]]) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(qk_scale)
        model = model.to(dtype)
        zamba2.mamba2_chunk_scan = scan_dt_float32 if dt_float32 and dtype == torch.bfloat16 else SCAN
        try:
            for clamp in (True, False):
                set_clamp(model, clamp)
                out[(dtype, clamp)] = [scored(model, p) for p in ids]
        finally:
            zamba2.mamba2_chunk_scan = SCAN
    return out


def bands(run: list, ref: list) -> str:
    return " / ".join(
        f"{np.median(np.concatenate([np.abs(a - b)[lo:hi] for a, b in zip(run, ref)])):.2g}" for lo, hi in BANDS
    )


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    ids = prompts()
    print(f"transformers {transformers.__version__}; {len(ids)} prompts; median |d| per band {BANDS}")
    for what, overrides, qk_scale, dt_float32 in CHECKPOINTS:
        r = runs(build_tiny("zamba2", overrides), qk_scale, dt_float32, ids)
        ref, honest, bug = r[(torch.float32, True)], r[(torch.bfloat16, True)], r[(torch.bfloat16, False)]
        share = np.mean(np.concatenate([np.abs(b - f) > np.abs(h - f) for b, h, f in zip(bug, honest, ref)]))
        print(
            f"{what}: bf16 noise {bands(honest, ref)}; bug float32 {bands(r[(torch.float32, False)], ref)}; "
            f"bug bf16 {bands(bug, ref)}; share bug > noise {share:.2f}"
        )
