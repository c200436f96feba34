"""The n-gram draft proposer (prompt lookup, vLLM's `NgramProposer`). Pure Python: the scheduler calls it.

Contract: `ngram_drafts(tokens, k, n_max=3, n_min=1) -> list[int]`: the longest suffix of `tokens`
(n_max down to n_min tokens) that also occurs earlier in `tokens`, and up to `k` tokens that followed
its most recent earlier occurrence; [] when no suffix recurs. The drafts are a guess the verify pass
checks: a wrong guess costs compute, never correctness (the rejection sampler keeps the output
distribution), so the proposer needs no model and no probabilities (its draft distribution is one-hot).
"""

from __future__ import annotations


def ngram_drafts(tokens: list[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    size = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []
