"""An ensemble of honest bfloat16 runs of the reference over a cell's tokens, for the per-position bf16 test.

Contract: `ensemble(cell, members=MEMBERS) -> dict[str, pa.Table]` opens the cell's run directory,
teacher-forces the reference model at the cell's dtype over the cell's own tokens (outputs, and
prompts where the cell has prompt logprobs) once per member, and returns per member one table
(`request_id`, `position`, `side` ("output" / "prompt"), `low`: that member's logprob of the cell's
token). The members differ where honest implementations of one dtype differ: batch shape (every
prompt in one padded batch, or one prompt per batch), the output head (float32 copy, as lpf's
reference, or bfloat16, as most engines run it) and the attention kernel (sdpa or eager). Each is
the same weights and the same function; what separates them is rounding only, so their spread at a
position is what an honest bfloat16 engine's error at that position looks like.
`lpf.experiments.conformance.bf16_paired` tests the cell against them.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

# name -> (token budget: 16384 packs the cell's prompts in one batch, 1 runs them one at a time;
#          float32 head; attention implementation or None for the model's default)
MEMBERS = {
    "batched-f32head": (16384, True, None),
    "single-f32head": (1, True, None),
    "batched-bf16head": (16384, False, None),
    "single-bf16head-eager": (1, False, "eager"),
}


def ensemble(cell: Path, members: dict = MEMBERS) -> dict[str, pa.Table]:
    from lpf.core.model_specs import resolve_model
    from lpf.pipeline import engine_dtype
    from lpf.pipeline.reference import Rescorer, ScoreItem
    from lpf.run.store import RunDir

    run = RunDir.open(cell)
    ref_info, dtype = run.manifest.get("reference") or {}, engine_dtype(run.manifest)
    with_prompt = (
        set(run.read("prompt_tokens", ["request_id"]).column("request_id").to_pylist())
        if run.has("prompt_tokens")
        else set()
    )
    req = run.read("requests", ["request_id", "prompt_token_ids", "output_token_ids", "error"]).to_pylist()
    items = [
        ScoreItem(r["request_id"], r["prompt_token_ids"], r["output_token_ids"], r["request_id"] in with_prompt)
        for r in req
        if r["error"] is None and r["output_token_ids"]
    ]
    out = {}
    for name, (budget, f32_head, attn) in members.items():
        rescorer = Rescorer(
            resolve_model(ref_info["spec"]), dtype=dtype, topk=1, token_budget=budget, float32_head=f32_head
        )
        if attn is not None:
            try:
                rescorer.model.set_attn_implementation(attn)
            except Exception:  # noqa: BLE001 - a model with one attention kernel only: this member is the default's
                pass
        parts = []
        for s in rescorer.score_all(items):
            for side, t in (("output", s.reference), ("prompt", s.prompt_reference)):
                if t is not None and t.num_rows:
                    parts.append(
                        pa.table(
                            {
                                "request_id": t.column("request_id"),
                                "position": t.column("position"),
                                "side": pa.array([side] * t.num_rows),
                                "low": t.column("ref_logprob").cast(pa.float64()),
                            }
                        )
                    )
        out[name] = pa.concat_tables(parts) if parts else None
        del rescorer
    return out
