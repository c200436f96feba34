"""The simulated trainer of `lpf rl simulate`: the float32 HF reference as the trainer's forward, fed
in micro-batches, with the micro-batch drill's batch-shape-dependent LM head.

Contract: `SimTrainer(model_ref, micro_batch_tokens, batch_variant)`; `score_step(items, exact=False)`
returns ({request_id: logprobs of its output tokens}, {request_id: (micro_batch, size, padded tokens)}).
The step's sequences are cut, in arrival order, into micro-batches of at most `micro_batch_tokens`
padded tokens (dynamic batch size, as verl's use_dynamic_bsz / NeMo-RL's dynamic batching pack
them); each micro-batch is one padded forward. Under `batch_variant` the head computes
hidden @ W^T as a split-K reduction with one split per sequence of the micro-batch, every partial
logit rounded to bfloat16 before the float32 sum (a GEMM heuristic that picks its split from the
batch shape): a micro-batch of one is the exact float32 head, larger ones err more. `exact=True`
scores without the drill (the ground truth's batch-invariant trainer). `set_weights` syncs the
drifted policy's weights in (`lpf.rl.policy`).
"""

from __future__ import annotations

import torch

from lpf.pipeline.reference import Rescorer, ScoreItem

MAX_SPLITS = 8


class SimTrainer(Rescorer):
    def __init__(self, model_ref, micro_batch_tokens: int = 96, batch_variant: bool = False):
        self._splits = 1  # before Rescorer's own head check, which calls _logits
        super().__init__(model_ref, dtype="float32", topk=1)
        self.micro_batch_tokens = micro_batch_tokens
        self.batch_variant = batch_variant

    def _logits(self, hidden, out=None, native=False):
        if native or self._splits <= 1:
            return super()._logits(hidden, out=out, native=native)
        h = hidden.shape[-1]
        edges = [round(i * h / self._splits) for i in range(self._splits + 1)]
        total = None
        for lo, hi in zip(edges, edges[1:]):
            masked = torch.zeros_like(hidden)
            masked[:, lo:hi] = hidden[:, lo:hi]  # the head is linear: the masked input is its split
            part = super()._logits(masked).to(torch.bfloat16).float()
            total = part if total is None else total + part
        if out is not None:
            out.copy_(total)
            return out
        return total

    def micro_batches(self, items: list[ScoreItem]) -> list[list[ScoreItem]]:
        out, cur, width = [], [], 0
        for it in items:
            n = len(it.prompt_token_ids) + len(it.output_token_ids)
            if cur and (len(cur) + 1) * max(width, n) > self.micro_batch_tokens:
                out.append(cur)
                cur, width = [], 0
            cur.append(it)
            width = max(width, n)
        if cur:
            out.append(cur)
        return out

    def score_step(self, items: list[ScoreItem], exact: bool = False):
        logprobs, layout = {}, {}
        for mb, batch in enumerate(self.micro_batches(items)):
            width = max(len(it.prompt_token_ids) + len(it.output_token_ids) for it in batch)
            self._splits = min(len(batch), MAX_SPLITS) if self.batch_variant and not exact else 1
            try:
                table = self.score_batch(batch)
            finally:
                self._splits = 1
            for rid, lp in zip(table.column("request_id").to_pylist(), table.column("ref_logprob").to_pylist()):
                logprobs.setdefault(rid, []).append(lp)  # positions arrive in order within a request
            for it in batch:
                layout[it.request_id] = (mb, len(batch), len(batch) * width)
        return logprobs, layout

    def state_keys(self) -> set[str]:
        return set(dict(self.model.named_parameters()))

    def set_weights(self, weights: dict) -> None:
        from lpf.rl.policy import PolicyDrift

        PolicyDrift.load_into(self.model, weights)
