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
- `top_cum`: the cumulative probability of the TOP_CUM most likely tokens (descending, at the rollout's
  temperature, else 1): [n, TOP_CUM] float32. Under top-p P the kept set is the shortest head whose
  cumulative mass reaches P, under top-k K the first K, so a processed logprob's offset is one of these
  (log top_cum[k]) whatever the settings: `lpf.rl.nucleus` infers the settings from them when the
  rollout's are not known; `log_kept_grid`: log of the mass top-p keeps for each P of P_GRID, exact over
  the whole vocabulary ([n, len(P_GRID)] float32), for the heads longer than TOP_CUM.
`take()` returns the rows recorded so far (numpy arrays) and clears them.
"""

from __future__ import annotations

import numpy as np
import torch

TOP_CUM = 32
# the top-p values whose kept mass is stored exactly (over the whole vocabulary): the settings people
# write, for the tokens whose kept head is longer than TOP_CUM (a flat distribution)
P_GRID = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.92, 0.95, 0.97, 0.98, 0.99, 0.995)


class RowStats:
    def __init__(self, temperature: float | None = None, top_k: int = 0, top_p: float = 1.0, filtered: bool = True):
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.filtered = filtered and temperature is not None
        self._kept: list[np.ndarray] = []
        self._sens: list[np.ndarray] = []
        self._cum: list[np.ndarray] = []
        self._grid: list[np.ndarray] = []

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        z = logits.float()
        p = torch.softmax(z, dim=-1)
        px = p.gather(1, targets.view(-1, 1)).squeeze(1)
        sq = (p * p).sum(-1) - px * px
        self._sens.append(torch.sqrt((1 - px) ** 2 + sq.clamp_min(0)).double().cpu().numpy())
        if self.filtered:
            self._kept.append(log_kept_mass(z, self.temperature, self.top_k, self.top_p).double().cpu().numpy())
        pt = p if self.temperature in (None, 1.0) else torch.softmax(z / self.temperature, dim=-1)
        cum = torch.cumsum(pt.sort(dim=-1, descending=True).values, dim=-1)
        self._cum.append(cum[:, :TOP_CUM].cpu().numpy())
        grid = torch.tensor(P_GRID, dtype=cum.dtype, device=cum.device).expand(cum.shape[0], -1).contiguous()
        # vLLM keeps a token while the mass before it is < P: the kept head ends at the first cum >= P
        at = torch.searchsorted(cum, grid, side="left").clamp_max(cum.shape[1] - 1)
        self._grid.append(torch.log(cum.gather(1, at).clamp_max(1.0)).cpu().numpy())

    def take(self) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
        """(log kept mass or None, sensitivity, top cumulative probabilities [n, TOP_CUM], log kept mass
        per P of P_GRID [n, len(P_GRID)])."""
        kept = np.concatenate(self._kept) if self._kept else None
        sens = np.concatenate(self._sens) if self._sens else np.zeros(0)
        cum = np.concatenate(self._cum) if self._cum else np.zeros((0, TOP_CUM), np.float32)
        grid = np.concatenate(self._grid) if self._grid else np.zeros((0, len(P_GRID)), np.float32)
        self._kept, self._sens, self._cum, self._grid = [], [], [], []
        return kept, sens, cum, grid


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
