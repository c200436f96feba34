"""The draft-model proposer of speculative decoding (vLLM's speculative_config method draft_model): a
smaller model with the target's vocabulary proposes K tokens and the distributions it drew them from.

Contract: `DraftProposer(spec, vocab_size, device="cpu")` loads model `spec` (a zoo:, tiny: or directory
spec, lpf.core.model_specs) with HF transformers in float32; a vocabulary other than the target's is
refused (`LpfError`, one line). `propose([(req, k), ...]) -> [drafts, ...]` is the scheduler's proposer
(the decoding requests of one step and the drafts each may verify: one batch); `probs(request_id)` is
then the [k, V] float32 rows q that request's drafts were drawn from (None for a greedy request: its
verify compares argmaxes only), which the rejection sampler (`speculative_sampler.verify_tokens`) needs to keep
the target's distribution exact. A prefix of the drafts is valid with the same prefix of the rows.
- Greedy request (temperature 0): draft i is the draft model's argmax after the context and drafts < i.
- Sampled: draft i is drawn from q_i, the draft's distribution after the request's temperature, top-k
  and top-p, with a generator seeded by (request seed, output position) and a salt of its own, so the
  draft's randomness is independent of the verify pass's draws at the same positions.
An attention-only draft runs the step's requests as one left-padded batch (position ids from the mask):
their contexts once, then one token per row for each further draft (the step's KV cache); a draft with
recurrent layers runs each request alone, its context and drafts again for every draft (padding would pass
through its state). No cache is kept between steps: nothing to roll back.
"""

from __future__ import annotations

import torch

from lpf.builtin.sampler import processed_logits
from lpf.core.errors import LpfError
from lpf.core.sampling import request_seed

DRAFT_SALT = 0x5D1A  # the draft's draws are seeded apart from the verify pass's


class DraftProposer:
    def __init__(self, spec: str, vocab_size: int, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        from lpf.core.model_specs import resolve_model
        from lpf.core.torch_utils import quiet_transformers

        quiet_transformers()
        ref = resolve_model(spec)
        self.model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32).to(device).eval()
        vocab = self.model.config.vocab_size
        if vocab != vocab_size:
            raise LpfError(
                f"draft model {spec} has a vocabulary of {vocab} tokens, the target {vocab_size}: a draft must "
                f"share the target's tokenizer"
            )
        self.spec, self.device = spec, device
        layer_types = getattr(self.model.config, "layers_block_type", None) or []
        self.attention_only = self.model.config.model_type == "llama" or (
            bool(layer_types) and all(t == "attention" for t in layer_types)
        )
        self._probs: dict[str, torch.Tensor | None] = {}

    def probs(self, request_id: str) -> torch.Tensor | None:
        return self._probs.get(request_id)

    @torch.inference_mode()
    def propose(self, asks: list[tuple[object, int]]) -> list[list[int]]:
        self._probs = {}
        if not asks:
            return []
        groups = [asks] if self.attention_only else [[a] for a in asks]
        out = {}
        for group in groups:
            for (req, _), drafts in zip(group, self._batch(group)):
                out[req.request_id] = drafts
        return [out[req.request_id] for req, _ in asks]

    def _batch(self, asks) -> list[list[int]]:
        seqs = [list(req.prompt_token_ids) + list(req.output_token_ids) for req, _ in asks]
        drafts: list[list[int]] = [[] for _ in asks]
        rows: list[list[torch.Tensor]] = [[] for _ in asks]
        state = None
        for i in range(max(k for _, k in asks)):
            logits, state = self._next_logits(seqs, state)
            for j, (req, k) in enumerate(asks):
                if i >= k:
                    continue
                sp = req.sampling
                if sp.temperature == 0:
                    d = int(logits[j].argmax())
                else:
                    q = processed_logits(logits[j].float(), sp.temperature, sp.top_k, sp.top_p).softmax(-1).cpu()
                    g = torch.Generator().manual_seed(
                        request_seed(req.seed ^ DRAFT_SALT, len(req.output_token_ids) + i)
                    )
                    d = int(torch.multinomial(q, 1, generator=g))
                    rows[j].append(q)
                drafts[j].append(d)
            for j, (_, k) in enumerate(asks):  # a row done drafting repeats its last token (never read)
                seqs[j].append(drafts[j][-1] if i < k else seqs[j][-1])
        for (req, _), r in zip(asks, rows):
            self._probs[req.request_id] = torch.stack(r) if r else None
        return drafts

    def _next_logits(self, seqs: list[list[int]], state):
        """([B, V] the draft's logits after each sequence, the state for the next call). The first call
        runs the left-padded contexts; an attention-only draft keeps their KV cache for the step, so each
        later call runs one token per row (the draft appended last)."""
        if state is None or not self.attention_only:
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for j, s in enumerate(seqs):
                ids[j, width - len(s) :] = torch.tensor(s)
                mask[j, width - len(s) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            cache = None
        else:
            cache, mask = state
            ids = torch.tensor([[s[-1]] for s in seqs])
            mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=torch.long)], dim=1)
            pos = torch.tensor([[len(s) - 1] for s in seqs])
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=pos.to(self.device),
            cache=cache,
            use_cache=self.attention_only,
            logits_to_keep=1,
        )
        return out.logits[:, -1], ((out.cache, mask) if self.attention_only else None)
