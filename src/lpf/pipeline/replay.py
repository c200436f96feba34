"""Seeded replay: the token the reference would have drawn with the engine's own sampler and the request's seed.

Token-DiFR's idea (arXiv 2511.20621): when the engine's sampler and its per-request seed are known, the
randomness of every draw is known too, so the reference can draw with the same randomness; an honest
engine then produces the same token except where its probabilities differ from the reference's by its
dtype's rounding. Contract: `replay_for(engine, sampling)` returns a `Replay` for a sampler lpf knows
exactly (an engine whose adapter says `seeded_replay`; None otherwise, with no guess); `Replay.draw(z, seeds, positions, tokens)` takes reference
logits [n, V] (float32) of n output positions, each request's seed, the positions and the engine's tokens
and returns numpy arrays: `token` (the reference's draw), `margin` (how far, in nats of log p - log q, the
engine's token was from being drawn: 0 when it was) and `runner_up` (how far the closest other token was
from winning). Known samplers:
  builtin   lpf's built-in engine (`lpf.builtin.sampler`): temperature, top-k then top-p on the logits,
            then torch.multinomial with a generator seeded by request_seed(seed, position); on CPU a
            one-sample multinomial is the race argmax(p / q), q ~ Exp(1) drawn from that generator
            (checked at construction on a probe: a torch whose multinomial draws otherwise gets no replay).
vLLM's CPU sampler (a per-step seed from the request's generator, then a hashed Gumbel race in its C++
kernel) is not replayed: see docs/real-engines.md.
"""

from __future__ import annotations

import numpy as np
import torch

from lpf.core.sampling import request_seed


class Replay:
    kind = "builtin"

    def __init__(self, sampling: dict):
        from lpf.builtin.sampler import processed_logits

        self.processed = processed_logits
        self.temperature = float(sampling.get("temperature") or 0.0)
        self.top_k, self.top_p = int(sampling.get("top_k") or 0), float(sampling.get("top_p") or 1.0)
        probe = torch.softmax(torch.linspace(-3, 3, 97), 0)
        for seed in range(64):
            drawn = int(torch.multinomial(probe, 1, generator=torch.Generator().manual_seed(seed)))
            q = torch.empty(97).exponential_(generator=torch.Generator().manual_seed(seed))
            if drawn != int((probe / q).argmax()):
                raise RuntimeError("this torch's multinomial is not the exponential race lpf replays")

    def draw(self, z: torch.Tensor, seeds: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> dict:
        n = z.shape[0]
        out = {"token": np.zeros(n, np.int32), "margin": np.zeros(n), "runner_up": np.zeros(n)}
        for i in range(n):
            pz = self.processed(z[i].float(), self.temperature, self.top_k, self.top_p)
            probs = pz.softmax(-1)
            g = torch.Generator().manual_seed(request_seed(int(seeds[i]), int(positions[i])))
            q = torch.empty(probs.shape[0], dtype=probs.dtype).exponential_(generator=g)
            score = torch.log(probs) - torch.log(q)
            best2 = score.topk(2)
            won = int(best2.indices[0])
            out["token"][i] = won
            out["runner_up"][i] = float(best2.values[0] - best2.values[1])
            mine = float(score[int(tokens[i])])
            out["margin"][i] = float(best2.values[0]) - mine if np.isfinite(mine) else np.inf
        return out


def replay_for(engine: str, sampling: dict) -> Replay | None:
    """The replay of this engine's sampler, when the run sampled (greedy needs none) and lpf knows it."""
    from lpf.adapters import capability

    if not capability(engine, "seeded_replay", False) or not (sampling.get("temperature") or 0):
        return None
    try:
        return Replay(sampling)
    except RuntimeError:
        return None
