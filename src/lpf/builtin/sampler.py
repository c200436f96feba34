"""Sampling for the built-in engine: greedy or temperature / top-k / top-p with per-request seeds.

Every sample draws from its own generator seeded by (request seed, output position), so a request's
tokens do not depend on what else is in the batch or on preemption. Reported logprobs are RAW
(log_softmax of the model's logits, before temperature and filtering) unless `processed=True`, in
which case they come from the distribution actually sampled from (vLLM's "processed_logprobs").
Penalties (`SamplingParams.repetition_penalty` / `presence_penalty` / `frequency_penalty`, vLLM's
semantics: `penalize`) change the logits a token is chosen from, before greedy or temperature; the
raw logprobs reported stay the model's.
"""

from __future__ import annotations

import torch

from lpf.builtin.sched_output import Sample, ScheduledRequest
from lpf.core.sampling import request_seed
from lpf.core.torch_utils import logprob_rows


def penalize(z: torch.Tensor, r: ScheduledRequest) -> torch.Tensor:
    """One request's logits [V] after its penalties (a new tensor): the repetition penalty over
    tokens in the prompt or the output (a positive logit divided by it, a negative one multiplied),
    then presence and frequency penalties over tokens in the output."""
    s = r.sampling
    z = z.clone()
    if s.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.seen_prompt) | set(r.seen_output)), dtype=torch.long, device=z.device)
        if seen.numel():
            v = z[seen]
            z[seen] = torch.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
    if r.seen_output and (s.presence_penalty or s.frequency_penalty):
        counts = torch.bincount(torch.tensor(r.seen_output, dtype=torch.long), minlength=z.shape[-1]).to(z)
        z -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(z)
    return z


def processed_logits(z: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The logits actually sampled from: scaled by temperature, filtered by top-k then top-p."""
    z = z / temperature
    if top_k and top_k < z.shape[-1]:
        kth = z.topk(top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = z.sort(descending=True)
        probs = sorted_z.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        z = z.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return z


def sample(
    logits: torch.Tensor, reqs: list[ScheduledRequest], processed: bool = False, temperature: float | None = None
) -> dict[str, Sample]:
    """logits [N, V] for the N sampling requests -> {request_id: Sample}. `temperature` (the
    sampling-temperature drill) replaces every request's own, greedy ones included, and the
    reported logprobs come from z / temperature."""
    z = logits.float()
    chooser = z  # what tokens are chosen from: the logits after any request's penalties
    if any(r.sampling.penalized for r in reqs):
        chooser = torch.stack([penalize(z[i], r) if r.sampling.penalized else z[i] for i, r in enumerate(reqs)])
    temps = [r.sampling.temperature if temperature is None else temperature for r in reqs]
    greedy = [row for row, t in enumerate(temps) if t == 0]
    tokens: list[int | None] = [None] * len(reqs)
    if greedy:  # one argmax for every greedy row (the same first-maximum rule as a row's own argmax)
        rows = chooser if len(greedy) == len(reqs) else chooser[torch.tensor(greedy)]
        for row, tok in zip(greedy, rows.argmax(-1).tolist()):
            tokens[row] = tok
    proc_rows = [chooser[row] for row in range(len(reqs))] if processed else None
    for row, (r, t) in enumerate(zip(reqs, temps)):
        if t == 0:
            continue
        s = r.sampling
        pz = processed_logits(chooser[row], t, s.top_k, s.top_p)
        g = torch.Generator().manual_seed(request_seed(r.seed, r.output_position))
        tokens[row] = int(torch.multinomial(pz.softmax(-1), 1, generator=g))
        if processed:
            proc_rows[row] = pz
    source = torch.stack(proc_rows) if processed else (z if temperature is None else z / temperature)
    k = max((r.sampling.logprobs for r in reqs), default=0)
    chosen, top_ids, top_lp, _, _ = logprob_rows(source, torch.tensor(tokens), k)
    raw = None
    if processed:  # what raw logprobs would have said: the drill's ground truth, never reported
        raw = logprob_rows(z if temperature is None else z / temperature, torch.tensor(tokens), 0)[0].tolist()
    chosen, top_ids, top_lp = chosen.tolist(), top_ids.tolist(), top_lp.tolist()  # one conversion each
    out = {}
    for row, r in enumerate(reqs):
        kk = r.sampling.logprobs
        out[r.request_id] = Sample(
            tokens[row],
            chosen[row],
            top_ids[row][:kk],
            top_lp[row][:kk],
            None if raw is None else raw[row],
        )
    return out
