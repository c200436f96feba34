"""The analyze stage: a rescored run's parts -> `summary.parquet` and `findings.json` (via `lpf.analysis`).

With `attribute` (the default) the flagged requests' outputs are also re-scored under the prompts of
requests served alongside them (`lpf.analysis.attribution` plans and judges, `lpf.pipeline.attribute`
scores, cached in `attribution/`): "request X received the answer meant for request Y" joins the
ranked hypotheses, and `findings.attribution` lists every pair found.

It hands analysis the expected-floor table shipped with the package (`lpf/analysis/floors.json`,
read here so analysis does no I/O) and what the manifest says about the dtype pair, the reference
model and the sampling, from which the run-level test gets its floor. The reference model is named
as the table names it (`floor_model`): a directory holding a zoo model's weights is that zoo model.

A run whose engine returned no logprobs is judged from its tokens (`lpf.analysis.tokens_only`), and every
run's findings say what came back and what each step could judge from it (`judged`).
A run of more than STREAM_ABOVE tokens is analysed streamed (`analyze_stream`: by chunk of whole
requests, bounded memory, the same steps (`lpf.analysis.steps`), the same summary and findings byte for
byte); `stream` forces either path.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from importlib import resources

import pyarrow as pa
import pyarrow.parquet as pq

from lpf.analysis import attribution, kv_signature
from lpf.analysis.findings import analyze
from lpf.analysis.steps import Ran
from lpf.analysis.returned import counts as returned_counts, tokens_only as returned_nothing, what_came_back
from lpf.analysis.tokens_only import analyze_tokens_only
from lpf.analysis.thresholds import Thresholds
from lpf.core.errors import LpfError
from lpf.core.jsonsafe import finite
from lpf.pipeline.analyze_stream import analyze_streamed
from lpf.pipeline.run_reads import chunk_budget, footer_counts, own_sums, reference_sums, scored_token_count
from lpf.pipeline.stream_parts import Tally
from lpf.pipeline.attribute import attribution_scores
from lpf.analysis.floors import SERVER_REFERENCES, configured_kv
from lpf.pipeline.calibrate import calibration_applies, calibration_for, engine_dtype
from lpf.pipeline.callbacks import OnStart, Tick, no_start, no_tick
from lpf.pipeline.trace import engine_info, trace_summary
from lpf.pipeline.reference_http import findings_notes
from lpf.run.store import RunDir


STREAM_ABOVE = 10_000_000  # tokens: above this `lpf analyze` streams (in memory 10M cost 3.3-5 GB: docs/benchmarks.md)


def analyze_run(
    run: RunDir,
    thresholds: Thresholds,
    attribute: bool = True,
    on_start: OnStart = no_start,
    tick: Tick = no_tick,
    stream: bool | None = None,
    progress: tuple[OnStart, Tick] = (no_start, no_tick),
    tokens_only: bool = False,
    ran: Ran | None = None,
) -> dict:
    """`on_start`/`tick` report the attribution's re-scoring (tokens), when there is any. `stream`:
    the streamed path (`analyze_stream`: bounded memory, the same findings), the in-memory one, or
    (None) streamed when the run has more than STREAM_ABOVE tokens and no calibration run (read in
    memory; the streamed path refuses it);
    `progress` reports the streamed path's two passes over the tokens. `tokens_only`: judge from the tokens
    alone even when the engine returned logprobs (what a tokens-only server's audit would say).
    `ran`: a `steps.Ran` the analysis records its steps on (tokens-only runs record none: their judge,
    `tokens_only`, is one execution, the same whichever was asked for)."""
    m = run.manifest
    # what came back: whether any logprob did from the parts' footers; the widest top-k list from
    # the tokens as the analysis reads them (a streamed run is never read whole, nor read for this)
    came_back = footer_counts(run)
    no_logprobs = tokens_only or returned_nothing(came_back)
    if no_logprobs:  # judged from tokens alone, in memory (`lpf.analysis.tokens_only`)
        stream = False
    elif stream is None:
        stream = not calibration_applies(m) and scored_token_count(run) > STREAM_ABOVE and not _mixed_sampling(run)
    elif stream and calibration_applies(m):
        raise LpfError(
            f"{run.path} has a calibration run, which the streamed analysis does not read yet: "
            f"analyze it with --no-stream"
        )
    elif stream and _mixed_sampling(run):
        raise LpfError(
            f"{run.path} has requests sent with sampling settings of their own, of several kinds, which the "
            f"streamed analysis does not judge yet: analyze it with --no-stream"
        )
    # streamed: the analysis reads the requests itself, beside the first parts (their footers count them here)
    requests = None if stream else run.read("requests")
    if (scored_token_count(run, "requests") if stream else requests.num_rows) == 0:
        raise LpfError(f"{run.path} has no completed requests to analyze")
    trace = run.read("trace") if run.has("trace") else None  # engines without a trace: metadata only
    temperature = m["sampling"].get("temperature", 0) or 0
    ref = m.get("reference") or {}
    run_info = {
        "engine_dtype": engine_dtype(m),
        "reference_dtype": ref.get("dtype"),
        # a server reference (self, a trusted deployment) has floors of its own (`floors.SERVER_REFERENCES`)
        "reference_kind": ref.get("kind"),
        # a server reference serves the run's model: the floor is that model's
        "model": floor_model(m.get("model") or {} if ref.get("kind") in SERVER_REFERENCES else ref),
        "sampling": m["sampling"],
        # what the engine computes with beyond its dtype (a quantized or flash-attention KV): its own floor row
        "configuration": configured_kv(
            (m.get("engine") or {}).get("name"), engine_dtype(m), (m.get("engine") or {}).get("configuration")
        ),
    }
    if not no_logprobs and kv_signature.unsaid(
        (m.get("engine") or {}).get("name"), (m.get("engine") or {}).get("configuration")
    ):
        if run_info["reference_dtype"] == "float32" and run_info["reference_kind"] not in SERVER_REFERENCES:
            run_info["kv_seen"] = kv_seen(run)  # flash attention's signature, when the server does not say
    kw = dict(
        no_logprobs=no_logprobs,
        ran=ran,
        greedy=temperature == 0,
        trace=trace,
        engine_info=engine_info(run),
        temperature=temperature,
        floor_table=floor_table(),
        run_info=run_info,
    )
    with _SummaryFile(run.path / "summary.parquet") as written:
        return _judge(run, requests, thresholds, attribute, (on_start, tick), stream, progress, kw, written)


KV_SAMPLE_TOKENS = 200_000  # the top-k spread's 99th percentile needs no more


def kv_seen(run: RunDir) -> dict | None:
    """`kv_signature.seen` of the run's top-k spread, on every k-th request (by id) of a run bigger than
    KV_SAMPLE_TOKENS tokens: the same numbers whichever execution analyses it, read before either starts."""
    import numpy as np
    import pyarrow.compute as pc

    every = -(-scored_token_count(run) // KV_SAMPLE_TOKENS)
    ids = pc.unique(run.read("requests", ["request_id"]).column("request_id")).sort()
    keep = ids.take(pa.array(np.arange(0, len(ids), max(every, 1))))

    def rows(table: str, columns: list[str]) -> pa.Table:
        parts = [p.filter(pc.is_in(p.column("request_id"), value_set=keep)) for p in run.iter_parts(table, columns)]
        return pa.concat_tables(parts) if parts else None

    keys = ["request_id", "position"]
    tokens = rows("tokens", keys + ["engine_topk_ids", "engine_topk_logprobs"])
    reference = rows("reference", keys + ["ref_topk_ids", "ref_topk_logprobs"])
    if tokens is None or reference is None:
        return None
    return kv_signature.seen([kv_signature.spread(tokens, reference)])


def _mixed_sampling(run: RunDir) -> bool:
    """Whether the run's requests sent sampling settings of several kinds (`request_sampling`: each judged
    at its own; the streamed analysis judges one setting for all)."""
    from lpf.analysis import request_sampling

    own = request_sampling.settings(
        run.read("requests", ["request_id", "sampling"]), run.manifest["sampling"].get("temperature", 0) or 0
    )
    return own is not None and not (own.uniform is not None and own.uniform == own.uniform)


def _judge(run, requests, thresholds, attribute, attribution_progress, stream, progress, kw, written) -> dict:
    m, has_prompt = run.manifest, run.has("prompt_reference")
    (on_start, tick), no_logprobs, ran = attribution_progress, kw.pop("no_logprobs"), kw.pop("ran")
    if stream:
        tally = Tally(run)
        summary, findings = analyze_streamed(
            run, requests, thresholds, progress=progress, tally=tally, on_summary=written.start, ran=ran, **kw
        )
        came_back = tally.counts() or returned_counts(run.iter_parts("tokens", ["engine_logprob", "engine_topk_ids"]))
        own = partial(reference_sums, run)
    else:
        reference = run.read("reference")
        calibration, cal_info = calibration_for(run, reference)
        prompt = (run.read("prompt_tokens"), run.read("prompt_reference")) if has_prompt else (None, None)
        judge = (
            partial(analyze_tokens_only, seeded=run.read("seeded") if run.has("seeded") else None)
            if no_logprobs
            else partial(analyze, ran=ran)
        )
        tokens = run.read("tokens")
        came_back = returned_counts([tokens])
        if no_logprobs:  # what a tokens-only server returns: the ids
            tokens = tokens.set_column(
                tokens.column_names.index("engine_logprob"), "engine_logprob", pa.nulls(tokens.num_rows, pa.float64())
            )
        summary, findings = judge(
            requests,
            tokens,
            reference,
            thresholds,
            calibration=calibration,
            calibration_info=cal_info,
            prompt_tokens=prompt[0],
            prompt_reference=prompt[1],
            chunk_budget=chunk_budget(m),
            **kw,
        )
        own = partial(own_sums, reference)
    if attribute and stream:  # the plan compares prompts, which the streamed analysis reads as lengths only
        requests = run.read("requests", ["request_id", "seq", "prompt_token_ids", "t_submit", "t_finish"])
    findings["attribution"] = _attribute(run, requests, summary, own, findings, on_start, tick) if attribute else None
    findings = {
        "run_id": m.get("run_id"),
        "engine": m["engine"].get("name"),
        "model": m["model"].get("spec"),
        "reference": (m.get("reference") or {}).get("spec"),
        **findings,
    }
    findings.update(findings_notes(m.get("reference"), findings))  # a self-reference's limits
    findings["run_complete"] = m.get("status") == "complete"
    findings["judged"] = what_came_back(came_back, has_prompt, m.get("engine"), m["sampling"], run.has("seeded"))
    findings["trace"] = trace_summary(run)
    written.start(summary)  # the streamed analysis started it already: the same summary, not again
    findings = finite(findings)  # once: a big run's findings hold thousands of values
    run.write_json("findings.json", findings)
    written.done()
    return findings


class _SummaryFile:
    """summary.parquet, written on a second thread (Parquet's encoder releases the GIL) from when
    the summary is final (`start`: the streamed analysis calls it before its conclusions are drawn)
    to a temporary name, put in place beside findings.json (`done`); removed if the stage fails.
    Dictionaries for the categorical strings only: one per request id (or float) is all cost (half
    the time of pyarrow's default, and a smaller file)."""

    def __init__(self, path):
        self.path, self.tmp = path, path.with_name(f".tmp-{path.name}")
        self.pool, self.writing = ThreadPoolExecutor(1, thread_name_prefix="lpf-summary"), None

    def start(self, summary: pa.Table) -> None:
        if self.writing is not None and self.writing[0] is summary:
            return
        categorical = [f.name for f in summary.schema if pa.types.is_string(f.type) and f.name != "request_id"]
        self.writing = (summary, self.pool.submit(pq.write_table, summary, self.tmp, use_dictionary=categorical))

    def done(self) -> None:
        self.writing[1].result()
        os.replace(self.tmp, self.path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pool.shutdown()
        self.tmp.unlink(missing_ok=True)


def _attribute(run: RunDir, requests, summary, own_sums_of, findings: dict, on_start: OnStart, tick: Tick) -> dict:
    """`own_sums_of(ids)`: {request id: its reference logprob sum} for the flagged requests planned."""
    plans = attribution.plan(requests, summary)
    scores = attribution_scores(run, plans, on_start=on_start, tick=tick)
    own = own_sums_of({p["request_id"] for p in plans}) if plans else {}
    verdict = summary.column("verdict").to_pylist()
    ids = summary.column("request_id").to_pylist()
    lost = {rid for rid, v in zip(ids, verdict) if v in ("divergent", "corrupt", "error")}
    found = attribution.judge(plans, scores, own, lost, typical_fit(summary, own_sums_of) if plans else None)
    n_flagged = len(findings["flagged"])
    n_scored = sum(findings["counts"].values())
    findings["hypotheses"] = attribution.merge_ranked(
        findings["hypotheses"], attribution.hypotheses(found, n_flagged, n_scored - n_flagged)
    )
    return {"n_tested": len(plans), "n_pairs_scored": scores.num_rows, "attributed": found}


def typical_fit(summary, own_sums_of, sample: int = 256) -> float | None:
    """Median per-token reference logprob of clean outputs under their own prompts (up to `sample` of
    them, evenly spread over arrival order), for the attribution's plausibility check."""
    import numpy as np

    rows = [
        (r, n)
        for r, v, n in zip(
            summary.column("request_id").to_pylist(),
            summary.column("verdict").to_pylist(),
            summary.column("n_output_tokens").to_pylist(),
        )
        if v == "clean" and n
    ]
    if not rows:
        return None
    rows = [rows[i] for i in np.unique(np.linspace(0, len(rows) - 1, min(sample, len(rows))).round().astype(int))]
    sums = own_sums_of({r for r, _ in rows})
    fits = [sums[r] / n for r, n in rows if r in sums]
    return float(np.median(fits)) if fits else None


def floor_model(ref: dict) -> str | None:
    """The reference's name in the floor table: its spec, or, for a directory holding a zoo model's
    weights (same weights sha256), that zoo model's name, so the same model gets the same floor and
    tie margin however it was named (a zoo model given by its path got the unmeasured envelope's)."""
    spec = ref.get("spec")
    sha = ref.get("weights_sha256")
    if spec is None or spec.startswith(("zoo:", "tiny:")) or not sha:
        return spec
    from lpf.zoo import registry

    return next((f"zoo:{name}" for name in registry.MODELS if _zoo_weights(name) == sha), spec)


@lru_cache(maxsize=None)
def _zoo_weights(name: str) -> str | None:
    from lpf.core.model_specs import weights_sha256
    from lpf.zoo import registry

    return weights_sha256(registry.model_dir(name)) if registry.model_available(name) else None


@lru_cache(maxsize=1)
def floor_table() -> dict:
    """The expected-floor table measured by scripts/measure_floors.py (see docs/verdicts-and-metrics.md)."""
    return json.loads(resources.files("lpf.analysis").joinpath("floors.json").read_text())
