"""Reference rescorer: one teacher-forced pass of a plain HF model over prompt + output ids.

For each output position it reports the logprob of the engine's token, its rank (1 = argmax),
the entropy, the top-1 and the top-k, as a `reference` Arrow table; for items that ask
(`ScoreItem.score_prompt`), the prompt positions 1..P-1 too (the logprob of prompt token p given the
tokens before it), as a `prompt_reference` table from the same pass (`score_all` yields both). Memory contract: it never holds
float32 logits of shape [batch, seq, vocab]. Sequences are sorted by length and packed under a token
budget (padding counted); the base model returns hidden states; only the rows that predict output
tokens are projected to the vocabulary, `chunk_rows` rows at a time, with log_softmax in float32.

The head (hidden -> logits) is rebuilt from the model's output embeddings plus the known post-ops
(Granite's `logits_scaling`, Gemma's final soft-capping), and checked once against the model's own
forward on a probe, so a head this module does not understand fails loudly instead of scoring wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa
import torch

from lpf.errors import LpfError
from lpf.model_specs import ModelRef, tokenizer_fingerprint
from lpf.run import schema
from lpf.torch_utils import logprob_rows, max_context, quiet_transformers, torch_dtype


def list_column(matrix: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """An [N, k] matrix as an Arrow list column (k may be 0)."""
    n, k = matrix.shape
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * k)
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.ravel(), type=value_type))


@dataclass(frozen=True)
class ScoreItem:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    score_prompt: bool = False  # also score prompt positions 1..P-1


@dataclass(frozen=True)
class Scored:
    """One batch's scores: output positions, and prompt positions of the items that asked (else None)."""

    reference: pa.Table
    prompt_reference: pa.Table | None


