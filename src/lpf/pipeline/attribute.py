"""The attribution step: score flagged outputs under other requests' prompts with the run's reference.

`attribution_scores(run, plans, token_budget, on_start, tick) -> table` returns the `attribution`
table (schema.ATTRIBUTION) for every (flagged request, candidate) pair of `plans`
(`lpf.analysis.attribution.plan`), scoring only the pairs not yet stored, batched through
`lpf.pipeline.reference.Rescorer` or sent to the run's server reference (`lpf.pipeline.reference_http`)
(one teacher-forced pass per pair: the candidate's prompt + the flagged request's output tokens). Scores belong to one reference: when the run's reference changes, the
stored parts are dropped. Pairs whose prompt + output exceed the reference's context are skipped.
A run that was never rescored has nothing to attribute: an empty table, no model loaded.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lpf.core.model_specs import resolve_model
from lpf.pipeline.callbacks import OnStart, Tick, no_start, no_tick
from lpf.run import schema
from lpf.run.store import RunDir


def attribution_scores(
    run: RunDir, plans: list[dict], token_budget: int = 16384, on_start: OnStart = no_start, tick: Tick = no_tick
) -> pa.Table:
    m = run.manifest
    ref = m.get("reference") or {}
    if not ref.get("spec") or not plans:
        return schema.ATTRIBUTION.empty_table()
    key = {"spec": ref.get("spec"), "dtype": ref.get("dtype")}
    if (m.get("attribution") or {}) != key:  # scores of another reference are not this run's
        with run.writer():
            for p in run.parts("attribution"):
                p.unlink()
            m["attribution"] = key
            run.save_manifest()
    done = run.read("attribution", ["request_id", "candidate_id"]).to_pydict()
    have = set(zip(done["request_id"], done["candidate_id"]))
    wanted = [(p["request_id"], c) for p in plans for c in p["candidates"] if (p["request_id"], c) not in have]
    if wanted:
        with run.writer():
            _score(run, wanted, ref, token_budget, on_start, tick)
    return run.read("attribution")


def _score(
    run: RunDir, pairs: list[tuple[str, str]], ref: dict, token_budget: int, on_start: OnStart, tick: Tick
) -> None:
    from lpf.pipeline.reference import Rescorer, ScoreItem

    need = {r for pair in pairs for r in pair}
    req = run.read("requests", ["request_id", "prompt_token_ids", "output_token_ids"])
    rows = {r["request_id"]: r for r in req.to_pylist() if r["request_id"] in need}
    if ref.get("kind") in ("http", "self"):  # the same server scores the candidates
        from lpf.pipeline.reference_http import from_manifest

        rescorer = from_manifest(run.manifest, topk=1)
    elif ref.get("kind") == "vllm":  # vLLM in the same reference configuration
        from lpf.pipeline.reference_vllm import from_manifest as vllm_from_manifest

        rescorer = vllm_from_manifest(run.manifest, topk=1)
    else:
        rescorer = Rescorer(
            resolve_model(ref["spec"]), dtype=ref.get("dtype") or "float32", token_budget=token_budget, topk=1
        )
    limit = rescorer.max_context
    items, index = [], []
    for rid, cid in pairs:
        prompt, output = rows[cid]["prompt_token_ids"], rows[rid]["output_token_ids"]
        if not output or (limit is not None and len(prompt) + len(output) > limit):
            continue
        # positional ids: request ids are the user's text and may hold any character
        items.append(ScoreItem(str(len(index)), list(prompt), list(output)))
        index.append((rid, cid))
    on_start(sum(len(it.output_token_ids) for it in items), 0)
    for table in rescorer.score(items, tick):
        at = np.asarray(table.column("request_id").to_pylist(), dtype=np.int64)
        lp = table.column("ref_logprob").to_numpy()
        uniq, inv = np.unique(at, return_inverse=True)
        sums, counts = np.bincount(inv, weights=lp), np.bincount(inv)
        run.append(
            "attribution",
            pa.table(
                {
                    "request_id": pa.array([index[i][0] for i in uniq], pa.string()),
                    "candidate_id": pa.array([index[i][1] for i in uniq], pa.string()),
                    "n_tokens": pa.array(counts.astype(np.int32)),
                    "logprob_sum": pa.array(sums.astype(np.float64)),
                },
                schema=schema.ATTRIBUTION,
            ),
        )
