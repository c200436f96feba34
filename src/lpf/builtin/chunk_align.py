"""Where a prefill chunk may end when Mamba state is checkpointed at block boundaries (align mode).

Pure integer rules, no torch (the scheduler calls them). In vLLM's `mamba_cache_mode="align"` the
state is saved where a chunk ends, in the checkpoint block of the chunk's last token, and every full
block is later hashed as the state at exactly its end: so a chunk must end on a block boundary
unless it is the prompt's last chunk (whose block decodes carry on to the boundary).

`aligned_chunk` is the rule as vLLM runs it today (`Scheduler._mamba_block_aligned_split`, with
#51113's fix, no EAGLE): a chunk that does not reach the end of what is known ends on the last
boundary it reaches; one that reaches no boundary gets 0 tokens this step, unless a whole block
could never fit in one step's budget (then it advances inside the block); and it stops at the
deepest boundary a resend could hit (`last_cache_position`, (num_tokens - 1) floored to a block)
and at the boundary after a mid-block start.

`pre_fix_chunk` is the rule before #45477 / #51113, as it ran with EAGLE on: chunks are aligned
only below `last_cache_position`, which the EAGLE prune backs off by one block (to 0 for prompts
shorter than two blocks); past it any chunk end is accepted, so a chunk that ends mid-block leaves
a state the block's hash will later claim covers the whole block (the `unaligned-chunk-hashed` drill).
A block wider than one step's budget advances inside the block, as in the fixed rule, but without
the fixed rule's stop at the next boundary: that stop is #51113's fix (a sub-block chunk that
crosses a boundary leaves the previous chunk's state in the block it crossed). Without the advance
the rule would schedule 0 tokens forever (a livelock, not the bug being re-created).

Both return the number of tokens to schedule (0: wait for more budget), given the chunk's start
(num_computed_tokens), the tokens the budget allows (`n`), the prompt length, the tokens known
(prompt + outputs), the Mamba block size and the most tokens one step can give a chunk.
"""

from __future__ import annotations


def prefill_end(num_prompt_tokens: int, num_tokens: int) -> int:
    """Where prefill ends: the prompt, or (a recompute after preemption) all but the last known token."""
    return max(num_prompt_tokens, num_tokens - 1)


def last_cache_position(num_tokens: int, block: int) -> int:
    """The deepest boundary a resend of these tokens can hit (hits leave one token to compute)."""
    return max(num_tokens - 1, 0) // block * block


def aligned_chunk(start: int, n: int, num_prompt_tokens: int, num_tokens: int, block: int, max_chunk: int) -> int:
    end_of_prefill = prefill_end(num_prompt_tokens, num_tokens)
    if start >= end_of_prefill or n <= 0:
        return n
    end = start + n
    if end < end_of_prefill:  # not the last chunk: end on a boundary
        aligned = end // block * block
        if aligned > start or block <= max_chunk:
            end = aligned
    stops = (((start // block) + 1) * block if start % block else 0, last_cache_position(num_tokens, block))
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def pre_fix_chunk(start: int, n: int, num_prompt_tokens: int, num_tokens: int, block: int, max_chunk: int) -> int:
    if start >= prefill_end(num_prompt_tokens, num_tokens) or n <= 0:
        return n
    last = max(num_tokens - num_tokens % block - block, 0)  # EAGLE's prune backs it off one block
    end = start + n
    if end < last:
        whole = n // block * block
        return whole if whole or block <= max_chunk else n
    if start < last < end:
        return last - start
    return n  # past last_cache_position: any end is accepted