class Rescorer:
    def __init__(self, model: ModelRef, dtype: str = "float32", device: str = "cpu",
                 token_budget: int = 16384, chunk_rows: int = 256, topk: int = 5):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        quiet_transformers()
        self.model_ref = model
        self.dtype = dtype
        self.device = device
        self.token_budget = token_budget
        self.chunk_rows = chunk_rows
        self.topk = topk
        self.tokenizer = AutoTokenizer.from_pretrained(model.path)
        self.model = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch_dtype(dtype)).to(device).eval()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_context = max_context(self.model.config)
        self._check_head()

    def describe(self) -> dict:
        import transformers

        return {**self.model_ref.describe(), "dtype": self.dtype, "implementation": f"transformers {transformers.__version__}",
                "tokenizer_sha256": tokenizer_fingerprint(self.tokenizer)}

    # -- the head ----------------------------------------------------------------------------------
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        # a model may keep its residual stream wider than its weights (Mamba2's residual_in_fp32): the
        # head computes in its own dtype, as the model's own forward does
        logits = head(hidden.to(head.weight.dtype))
        cfg = self.model.config
        scaling = getattr(cfg, "logits_scaling", None)
        if scaling not in (None, 1, 1.0):
            logits = logits / scaling
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _check_head(self) -> None:
        probe = torch.arange(1, 9, device=self.device).remainder(self.vocab_size).view(1, -1)
        with torch.inference_mode():
            full = self.model(input_ids=probe).logits.float()
            ours = self._logits(self.model.base_model(input_ids=probe).last_hidden_state).float()
        err = (full - ours).abs().max().item()
        if not err <= 1e-3 * max(1.0, full.abs().max().item()):
            raise LpfError(f"reference model {self.model_ref.spec}: its output head does more than this "
                           f"rescorer knows (mismatch {err:.3g}); architecture {type(self.model).__name__} is not supported")

    # -- scoring -----------------------------------------------------------------------------------
    def batches(self, items: list[ScoreItem]) -> list[list[ScoreItem]]:
        """Sort by length and pack so that batch_size * longest <= token_budget (padding counted)."""
        items = sorted((it for it in items if it.output_token_ids),
                       key=lambda it: len(it.prompt_token_ids) + len(it.output_token_ids))
        out, cur = [], []
        for it in items:
            length = len(it.prompt_token_ids) + len(it.output_token_ids)
            if cur and (len(cur) + 1) * length > self.token_budget:
                out.append(cur)
                cur = []
            cur.append(it)
        if cur:
            out.append(cur)
        return out

    def validate(self, it: ScoreItem) -> None:
        length = len(it.prompt_token_ids) + len(it.output_token_ids)
        if self.max_context is not None and length > self.max_context:
            raise LpfError(f"request {it.request_id}: {length} tokens exceed the reference context {self.max_context}")
        ids = it.prompt_token_ids + it.output_token_ids
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise LpfError(f"request {it.request_id}: token id outside the reference vocabulary (0..{self.vocab_size - 1})")

    def score_batch(self, batch: list[ScoreItem]) -> pa.Table:
        return self.score_batch_all(batch).reference

    @torch.inference_mode()
    def score_batch_all(self, batch: list[ScoreItem]) -> Scored:
        for it in batch:
            self.validate(it)
        lengths = [len(it.prompt_token_ids) + len(it.output_token_ids) for it in batch]
        width = max(lengths)
        # Right padding: causal attention and the causal scan never let later (pad) positions
        # touch earlier ones, so no mask is needed and the scored positions are exact.
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for row, it in enumerate(batch):
            ids[row, :lengths[row]] = torch.tensor(it.prompt_token_ids + it.output_token_ids)
        hidden = self.model.base_model(input_ids=ids.to(self.device)).last_hidden_state
        rows, targets = [], []
        for row, it in enumerate(batch):
            p, o = len(it.prompt_token_ids), len(it.output_token_ids)
            rows.append(hidden[row, p - 1:p - 1 + o])
            targets.extend(it.output_token_ids)
        asked = [(row, it) for row, it in enumerate(batch) if it.score_prompt and len(it.prompt_token_ids) > 1]
        for row, it in asked:  # row q predicts prompt token q + 1
            rows.append(hidden[row, :len(it.prompt_token_ids) - 1])
            targets.extend(it.prompt_token_ids[1:])
        h = torch.cat(rows)
        tgt = torch.tensor(targets, device=self.device)
        del hidden
        parts = [logprob_rows(self._logits(h[i:i + self.chunk_rows]), tgt[i:i + self.chunk_rows], self.topk)
                 for i in range(0, h.shape[0], self.chunk_rows)]
        cols = [torch.cat([p[j] for p in parts]).cpu() for j in range(5)]
        n_out = sum(len(it.output_token_ids) for it in batch)
        reference = self._table([c[:n_out] for c in cols], [it.request_id for it in batch],
                                [np.arange(len(it.output_token_ids)) for it in batch])
        prompt = None
        if asked:
            prompt = self._table([c[n_out:] for c in cols], [it.request_id for _, it in asked],
                                 [np.arange(1, len(it.prompt_token_ids)) for _, it in asked])
        return Scored(reference, prompt)

    def _table(self, cols, request_ids: list[str], positions: list[np.ndarray]) -> pa.Table:
        """Reference columns of consecutive rows: request i has len(positions[i]) rows at those positions."""
        chosen, top_ids, top_lp, rank, entropy = cols
        k = self.topk
        return pa.table({
            "request_id": pa.array(np.repeat(request_ids, [len(p) for p in positions])),
            "position": pa.array(np.concatenate(positions).astype(np.int32)),
            "ref_logprob": pa.array(chosen.double().numpy()),
            "ref_rank": pa.array(rank.int().numpy()),
            "ref_entropy": pa.array(entropy.float().numpy()),
            "ref_top1_id": pa.array(top_ids[:, 0].int().numpy()),
            "ref_top1_logprob": pa.array(top_lp[:, 0].double().numpy()),
            "ref_topk_ids": list_column(top_ids[:, :k].int().numpy(), pa.int32()),
            "ref_topk_logprobs": list_column(top_lp[:, :k].float().numpy(), pa.float32()),
        }, schema=schema.REFERENCE)

    def score(self, items: list[ScoreItem], on_tokens: Callable[[int], None] | None = None) -> Iterable[pa.Table]:
        """Output positions only, one table per batch."""
        for scored in self.score_all(items, on_tokens):
            yield scored.reference

    def score_all(self, items: list[ScoreItem], on_tokens: Callable[[int], None] | None = None) -> Iterable[Scored]:
        """Output positions and the asked prompt positions, per batch; `on_tokens` counts output positions."""
        for batch in self.batches(items):
            scored = self.score_batch_all(batch)
            if on_tokens:
                on_tokens(scored.reference.num_rows)
            yield scored
