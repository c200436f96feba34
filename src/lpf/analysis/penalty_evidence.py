"""The evidence a server penalty is fitted on: the informative positions of a greedy run, and whether each
candidate penalty value keeps the engine's token the argmax there.

Contract (pure: Arrow tables in, numpy out; `lpf.analysis.penalties` fits and names the penalty):
- `evidence(tokens, reference, requests, n_rows, tie) -> dict | None`: per scored position where some
  candidate had been seen (the only ones a penalty can change), the candidates' raw logits [P, K+1]
  (column 0 the engine's token) and, per candidate, whether it was in the context, in its last LAST_N
  tokens, in the output, and how often in the output; `stray`: the requests with a greedy flip where no
  candidate had been seen. At most MAX_POSITIONS positions (a bigger run: every k-th request).
- `agreement(ev, mech, scope, grid, tie)` -> [positions, grid] bool: the engine's token is the penalised
  argmax (within `tie`); `fine_agreement` the same over a fine grid, computed COARSE times coarser first.
- `request_stride(n_rows)`: which requests a run of `n_rows` scored rows is fitted on.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.columns import one_array

LAST_N = 64  # llama.cpp's penalty_last_n default
COARSE = 8  # the first pass's grid step, in fine steps
MAX_POSITIONS = 50_000  # informative positions fitted (a bigger run: an even sample of its requests)
_CHUNK = 2048  # positions per block of the [positions, candidates, grid] arrays


def _padded(col, width: int, fill, dtype) -> np.ndarray:
    """A list column as an [N, width] matrix (short lists padded with `fill`)."""
    arr = one_array(col)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    vals = arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    lens = np.diff(offsets)
    if lens.size and np.all(lens == width):
        return vals.reshape(-1, width).astype(dtype)
    out = np.full((len(arr), width), fill, dtype=dtype)
    at = np.arange(vals.size) - np.repeat(offsets[:-1] - offsets[0], lens)  # index within its list
    keep = at < width
    out[np.repeat(np.arange(len(arr)), lens)[keep], at[keep]] = vals[keep]
    return out


def request_stride(n_rows: int) -> int:
    """A run of `n_rows` scored rows with a log-sum-exp is fitted on the requests whose row in the
    requests table is a multiple of this (1: every request)."""
    return -(-n_rows // (4 * MAX_POSITIONS)) if n_rows > 4 * MAX_POSITIONS else 1


def evidence(
    tokens: pa.Table, reference: pa.Table, requests: pa.Table, n_rows: int | None = None, tie: float = 0.0
) -> dict | None:
    """Per scored position where some candidate had been seen (the only ones a penalty can change):
    candidates' raw logits [P, K+1] (column 0 the engine's token; a top-k entry equal to it is masked
    with -inf) and, per candidate, whether it was in the context, in its last LAST_N tokens, in the
    output, and how often in the output; `stray`: the requests with a greedy flip (past `tie`) where no
    candidate had been seen, which no penalty explains."""
    lse_col = reference.column("ref_logsumexp")
    if lse_col.null_count == len(lse_col):  # no raw-logit offset anywhere: no position to join (a 20M-row join)
        return None
    keys = pa.table(
        {
            "request_id": reference.column("request_id"),
            "position": reference.column("position"),
            "_row": pa.array(np.arange(reference.num_rows, dtype=np.int64)),
        }
    ).filter(pc.is_valid(reference.column("ref_logsumexp")))
    # Arrow joins carry no list columns: join the row numbers, then take the reference's rows by them
    t = tokens.select(["request_id", "position", "token_id"]).join(keys, ["request_id", "position"])
    req_row = pc.index_in(t.column("request_id"), value_set=requests.column("request_id")).to_numpy(
        zero_copy_only=False
    )
    if not t.num_rows:
        return None
    stride = request_stride(t.num_rows if n_rows is None else n_rows)
    if stride > 1:  # a big run: an even sample of whole requests before any [rows, k] array
        keep = req_row % stride == 0
        t, req_row = t.filter(pa.array(keep)), req_row[keep]
    ref = reference.take(t.column("_row"))
    k = int(pc.max(pc.list_value_length(ref.column("ref_topk_ids"))).as_py() or 0)
    if k == 0:
        return None
    tid = t.column("token_id").to_numpy().astype(np.int64)
    cand = np.concatenate([tid[:, None], _padded(ref.column("ref_topk_ids"), k, -1, np.int64)], axis=1)
    lse = ref.column("ref_logsumexp").to_numpy(zero_copy_only=False).astype(np.float64)
    lp = np.concatenate(
        [
            ref.column("ref_logprob").to_numpy(zero_copy_only=False).astype(np.float64)[:, None],
            _padded(ref.column("ref_topk_logprobs"), k, -np.inf, np.float64),
        ],
        axis=1,
    )
    lp[:, 1:][(cand[:, 1:] == tid[:, None]) | (cand[:, 1:] < 0)] = -np.inf
    # every request's prompt + output as sorted keys (request, token, index): occurrences by binary search
    prompts = one_array(requests.column("prompt_token_ids"))
    outputs = one_array(requests.column("output_token_ids"))
    plen = np.diff(prompts.offsets.to_numpy()).astype(np.int64)
    olen = np.diff(outputs.offsets.to_numpy()).astype(np.int64)
    n_req = requests.num_rows
    span = int((plen + olen).max(initial=0)) + 1
    vocab = int(max(cand.max(initial=0), _max(prompts), _max(outputs))) + 1
    r_p = np.repeat(np.arange(n_req), plen)
    r_o = np.repeat(np.arange(n_req), olen)
    i_p = np.arange(r_p.size) - np.repeat(prompts.offsets.to_numpy()[:-1] - prompts.offsets.to_numpy()[0], plen)
    i_o = np.arange(r_o.size) - np.repeat(outputs.offsets.to_numpy()[:-1] - outputs.offsets.to_numpy()[0], olen)
    tok_p = _values(prompts)
    tok_o = _values(outputs)
    occ = np.sort(
        np.concatenate(
            [
                (r_p * vocab + tok_p) * span + i_p,
                (r_o * vocab + tok_o) * span + plen[r_o] + i_o,
            ]
        )
    )
    ok = req_row >= 0
    rr = np.where(ok, req_row, 0).astype(np.int64)
    pos = t.column("position").to_numpy().astype(np.int64)
    ctx = plen[rr] + pos  # the context before this position
    base = (rr[:, None] * vocab + np.maximum(cand, 0)) * span
    first = np.searchsorted(occ, base)
    before = np.searchsorted(occ, base + ctx[:, None]) - first
    in_prompt = np.searchsorted(occ, base + plen[rr][:, None]) - first
    last = np.where(before > 0, occ[np.maximum(first + before - 1, 0)] - base, -1)
    valid = np.isfinite(lp) & ok[:, None]
    context = (before > 0) & valid
    informative = context.any(axis=1)
    n_inf = int(informative.sum())
    if n_inf == 0:
        return None
    stray_rows = np.flatnonzero(ok & ~informative & (lp[:, 0] < lp[:, 1:].max(axis=1, initial=-np.inf) - tie))
    stray = set(t.column("request_id").take(pa.array(stray_rows)).to_pylist())
    if n_inf > MAX_POSITIONS:  # a big run: every k-th request (whole requests, so the counts stay per request)
        dense = np.unique(rr, return_inverse=True)[1]  # the requests left, numbered 0.. (after any sample above)
        informative &= dense % -(-n_inf // MAX_POSITIONS) == 0
    sel = np.flatnonzero(informative)
    count = np.maximum(before - in_prompt, 0)
    return {
        "request_id": t.column("request_id").take(pa.array(sel)).to_pylist(),
        "logit": (lp + lse[:, None])[sel],
        "context": context[sel],
        "last64": (context & (last >= ctx[:, None] - LAST_N))[sel],
        "output": ((count > 0) & valid)[sel],
        "count": np.where(valid, count, 0)[sel].astype(np.float64),
        "stray": stray,
    }


def _values(arr) -> np.ndarray:
    o = arr.offsets.to_numpy()
    return arr.values.to_numpy(zero_copy_only=False)[o[0] : o[-1]].astype(np.int64)


def _max(arr) -> int:
    v = _values(arr)
    return int(v.max()) if v.size else 0


def fine_agreement(ev: dict, mech: str, scope: str, grid: np.ndarray, neutral: float, tie: float) -> np.ndarray:
    """`agreement` over the whole grid, computed on a grid COARSE times coarser first: a position
    whose agreement is the same at every coarse point (most: far from any decision) keeps that value
    on the fine grid, the others are computed on it. A window narrower than COARSE grid steps
    between two coarse points is missed."""
    coarse = np.unique(np.r_[np.arange(0, grid.size, COARSE), grid.size - 1, np.flatnonzero(grid == neutral)])
    rough = agreement(ev, mech, scope, grid[coarse], tie)
    varying = np.flatnonzero(rough.min(axis=1) != rough.max(axis=1))
    out = np.repeat(rough[:, :1], grid.size, axis=1)
    if varying.size:
        sub = {key: (v[varying] if isinstance(v, np.ndarray) else v) for key, v in ev.items()}
        out[varying] = agreement(sub, mech, scope, grid, tie)
    return out


def agreement(ev: dict, mech: str, scope: str, grid: np.ndarray, tie: float) -> np.ndarray:
    """[positions, grid] bool: the engine's token is the penalised argmax (within `tie`)."""
    out = np.empty((ev["logit"].shape[0], grid.size), dtype=bool)
    for s in range(0, ev["logit"].shape[0], _CHUNK):
        z = ev["logit"][s : s + _CHUNK, :, None]
        seen = ev[scope][s : s + _CHUNK, :, None]
        if mech == "repetition_penalty":
            pz = np.where(seen, np.where(z > 0, z / grid, z * grid), z)
        elif mech == "presence_penalty":
            pz = z - seen * grid
        else:
            pz = z - ev["count"][s : s + _CHUNK, :, None] * grid
        out[s : s + _CHUNK] = pz[:, 0, :] >= pz.max(axis=1) - tie
    return out
