"""The run's prefix cache in one block: was it on, how much did it supply, and is it inert.

Contract: `prefix_cache_summary(requests, trace, engine_info) -> dict | None`. Pure. None when the
run says nothing about a prefix cache (the engine's options do not switch it on and the trace has no
hit column). Otherwise:
  {"enabled": bool | None, "recorded": bool (the trace counts hits), "requests": N,
   "requests_hit": k, "hit_tokens": H, "prompt_tokens": T, "hit_rate": H / T,
   "requests_sharing": S (requests whose prompt shares at least one full block_size block with an
   earlier request's: what a prefix cache could supply), "shareable_tokens": the tokens of those shared
   full blocks (capped at prompt length - 1, as a cache hit is), "block_size": B,
   "inert": bool, "finding": "prefix-cache-inert" (only when inert), "sentence": one line}
  (+ "requests_sharing_below_block", "shareable_tokens_below_block": the same at DEFAULT_BLOCK
   tokens, only when B > DEFAULT_BLOCK, nothing hit and S == 0)
Inert: caching on, hits recorded, k == 0 and prompts share prefixes: S > 0, or, when no prompt
shares a whole B-token block, they share DEFAULT_BLOCK-token ones (vLLM #48401, #51250, #54504:
prefix caching accepted and silently doing nothing on hybrids; in #48401 the hybrid's block is raised
past max_model_len, so no request ever fills the one unit the cache hashes and S is 0 by
construction: the prefixes a plain attention cache would share are the evidence then). It is a
finding about the run, never a verdict on a request: a cache that does nothing is slow, not wrong.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.prefix_features import has_prefix_columns

DEFAULT_BLOCK = 16


def _enabled(engine_info: dict) -> bool | None:
    for section in ("options", "engine_args"):
        value = (engine_info.get(section) or {}).get("enable_prefix_caching")
        if value is not None:
            return bool(value)
    return None


def _block_size(engine_info: dict) -> int:
    cache = (engine_info.get("cache") or {}).get("prefix_cache") or {}
    for value in [(engine_info.get(s) or {}).get("block_size") for s in ("options", "engine_args")] + [
        cache.get("block_size")
    ]:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_BLOCK


def shared_blocks(prompts: list[list[int]], block: int) -> list[int]:
    """Per prompt (in arrival order), the full blocks its prefix shares with an earlier prompt's (a
    chained hash per block: each names the whole prefix up to its end)."""
    seen: set[int] = set()
    out = []
    for p in prompts:
        chain, h = [], 0
        for k in range(len(p) // block):
            h = hash((h, tuple(p[k * block : (k + 1) * block])))
            chain.append(h)
        limit = (len(p) - 1) // block
        n = 0
        while n < limit and chain[n] in seen:
            n += 1
        out.append(n)
        seen.update(chain)
    return out


def prefix_cache_summary(requests: pa.Table, trace: pa.Table | None, engine_info: dict | None) -> dict | None:
    info = engine_info or {}
    enabled = _enabled(info)
    recorded = has_prefix_columns(trace)
    if not enabled and not recorded:
        return None
    req = requests.sort_by("seq")
    ids = req.column("request_id")
    prompts = req.column("prompt_token_ids").to_pylist()
    block = _block_size(info)
    # the streamed analysis reads prompts as lengths only (null ids): what they share is unknown then
    known = not any(p and p[0] is None for p in prompts[:1])
    shared = shared_blocks(prompts, block) if known else None
    out = {
        "enabled": enabled,
        "recorded": recorded,
        "requests": req.num_rows,
        "block_size": block,
        "prompt_tokens": int(sum(len(p) for p in prompts)),
        "requests_sharing": int(sum(1 for s in shared if s)) if known else None,
        "shareable_tokens": int(sum(shared) * block) if known else None,
    }
    if not recorded:
        out.update(
            requests_hit=None,
            hit_tokens=None,
            hit_rate=None,
            inert=False,
            sentence="prefix caching is on; the engine's trace does not count its hits",
        )
        return out
    rows = trace.filter(pc.is_in(trace.column("request_id"), value_set=ids))
    hits = rows.filter(pc.greater(rows.column("prefix_cache_hit_tokens").fill_null(0), 0))
    hit_tokens = int(pc.sum(hits.column("prefix_cache_hit_tokens")).as_py() or 0)
    n_hit = len(pc.unique(hits.column("request_id")))
    out.update(
        requests_hit=n_hit,
        hit_tokens=hit_tokens,
        hit_rate=hit_tokens / out["prompt_tokens"] if out["prompt_tokens"] else None,
    )
    out["inert"] = bool(enabled is True and out["requests_sharing"] and n_hit == 0)  # on by the knobs, not assumed
    if enabled is True and known and n_hit == 0 and not out["requests_sharing"] and block > DEFAULT_BLOCK:
        fine = shared_blocks(prompts, DEFAULT_BLOCK)
        out["requests_sharing_below_block"] = int(sum(1 for s in fine if s))
        out["shareable_tokens_below_block"] = int(sum(fine) * DEFAULT_BLOCK)
        out["inert"] = out["requests_sharing_below_block"] > 0
    if out["inert"] and not out["requests_sharing"]:
        out["finding"] = "prefix-cache-inert"
        context = (info.get("options") or {}).get("max_model_len")
        longest = max((len(p) for p in prompts), default=0)
        out["sentence"] = (
            f"prefix caching is on but inert: {out['requests_sharing_below_block']}/{req.num_rows} requests "
            f"share at least one {DEFAULT_BLOCK}-token block with an earlier prompt "
            f"({out['shareable_tokens_below_block']:,} tokens), but the cache hashes only full "
            f"{block}-token blocks"
            + (
                f", longer than every prompt (longest {longest}"
                + (f"; max_model_len {context}" if isinstance(context, int) else "")
                + "): no request can fill one"
                if longest < block
                else ", and no two prompts share a whole one"
            )
            + "; the cache supplied 0 tokens (0 hits)"
        )
    elif out["inert"]:
        out["finding"] = "prefix-cache-inert"
        out["sentence"] = (
            f"prefix caching is on but inert: {out['requests_sharing']}/{req.num_rows} requests share "
            f"at least one {block}-token block with an earlier prompt ({out['shareable_tokens']:,} "
            f"shareable tokens), and the cache supplied 0 tokens (0 hits)"
        )
    else:
        rate = (
            f" ({out['hit_rate']:.1%} of {out['prompt_tokens']:,} prompt tokens)" if out["hit_rate"] is not None else ""
        )
        shared_words = (
            ""
            if not known
            else (
                f"; {out['requests_sharing']} requests share a {block}-token block with an earlier prompt "
                f"({out['shareable_tokens']:,} shareable tokens)"
            )
        )
        out["sentence"] = (
            f"prefix cache: {n_hit}/{req.num_rows} requests hit, {hit_tokens:,} tokens supplied{rate}{shared_words}"
        )
    return out
