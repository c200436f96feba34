"""The reference's output head: hidden states -> logits, as the model's own head computes them.

Contract:
- `Head(model, float32_head, mixed)`: the head of a loaded HF causal LM. `logits(hidden, out=None,
  native=False)` maps [N, H] hidden states to [N, V] logits (into `out` when given): in float32 when
  `float32_head` (weights stay in the model's dtype), else in the weights' dtype, as an engine computing
  at that dtype would; `native=True` uses the model's own weights at their dtype (what `check_head`
  compares with the model's forward). `dtype`, `device`, `vocab_size` describe its output.
- `check_head(model, logits, device, vocab_size, spec)`: raises LpfError unless `logits` reproduces the
  model's own forward on a probe, so a head this module does not understand fails loudly instead of
  scoring wrong. The head is rebuilt from the output embeddings plus the known post-ops (Granite's
  `logits_scaling`, FalconH1's `lm_head_multiplier`, Gemma's final soft-capping).
- `mixed_mm_supported(device, dtype)` / `mixed_mm(a, b, out)`: the float32-output GEMM of
  bfloat16/float16 operands, where the device has one.
- `head_chunk_rows(vocab, device)`: rows per head chunk, so its [rows, V] float32 buffer stays bounded.

The float32 head of bfloat16/float16 weights: the products of two such numbers are exact in float32, so
"the head in float32" is the model's own operands multiplied with float32 accumulation and output.
Where torch has that GEMM (`torch.mm(..., out_dtype=torch.float32)`: CUDA) it runs on the operands as
they are, at the tensor cores' pace and without a float32 copy of the weight (issue 42: 441 against 49
TFLOP/s for a float32 GEMM with TF32 off, on an H200); elsewhere (a CPU has no such kernel) the weight is
copied to float32 once and the hidden rows upcast: the same products, the same float32 sums up to
their order. Float32 weights stay float32.
"""

from __future__ import annotations

from typing import Callable

import torch

from lpf.core.errors import LpfError

# The head's [chunk_rows, V] float32 logits buffer is about this size: on a CPU the matmul gains up to
# ~500 rows (~15% from 128 to 512 at V = 32000) while logprob_rows reads the buffer in L2-sized blocks.
_CPU_CHUNK_BYTES = 64 << 20
_GPU_CHUNK_BYTES = 512 << 20


def head_chunk_rows(vocab: int, device: str) -> int:
    """Rows the head projects at a time: a [rows, V] float32 buffer of about the device's chunk size."""
    budget = _GPU_CHUNK_BYTES if device.startswith("cuda") else _CPU_CHUNK_BYTES
    return int(min(4096, max(32, budget // (4 * vocab))))


def mixed_mm_supported(device: str, dtype: torch.dtype) -> bool:
    """Whether `device` multiplies `dtype` matrices into float32 output (`torch.mm(..., out_dtype=)`):
    CUDA with bfloat16/float16, not a CPU (torch 2.13 has no CPU kernel). Probed on two tiny matrices,
    once per (device type, dtype): into a given buffer, else into a new one (a torch without the `out=`
    form of the overload)."""
    key = (torch.device(device).type, dtype)
    if key not in _MIXED_MM:
        _MIXED_MM[key] = None
        if dtype in (torch.bfloat16, torch.float16) and key[0] == "cuda":
            a = torch.ones((2, 3), device=device, dtype=dtype)
            for mode in ("out", "new"):
                try:
                    out = torch.empty((2, 2), device=device, dtype=torch.float32) if mode == "out" else None
                    z = _mm_float32_out(a, a.t(), out)
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                if z.dtype == torch.float32 and bool(z.eq(3).all()):
                    _MIXED_MM[key] = mode
                    break
    return _MIXED_MM[key] is not None


_MIXED_MM: dict = {}  # (device type, dtype) -> "out" | "new" | None (no float32-output GEMM)


def _mm_float32_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def mixed_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b of bfloat16/float16 operands, accumulated in float32 and returned in float32 (into `out`
    where this torch has that form; `mixed_mm_supported` must have said yes for the device and dtype)."""
    use_out = out is not None and _MIXED_MM.get((a.device.type, a.dtype)) == "out"
    return _mm_float32_out(a, b, out if use_out else None)


class Head:
    """hidden -> logits of one loaded model: its output embeddings plus the known post-ops."""

    def __init__(self, model, float32_head: bool = True, mixed: bool = False):
        head = model.get_output_embeddings()
        self.config = model.config
        self.mixed = mixed
        self.device = head.weight.device
        self.vocab_size = head.weight.shape[0]
        self.native = (head.weight.detach(), None if head.bias is None else head.bias.detach())
        if mixed:  # the model's own weight; float32 logits from the GEMM; the bias added in float32
            bias = self.native[1]
            self.weights = (self.native[0], None if bias is None else bias.float())
        elif float32_head:
            self.weights = tuple(None if t is None else t.float() for t in self.native)
        else:
            self.weights = self.native
        self.dtype = torch.float32 if float32_head else self.native[0].dtype

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:
        """[N, H] hidden states -> [N, V] logits (into `out` when given, in the head's dtype)."""
        weight, bias = self.native if native else self.weights
        h = hidden.to(device=weight.device, dtype=weight.dtype)
        if self.mixed and not native:
            logits = mixed_mm(h, weight.t(), out)
        else:
            logits = torch.mm(h, weight.t(), out=out) if out is not None else h @ weight.t()
        if bias is not None:
            logits.add_(bias)
        cfg = self.config
        scaling = getattr(cfg, "logits_scaling", None)
        if scaling not in (None, 1, 1.0):
            logits.div_(scaling)
        multiplier = getattr(cfg, "lm_head_multiplier", None)  # FalconH1's muP head (its published checkpoints)
        if multiplier not in (None, 1, 1.0):
            logits.mul_(multiplier)
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits


def check_head(model, logits: Callable, device: torch.device, vocab_size: int, spec: str) -> None:
    """Raise LpfError unless `logits(hidden, native=...)` reproduces `model`'s forward on a probe of 8
    tokens (on `device`, the input embeddings')."""
    probe = torch.arange(1, 9, device=device).remainder(vocab_size).view(1, -1)
    with torch.inference_mode():
        full = model(input_ids=probe, use_cache=False).logits[0].float()
        hidden = model.base_model(input_ids=probe, use_cache=False).last_hidden_state[0]
        native = logits(hidden, native=True).float().to(full.device)
        ours = logits(hidden).float().to(full.device)
    scale = max(1.0, full.abs().max().item())
    # the same ops at the model's dtype must match its forward; the float32 head differs from a
    # lower-precision forward by that dtype's rounding of the logits
    err = (full - native).abs().max().item()
    loose = max(1e-3, 4 * torch.finfo(model.dtype).eps) * scale
    if not (err <= 1e-3 * scale and (full - ours).abs().max().item() <= loose):
        raise LpfError(
            f"reference model {spec}: its output head does more than this "
            f"rescorer knows (mismatch {err:.3g}); architecture {type(model).__name__} is not supported"
        )
