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
    Works on N rows at once; callers bound N."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.view(-1, 1)).squeeze(1)
    rank = (logp > chosen.unsqueeze(1)).sum(dim=1) + 1
    entropy = -(logp.exp() * logp).nan_to_num().sum(dim=1)  # 0 * -inf from masked logits counts as 0
    top_lp, top_ids = logp.topk(max(k, 1), dim=-1)
    return chosen, top_ids, top_lp, rank, entropy
