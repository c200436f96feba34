"""Where the reference runs: `cpu | cuda | auto`, and loading a model onto it.

- `resolve_device(name)`: "auto" is CUDA when torch sees a GPU, else the CPU; "cuda" on a machine
  without one is an LpfError (one line), never a fall-back that would silently change the numbers.
- `load_model(path, dtype, device)`: weights in `dtype`. On a GPU the model goes whole onto it when
  its weights (and the float32 head copy) fit in 85% of the free memory; otherwise it is spread over
  the visible GPUs (and host memory) with transformers' `device_map="auto"`, which needs the
  `accelerate` package: without it the error says so. Returns (model, placement) where placement is
  "cpu", "cuda:0" or "auto". A float32 model on a GPU turns TF32 off (process-wide): float32 means
  float32 products there, not TF32's 10-bit mantissas.
- `weight_bytes(path, dtype)`: the weights' size at `dtype`, read from safetensors headers (no
  tensor is loaded), or from the files' sizes for other formats.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from lpf.core.errors import LpfError

DEVICES = ("cpu", "cuda", "auto")
_FIT = 0.85  # of the free GPU memory: the rest is activations, the batch's logits and the allocator's slack
_SAFETENSORS_BYTES = {
    "F64": 8,
    "I64": 8,
    "F32": 4,
    "I32": 4,
    "BF16": 2,
    "F16": 2,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def resolve_device(name: str) -> str:
    """`cpu`, `cuda`, `cuda:N` or `auto` -> the torch device to run the reference on."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise LpfError(
                f"--reference-device {name}: torch {torch.__version__} ({build}) sees no GPU; "
                f"use --reference-device cpu or auto"
            )
        return name
    raise LpfError(f"unknown reference device {name!r}; choose from {', '.join(DEVICES)}")


def weight_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes the model's weights take at `dtype` (floating tensors converted, others as stored)."""
    size = torch.tensor([], dtype=dtype).element_size()
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return sum(f.stat().st_size for f in Path(path).glob("*.bin"))
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in t["shape"]:
                numel *= d
            stored = _SAFETENSORS_BYTES.get(t["dtype"], 4)
            total += numel * (size if t["dtype"].startswith(("F", "BF")) else stored)
    return total


def load_model(path: Path, dtype: torch.dtype, device: str, extra_bytes: int = 0):
    """(model in eval mode, placement). `extra_bytes`: what else must fit beside the weights."""
    from transformers import AutoModelForCausalLM

    if device == "cpu":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), "cpu"
    index = torch.device(device).index or 0
    if dtype == torch.float32:  # a float32 reference means float32 products: no TF32 (process-wide)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    free, _ = torch.cuda.mem_get_info(index)
    need = weight_bytes(path, dtype) + extra_bytes
    if need <= _FIT * free:
        # transformers wants accelerate for any device_map, even one device: load, then move
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return model.to(f"cuda:{index}").eval(), f"cuda:{index}"
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise LpfError(
            f"the reference needs {need / 2**30:.1f} GiB and {device} has {free / 2**30:.1f} GiB free; "
            f"spreading it over GPUs (device_map='auto') needs accelerate: pip install accelerate"
        ) from None
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="auto").eval(), "auto"
