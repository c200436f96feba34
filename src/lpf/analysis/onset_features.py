"""Two token-level signatures of the bugs that live in a quantized KV cache, computed over the flagged requests only.

Contract: `onset_features(summary, requests, flagged, engine_info) -> (features, onset)`: the features (aligned to
`summary`, whose rows are `requests` sorted by `seq`) and findings' `shape.absolute_onset` ({position, n,
exact, of, prompt_lengths, blocks}, or None). Pure numpy/Arrow; the work is over the flagged requests'
first divergences and output ids, never a loop over tokens.

  positional_onset        the flagged requests depart from one absolute position P (prompt length + first
                          divergence: the first wrong token's position in prompt + output) whatever their
                          prompt length (at least MIN_ONSET of them, from at least 2 prompt lengths, and at
                          least EXACT_SHARE of the flagged requests whose prompt ended before P and whose
                          output reached it departed exactly there). Holds for every request with a token at P
                          or later (a prompt already past P reads the rows there from its first decode): a
                          clean request that reached P counts against it. P is tested against the block sizes
                          the engine info knows (`block_size`, the prefix cache's `mamba_block_size`): row P - 1
                          (the first row the token at P reads that its predecessor did not) starting a block,
                          P itself starting one, or neither. vllm#54035's signature: logprobs stop matching at
                          absolute position 97, whatever the prompt (a 96-token decode tile).
  collapsed_to_one_token  a flagged request whose output from its first divergence on is one repeated token id
                          (at least COLLAPSE_MIN tokens, COLLAPSE_SHARE of them the same id): an argmax collapsed
                          to one slot (NaN logits argmax to id 0: vllm PR #49818's NVFP4 KV). The phrase names
                          the id(s).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.feature import Feature
from lpf.analysis.verdicts import by_arrival

MIN_ONSET = 3
EXACT_SHARE = 0.8
COLLAPSE_MIN = 4
COLLAPSE_SHARE = 0.9


def onset_features(
    summary: pa.Table, requests: pa.Table, flagged: np.ndarray, engine_info: dict | None = None, least: int = MIN_ONSET
) -> tuple[list[Feature], dict | None]:
    """`least`: the flagged requests a signature needs (MIN_ONSET; `lpf shrink` asks a candidate of one
    request with 1, where the request's own onset is the position and one prompt length is all there is)."""
    idx = np.flatnonzero(flagged)
    if idx.size < min(2, least) or "first_divergence" not in summary.column_names:
        return [], None
    req = by_arrival(requests)
    if "prompt_token_ids" not in req.column_names:
        return [], None
    plen = pc.list_value_length(req.column("prompt_token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    n_out = summary.column("n_output_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    fd_col = summary.column("first_divergence").take(pa.array(idx))
    fd = fd_col.to_numpy(zero_copy_only=False).astype(np.float64)
    if fd_col.null_count:
        fd[np.asarray(fd_col.is_null().to_numpy(zero_copy_only=False), dtype=bool)] = np.nan
    feats, onset = [], None
    found = _onset(plen, n_out, idx, fd, least)
    if found is not None:
        onset = {**found, "blocks": _blocks(found["position"], engine_info or {})}
        p = found["position"]
        reached = plen + n_out - 1 >= p
        feats.append(
            Feature(
                "positional_onset",
                "bool",
                reached,
                f"reached absolute position {p}, where {found['n']} flagged requests of {found['prompt_lengths']} "
                f"prompt lengths departed ({found['exact']}/{found['of']} whose prompt ended before it departed "
                f"exactly there; {onset['blocks']})",
            )
        )
    collapsed = _collapsed(req, idx, fd, flagged.size, min(2, least))
    if collapsed is not None:
        feats.append(collapsed)
    return feats, onset


def _onset(plen: np.ndarray, n_out: np.ndarray, idx: np.ndarray, fd: np.ndarray, least: int) -> dict | None:
    ok = np.isfinite(fd)
    if ok.sum() < least:
        return None
    at = (plen[idx][ok] + fd[ok]).astype(np.int64)
    values, counts = np.unique(at, return_counts=True)
    p = int(values[np.argmax(counts)])
    there = at == p
    if there.sum() < least or np.unique(plen[idx][ok][there]).size < min(2, least):
        return None
    # the flagged requests that crossed P from a prompt that ended before it: each must depart exactly there
    crossed = (plen[idx] < p) & (plen[idx] + n_out[idx] - 1 >= p) & np.isfinite(fd)
    exact = crossed & (plen[idx] + np.nan_to_num(fd, nan=-1) == p)
    if exact.sum() < EXACT_SHARE * crossed.sum():
        return None
    return {
        "position": p,
        "n": int(there.sum()),
        "exact": int(exact.sum()),
        "of": int(crossed.sum()),
        "prompt_lengths": int(np.unique(plen[idx][ok][there]).size),
    }


def _blocks(p: int, engine_info: dict) -> str:
    """Position P against the block sizes the engine info knows, in words."""
    options = engine_info.get("options") or {}
    cache = (engine_info.get("cache") or {}).get("prefix_cache") or {}
    sizes = {"KV block size": options.get("block_size"), "Mamba block size": cache.get("mamba_block_size")}
    said = []
    for name, b in sizes.items():
        if not isinstance(b, int) or b < 2:
            continue
        if (p - 1) % b == 0:
            said.append(f"row {p - 1} = {(p - 1) // b} x {b} starts a block ({name} {b})")
        elif p % b == 0:
            said.append(f"position {p} = {p // b} x {b} starts a block ({name} {b})")
        else:
            said.append(f"not on a boundary of the {name} {b} ({p - 1} = {(p - 1) // b} x {b} + {(p - 1) % b})")
    return "; ".join(said) if said else "no block size known to test it against"


def _collapsed(req: pa.Table, idx: np.ndarray, fd: np.ndarray, n: int, least: int) -> Feature | None:
    if "output_token_ids" not in req.column_names:
        return None
    out = req.column("output_token_ids").take(pa.array(idx)).combine_chunks()
    if not pa.types.is_integer(getattr(out.type, "value_type", pa.null())):  # a reader that left the ids out
        return None
    ids = pc.list_flatten(out).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)  # -1: an id not kept
    if not ids.size:
        return None
    parent = pc.list_parent_indices(out).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = out.offsets.to_numpy()
    pos = np.arange(ids.size) - (offsets[parent] - offsets[0])
    after = pos >= np.nan_to_num(fd, nan=np.inf)[parent]
    parent, ids = parent[after], ids[after]
    if not parent.size:
        return None
    pairs, counts = np.unique(np.stack([parent, ids]), axis=1, return_counts=True)
    total = np.bincount(parent, minlength=idx.size)
    best = np.zeros(idx.size, dtype=np.int64)
    np.maximum.at(best, pairs[0], counts)
    which = np.full(idx.size, -1, dtype=np.int64)
    order = np.lexsort((-counts, pairs[0]))  # each request's most frequent id first
    firsts = order[np.r_[True, pairs[0][order][1:] != pairs[0][order][:-1]]]
    which[pairs[0][firsts]] = pairs[1][firsts]
    hit = (total >= COLLAPSE_MIN) & (best >= COLLAPSE_SHARE * np.maximum(total, 1))
    if hit.sum() < least:
        return None
    values = np.zeros(n, dtype=bool)
    values[idx[hit]] = True
    tokens, k = np.unique(which[hit], return_counts=True)
    named = ", ".join(f"{int(t)} ({int(c)})" for t, c in sorted(zip(tokens, k), key=lambda x: -x[1])[:3])
    one = f"one token id, {int(tokens[0])}, for all of them" if tokens.size == 1 else f"token ids {named}"
    return Feature(
        "collapsed_to_one_token",
        "bool",
        values,
        f"collapsed from their first divergence on to one repeated token ({one}): an argmax fixed on one id",
    )
