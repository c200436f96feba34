"""The peer's rule: top-k membership at the first mismatch (vLLM's `check_logprobs_close`), per request.

vLLM's model tests compare two greedy outputs of the same prompt (HF's and vLLM's): walking both token by
token, at the first position where the tokens differ each output's token must be among the other
output's top-k logprobs; then the comparison stops (the sequences have diverged). Equal outputs pass.
No tolerance, no statistics: a logprob that is wrong while the token stays the same never fails it.

Against lpf's reference the other output is the reference's greedy continuation. The reference is
teacher-forced over the engine's own tokens, so up to the first mismatch its context is exactly what
HF's greedy generation would have had, and at that position `ref_top1_id` is HF's greedy token and
`ref_topk_ids` its top-k: the same comparison vLLM's test makes, from the same rescoring pass.

`first_mismatch_topk(tokens, reference)`: tokens (request_id, position, token_id, engine_topk_ids) and
reference (request_id, position, ref_top1_id, ref_topk_ids) -> one dict per request with reference rows:
{"request_id", "passed", "position" (first mismatch, None when none), "engine_token", "reference_token",
"engine_in_reference_topk", "reference_in_engine_topk" (None when the engine returned no top-k there: only
the reference's side could be checked)}. Pure: Arrow in, plain data out.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

NAME = "first-mismatch-topk"
RULES = (NAME,)


def first_mismatch_topk(tokens: pa.Table, reference: pa.Table) -> list[dict]:
    # Acero joins no list columns: join row numbers, then take the top-k lists of the rows that matter
    left = pa.table(
        {
            "request_id": tokens.column("request_id").cast(pa.string()),
            "position": tokens.column("position"),
            "token_id": tokens.column("token_id"),
            "_t": pa.array(np.arange(tokens.num_rows)),
        }
    )
    right = pa.table(
        {
            "request_id": reference.column("request_id").cast(pa.string()),
            "position": reference.column("position"),
            "ref_top1_id": reference.column("ref_top1_id"),
            "_r": pa.array(np.arange(reference.num_rows)),
        }
    )
    joined = left.join(right, keys=["request_id", "position"], join_type="inner")
    if not joined.num_rows:
        return []
    joined = joined.sort_by([("request_id", "ascending"), ("position", "ascending")])
    rid = joined.column("request_id").to_numpy(zero_copy_only=False)
    mismatch = pc.not_equal(joined.column("token_id"), joined.column("ref_top1_id")).to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]])
    ends = np.r_[starts[1:], len(rid)]
    out = []
    for s, e in zip(starts, ends):
        hits = np.flatnonzero(mismatch[s:e])
        row = {"request_id": str(rid[s]), "passed": True, "position": None}
        if len(hits):
            i = int(s + hits[0])
            engine_token = joined.column("token_id")[i].as_py()
            ref_token = joined.column("ref_top1_id")[i].as_py()
            engine_topk = tokens.column("engine_topk_ids")[joined.column("_t")[i].as_py()].as_py() or []
            ref_topk = reference.column("ref_topk_ids")[joined.column("_r")[i].as_py()].as_py() or []
            in_ref = engine_token in ref_topk
            # the engine's own top-k; vLLM's logprobs dict always holds the sampled token beside it
            in_engine = (ref_token in engine_topk) if engine_topk else None
            row.update(
                passed=bool(in_ref and in_engine is not False),
                position=int(joined.column("position")[i].as_py()),
                engine_token=engine_token,
                reference_token=ref_token,
                engine_in_reference_topk=in_ref,
                reference_in_engine_topk=in_engine,
            )
        out.append(row)
    return out


def summarize(results: list[dict]) -> dict:
    """{"rule", "n_requests", "n_failed", "n_mismatched", "failed": [request ids, worst first: earliest mismatch]}."""
    failed = sorted((r for r in results if not r["passed"]), key=lambda r: (r["position"], r["request_id"]))
    return {
        "rule": NAME,
        "n_requests": len(results),
        "n_failed": len(failed),
        "n_mismatched": sum(r["position"] is not None for r in results),
        "failed": [r["request_id"] for r in failed],
    }
