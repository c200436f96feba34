"""The rejection sampler of speculative decoding (vLLM's `RejectionSampler`), one request at a time.

Contract: `verify_tokens(z [1 + k, V], s, draft_probs=None) -> (tokens, accepted)`. Row i of `z` holds
the raw logits after the request's last sampled token and its first i drafts (`s.draft_token_ids`);
`tokens` are the accepted drafts, then one more token (the bonus token when every draft was accepted,
else the token drawn in place of the first rejected draft), and `accepted` is how many drafts were
kept (len(tokens) - 1).

- Greedy (temperature 0): a draft is kept while it is the row's argmax (the first maximum, as the plain
  sampler picks it); the next row's argmax follows. The tokens are the ones decoding one at a time gives.
- Sampled: draft d at row i is kept with probability min(1, p(d) / q(d)), p the row's distribution after
  temperature / top-k / top-p, q the proposer's (`draft_probs[i]`; None: one-hot at d, an n-gram
  proposer's, so the test is u < p(d)); a rejected draft is replaced by a draw from the residual
  max(0, p - q) renormalised, and the step ends there. Every emitted token is then distributed exactly as
  p (Leviathan et al. 2023), whatever q is. Each position draws from its own generator seeded by
  (request seed, output position), as the plain sampler does, so the bonus token after all drafts were
  kept is the token decoding one at a time would have drawn there.
Penalized requests never speculate (the scheduler gives them no drafts): their chooser changes with
every token kept.
"""

from __future__ import annotations

import torch

from lpf.builtin.sampler import processed_logits
from lpf.builtin.sched_output import ScheduledRequest
from lpf.core.sampling import request_seed


def verify_tokens(
    z: torch.Tensor, s: ScheduledRequest, draft_probs: torch.Tensor | None = None
) -> tuple[list[int], int]:
    drafts = list(s.draft_token_ids)
    k = len(drafts)
    sp = s.sampling
    if sp.temperature == 0:
        target = z.argmax(-1).tolist()
        a = 0
        while a < k and target[a] == drafts[a]:
            a += 1
        return drafts[:a] + [target[a]], a
    tokens: list[int] = []
    for i in range(k + 1):
        p = processed_logits(z[i].float(), sp.temperature, sp.top_k, sp.top_p).softmax(-1)
        g = torch.Generator().manual_seed(request_seed(s.seed, s.output_position + i))
        if i == k:  # every draft kept: the bonus token, drawn as a plain sample is
            tokens.append(int(torch.multinomial(p, 1, generator=g)))
            return tokens, k
        d = drafts[i]
        q = torch.zeros_like(p).index_fill_(0, torch.tensor([d]), 1.0) if draft_probs is None else draft_probs[i]
        u = float(torch.rand(1, generator=g, dtype=torch.float64))
        if float(q[d]) > 0 and u < min(1.0, float(p[d]) / float(q[d])):
            tokens.append(d)
            continue
        residual = (p - q.to(p)).clamp_min(0)
        tokens.append(int(torch.multinomial(residual / residual.sum(), 1, generator=g)))
        return tokens, i
    raise AssertionError("unreachable")  # the loop returns at i == k at the latest
