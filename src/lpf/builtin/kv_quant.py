"""Quantized KV cache arithmetic: K and V quantized on write with a scale, dequantized on read, as vLLM's and
SGLang's fp8 KV caches do. `KVCache` holds the codes and scales; this module only computes.

Contract:
  FP8_DTYPES                 kv_cache_dtype name -> torch float8 dtype ("fp8" is e4m3, as vLLM spells it)
  KVQuant(kv_cache_dtype, scales, head_dim)
    .code_dtype              the dtype the codes are stored in
    .n_groups                scales per (row, head): 1 with per-tensor scales, head_dim / GROUP per-block
    .scales_for(x, kind, layer) -> [n, heads, n_groups] float32: the scale each row is written with
    .quantize(x, scales)     x [n, heads, head_dim] / scale -> codes (saturated to the type's largest value)
    .dequantize(codes, scales) -> float32 codes * scale
  fp4_e2m1(x) -> float32     x rounded to the nearest fp4 (e2m1) value, saturated at +-6 (the kv-fp4-collapse
                             drill's cache: NVFP4's element type, exactly representable in e4m3 codes)
Scales:
  "tensor"  one scale per layer for K and one for V, computed from the first K/V the layer writes as vLLM's
            `calculate_kv_scales` does (amax / 200 for K, amax / 100 for V) and fixed from then on; a later
            value past the type's range saturates, as it does there. Kept per row too (every row the
            layer's scale), so a read can replace one row's scale as a drill does.
  "block"   a scale per GROUP = 16 consecutive elements of one head's row (clipped to head_dim): amax / the
            type's largest value, computed as each row is written (NVFP4's and SGLang's fp4 block scales;
            each row's own, so a block never needs rescaling as decode appends to it).
Rows are [n, heads, head_dim]; scales are float32; codes round to nearest (torch's float8 cast).
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
GROUP = 16
# vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT (calculate_kv_scales): the first batch's amax maps to these
TENSOR_RANGE = {"k": 200.0, "v": 100.0}
_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


class KVQuant:
    def __init__(self, kv_cache_dtype: str, scales: str, head_dim: int):
        self.fp4 = kv_cache_dtype == "fp4_e2m1"  # the kv-fp4-collapse drill's cache, not an option
        if kv_cache_dtype not in FP8_DTYPES and not self.fp4:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(FP8_DTYPES)}, got {kv_cache_dtype!r}")
        if scales not in ("tensor", "block"):
            raise ValueError(f"kv cache scales must be tensor or block, got {scales!r}")
        self.name, self.mode = kv_cache_dtype, scales
        self.code_dtype = torch.float8_e4m3fn if self.fp4 else FP8_DTYPES[kv_cache_dtype]
        self.max = 6.0 if self.fp4 else float(torch.finfo(self.code_dtype).max)
        self.group = min(GROUP, head_dim) if head_dim % min(GROUP, head_dim) == 0 else head_dim
        self.n_groups = 1 if scales == "tensor" else head_dim // self.group
        self._tensor: dict[tuple[str, int], float] = {}  # (k|v, layer) -> its fixed per-tensor scale

    def scales_for(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        n, heads, hd = x.shape
        tiny = torch.finfo(torch.float32).tiny
        if self.mode == "tensor":
            key = (kind, layer)
            if key not in self._tensor and n:
                self._tensor[key] = max(float(x.detach().abs().amax()) / TENSOR_RANGE[kind], tiny)
            return torch.full((n, heads, 1), self._tensor.get(key, 1.0), dtype=torch.float32, device=x.device)
        amax = x.detach().float().abs().view(n, heads, self.n_groups, self.group).amax(dim=-1)
        return (amax / self.max).clamp_min(tiny)

    def quantize(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        n, heads, hd = x.shape
        g = (x.float().view(n, heads, scales.shape[-1], -1) / scales[..., None]).clamp(-self.max, self.max)
        if self.fp4:
            g = fp4_e2m1(g)
        return g.view(n, heads, hd).to(self.code_dtype)

    @staticmethod
    def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        shape = codes.shape
        g = codes.float().view(*shape[:-1], scales.shape[-1], -1) * scales[..., None]
        return g.view(shape)


def fp4_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 magnitude (ties to the lower), sign kept, saturated at 6."""
    grid = _FP4.to(x.device)
    mag = x.abs().clamp(max=6.0)
    idx = torch.bucketize(mag, (grid[1:] + grid[:-1]) / 2)
    return torch.sign(x) * grid[idx]
