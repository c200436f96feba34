"""The rescore stage: the reference teacher-forced over every completed, not-yet-scored request.

Resumable (a request is scored iff it has reference rows), scores the prompt positions of every request
whose engine returned prompt logprobs in the same pass (`prompt_reference/`, committed with its
reference part), refuses a reference with another tokenizer
(ids would not mean the same text) and a silent switch of reference (`--redo` replaces the scores).
"""

from __future__ import annotations


from lpf.errors import LpfError
from lpf.pipeline.callbacks import OnStart, Tick, no_start, no_tick
from lpf.model_specs import resolve_model
from lpf.run.store import RunDir

def rescore_run(run: RunDir, reference: str | None, dtype: str = "float32", token_budget: int = 16384,
                redo: bool = False, on_start: OnStart = no_start,
                tick: Tick = no_tick) -> None:
    """Teacher-force the reference over every completed, not-yet-scored request."""
    with run.writer():
        _rescore(run, reference, dtype, token_budget, redo, on_start, tick)


def _rescore(run: RunDir, reference: str | None, dtype: str, token_budget: int, redo: bool, on_start: OnStart,
             tick: Tick) -> None:
    from lpf.reference import Rescorer, ScoreItem

    m = run.manifest
    spec = reference or m["model"]["spec"]
    prev = m.get("reference")
    if run.has("reference") and prev and (prev.get("spec"), prev.get("dtype")) != (spec, dtype) and not redo:
        raise LpfError(f"{run.path} was rescored with {prev.get('spec')} ({prev.get('dtype')}); "
                       f"pass --redo to replace those scores")
    rescorer = Rescorer(resolve_model(spec), dtype=dtype, token_budget=token_budget,
                        topk=m["sampling"].get("logprobs", 5))
    desc = rescorer.describe()
    if desc["tokenizer_sha256"] != m["tokenizer_sha256"]:
        raise LpfError(f"reference {spec} uses a different tokenizer from the engine's model "
                       f"{m['model']['spec']}: token ids would not mean the same text")
    if redo:
        # a calibration run, like the prompt scores, belongs to the old reference
        for p in run.parts("prompt_reference") + run.parts("reference") + run.parts("calibration"):
            p.unlink()
        m.pop("calibration", None)
    m["reference"] = desc
    run.save_manifest()
    done = set(run.read("reference", ["request_id"]).column("request_id").to_pylist())
    req = run.read("requests", ["request_id", "prompt_token_ids", "output_token_ids", "error"]).to_pylist()
    with_prompt = set(run.read("prompt_tokens", ["request_id"]).column("request_id").unique().to_pylist())
    items = [ScoreItem(r["request_id"], r["prompt_token_ids"], r["output_token_ids"], r["request_id"] in with_prompt)
             for r in req if r["error"] is None and r["output_token_ids"] and r["request_id"] not in done]
    total = sum(len(r["output_token_ids"]) for r in req if r["error"] is None)
    on_start(total, total - sum(len(it.output_token_ids) for it in items))
    for scored in rescorer.score_all(items, tick):
        run.append_reference(scored.reference, scored.prompt_reference)
