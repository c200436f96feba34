"""The per-cell judgements past the analysis verdict: bf16 per position, llama.cpp per token.

Contract: `bf16_per_position(cell) -> dict | None`: `bf16_paired.paired_test` of the cell's engine
logprobs (outputs and prompts) against `bf16_ensemble.ensemble` over the cell's tokens (None when the
cell has no reference); `judge_llamacpp(cell, findings, model) -> dict`: `llamacpp_judge.judge` over
the cell's `tokens` and `reference` tables with the model's vocabulary size. Both read the cell's run
directory and return plain data; `matrix.cell_row` puts them in the row (`bf16_paired`,
`engine_judgement`) and lets them set its `conformance`.
"""

from __future__ import annotations

from pathlib import Path


def bf16_per_position(cell: Path) -> dict | None:
    """`bf16_paired.paired_test` of the cell against `bf16_ensemble.ensemble` over its tokens (None
    when the cell has no reference)."""
    from lpf.experiments.conformance.bf16_ensemble import ensemble
    from lpf.experiments.conformance.bf16_paired import paired_test
    from lpf.run.store import RunDir

    run = RunDir.open(cell)
    if not run.manifest.get("reference"):
        return None
    engine: dict = {}
    reference: dict = {}
    for side, table, ref in (("output", "tokens", "reference"), ("prompt", "prompt_tokens", "prompt_reference")):
        for name, col, into in ((table, "engine_logprob", engine), (ref, "ref_logprob", reference)):
            if run.has(name):
                t = run.read(name, ["request_id", "position", col])
                for r, p, v in zip(*[t.column(c).to_pylist() for c in t.column_names]):
                    into[(r, p, side)] = v
    members = {}
    for name, t in ensemble(cell).items():
        if t is not None:
            members[name] = {
                (r, p, s): v
                for r, p, s, v in zip(*[t.column(c).to_pylist() for c in ("request_id", "position", "side", "low")])
            }
    return paired_test(engine, members, reference)


def judge_llamacpp(cell: Path, findings: dict, model: str) -> dict:
    """`llamacpp_judge.judge` over the cell's tables (the per-token judgement with its named causes)."""
    from lpf.core.model_specs import resolve_model
    from lpf.experiments.conformance.llamacpp_judge import judge
    from lpf.pipeline.generate import model_config
    from lpf.run.store import RunDir

    run = RunDir.open(cell)
    vocab = model_config(resolve_model(model)).get("vocab_size") or 0
    return judge(run.read("tokens"), run.read("reference"), findings, int(vocab))
