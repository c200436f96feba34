"""Small torch helpers shared by the HF engine and the reference rescorer (imports torch)."""

from __future__ import annotations

import os

import torch

from lpf.errors import LpfError, did_you_mean


def quiet_transformers() -> None:
    """No hub access (there is none to have) and no per-load progress bars or kernel-fallback chatter:
    lpf draws its own progress, and the pure-PyTorch Mamba fallback on CPU is expected."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise LpfError(f"unknown dtype {name!r}{did_you_mean(name, DTYPES)}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def max_context(config) -> int | None:
    """The longest sequence the model was configured for, when the config says."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def logprob_rows(logits: torch.Tensor, token_ids: torch.Tensor, k: int):
    """For rows of logits [N, V] and chosen tokens [N]: float32 logprobs of the tokens, the top
    max(k, 1) ids and logprobs (column 0 is the argmax), ranks (1 = argmax), entropies.

    This is the hot loop of rescoring, so it makes three passes over [N, V] instead of six: top-k,
    softmax, and one dot product. log-sum-exp comes from the argmax's softmax value
    (lse = z_max - log p_max, exact to float32 rounding since p_max >= 1/V), every logprob is z - lse,
    entropy is lse - sum(p * z), and the rank is read off the top-k unless the token lies outside it
    (rare for an engine's own tokens), where the larger logits are counted. Callers bound N.
    """
    z = logits.float()
    top_z, top_ids = z.topk(max(k, 1), dim=-1)
    p = torch.softmax(z, dim=-1)
    lse = top_z[:, 0] - torch.log(p.gather(1, top_ids[:, :1]).squeeze(1))
    z_tok = z.gather(1, token_ids.view(-1, 1)).squeeze(1)
    entropy = lse - torch.linalg.vecdot(p, z)
    masked = entropy.isnan()  # -inf logits: 0 * -inf; those terms contribute 0
    if masked.any():
        zm, pm = z[masked], p[masked]
        entropy[masked] = lse[masked] - torch.where(pm > 0, pm * zm, torch.zeros_like(zm)).sum(1)
    rank = (top_z > z_tok.unsqueeze(1)).sum(1) + 1
    outside = z_tok < top_z[:, -1]
    if outside.any():
        rank[outside] = (z[outside] > z_tok[outside].unsqueeze(1)).sum(1) + 1
    return z_tok - lse, top_ids, top_z - lse.unsqueeze(1), rank, entropy
