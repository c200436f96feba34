"""What `lpf rl rescore` keeps of the reference's distribution besides the token's logprob (torch).

`RowStats(temperature, top_k, top_p)` is a `Rescorer(on_rows=...)` hook; per scored row it records
- `log_kept_mass`: log of the probability mass the rollout's sampler keeps, taken on the reference's
  logits z exactly as vLLM's sampler does it (vllm/v1/sample/sampler.py `Sampler.sample`: temperature
  first, then vllm/v1/sample/ops/topk_topp_sampler.py `apply_top_k_top_p_pytorch`: top-k masks every
  logit below the k-th largest, then top-p sorts ascending, softmaxes the survivors, masks those whose
  ascending cumulative probability is <= 1 - p, always keeping the largest):
  log sum_{kept} softmax(z / T). Under `logprobs_mode=processed_logprobs` the engine reports
  log_softmax over the kept logits (`forward_native`: `logits.log_softmax` after the mask), which is
  the tempered logprob minus this quantity: the whole offset a processed logprob carries. None when
  the rollout's settings are unknown; 0 when nothing is filtered (top-p 1, top-k off).
- `sensitivity`: sqrt((1 - p_x)^2 + sum_{j != x} p_j^2) of the token x at temperature 1 (what one nat
  of logit noise does to its logprob; `lpf.analysis.token_evidence.sensitivity`, here exact over the
  whole vocabulary).
`take()` returns the rows recorded so far (numpy float64 arrays) and clears them.
"""

from __future__ import annotations

import numpy as np
import torch


class RowStats:
    def __init__(self, temperature: float | None = None, top_k: int = 0, top_p: float = 1.0, filtered: bool = True):
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.filtered = filtered and temperature is not None
        self._kept: list[np.ndarray] = []
        self._sens: list[np.ndarray] = []

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        z = logits.float()
        p = torch.softmax(z, dim=-1)
        px = p.gather(1, targets.view(-1, 1)).squeeze(1)
        sq = (p * p).sum(-1) - px * px
        self._sens.append(torch.sqrt((1 - px) ** 2 + sq.clamp_min(0)).double().cpu().numpy())
        if self.filtered:
            self._kept.append(log_kept_mass(z, self.temperature, self.top_k, self.top_p).double().cpu().numpy())

    def take(self) -> tuple[np.ndarray | None, np.ndarray]:
        kept = np.concatenate(self._kept) if self._kept else None
        sens = np.concatenate(self._sens) if self._sens else np.zeros(0)
        self._kept, self._sens = [], []
        return kept, sens


def log_kept_mass(z: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[n, V] logits -> [n] log of the mass kept by top-k then top-p at `temperature` (vLLM's order)."""
    z = z / temperature
    lse_all = torch.logsumexp(z, dim=-1)
    if not top_k and top_p >= 1.0:
        return torch.zeros_like(lse_all)
    zs, _ = z.sort(dim=-1, descending=False)
    v = zs.shape[-1]
    if top_k and top_k < v:
        kth = zs[:, v - top_k].unsqueeze(1)
        zs = zs.masked_fill(zs < kth, float("-inf"))
    if top_p < 1.0:
        cum = torch.cumsum(zs.softmax(dim=-1), dim=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False  # at least one
        zs = zs.masked_fill(drop, float("-inf"))
    return torch.logsumexp(zs, dim=-1) - lse_all
