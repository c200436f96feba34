"""The stages of an audit, each reading and writing a run directory: run -> rescore [-> calibrate]
-> analyze. The optional calibration run (`calibrate_run`) gives analyze a noise floor the engine
cannot move.

Everything the user can get wrong is checked before the run directory is created (engine name,
model, workload, options), so a bad invocation writes nothing. Progress is reported through a
`Progress`-like callback so this module never draws anything itself.
"""

from __future__ import annotations

import json
import platform
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa

import lpf
from lpf.analysis.findings import analyze
from lpf.analysis.thresholds import Thresholds
from lpf.engines import get_engine_class
from lpf.errors import LpfError
from lpf.jsonsafe import finite
from lpf.models import ModelRef, load_tokenizer, resolve_model, tokenizer_fingerprint
from lpf.run import schema
from lpf.run.store import RunDir
from lpf.sampling import SamplingParams
from lpf.workload import EngineRequest, expand, load_prompts, read_normalized, write_normalized

Tick = Callable[[int], None]


def _noop(_: int) -> None:
    pass


@dataclass
class RunSpec:
    engine: str
    model: str
    workload: str
    out: Path
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine_options: dict = field(default_factory=dict)
    part_size: int = 64


def model_config(model: ModelRef) -> dict:
    try:
        cfg = json.loads((model.path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LpfError(f"model {model.spec}: unreadable config.json ({e})") from None
    return cfg.get("text_config", cfg)


# -- run ------------------------------------------------------------------------------------------
def create_run(spec: RunSpec) -> RunDir:
    engine_cls = get_engine_class(spec.engine)
    engine_cls.Options.parse(spec.engine_options)  # a bad knob is refused before anything is written
    model = resolve_model(spec.model)
    cfg = model_config(model)
    engine_cls.check_model(cfg)
    tokenizer = load_tokenizer(model)
    context = cfg.get("max_position_embeddings")
    prompts, source = load_prompts(spec.workload, tokenizer, cfg.get("vocab_size", len(tokenizer)), context)
    requests = expand(prompts, spec.n, spec.sampling, context)
    manifest = {
        "run_id": uuid.uuid4().hex[:12],
        "lpf_version": lpf.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "status": "running",
        "engine": {"name": spec.engine, "options": dict(spec.engine_options)},
        "model": {**model.describe(), "architecture": (cfg.get("architectures") or ["?"])[0]},
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "workload": {**source, "n_prompts": len(prompts), "n": spec.n, "n_requests": len(requests)},
        "sampling": spec.sampling.to_dict(),
        "seed": spec.sampling.seed,
        "part_size": spec.part_size,
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                 "python": platform.python_version()},
    }
    run = RunDir.create(spec.out, manifest)
    write_normalized(prompts, run.path / "workload.jsonl")
    return run


def pending_requests(run: RunDir) -> list[EngineRequest]:
    m = run.manifest
    prompts = read_normalized(run.path / "workload.jsonl")
    requests = expand(prompts, m["workload"]["n"], SamplingParams.from_dict(m["sampling"]))
    done = run.done_request_ids()
    return [r for r in requests if r.request_id not in done]


def execute_run(run: RunDir, on_start: Callable[[int, int], None] = lambda total, done: None,
                tick: Tick = _noop) -> None:
    """Send every not-yet-completed request to the engine, committing parts as they finish."""
    m = run.manifest
    pending = pending_requests(run)
    on_start(m["workload"]["n_requests"], m["workload"]["n_requests"] - len(pending))
    if pending:
        engine_cls = get_engine_class(m["engine"]["name"])
        model = resolve_model(m["model"]["spec"])
        sampling = SamplingParams.from_dict(m["sampling"])
        engine = engine_cls(model, sampling, engine_cls.Options.parse(m["engine"]["options"]))
        m["engine"].update(engine.describe())
        run.save_manifest()
        tokenizer = load_tokenizer(model)
        by_id = {r.request_id: r for r in pending}
        buffer, last = [], time.monotonic()
        try:
            for c in engine.generate(pending):
                buffer.append(c)
                tick(1)
                if len(buffer) >= m.get("part_size", 64) or time.monotonic() - last > 10:
                    _commit(run, engine, buffer, by_id, tokenizer)
                    buffer, last = [], time.monotonic()
            m["engine"].update(engine.describe())  # what the run taught it (HTTP retries, token identity)
        finally:
            if buffer:  # what finished before an error or Ctrl-C is kept
                _commit(run, engine, buffer, by_id, tokenizer)
            engine.close()
    m["status"] = "complete"
    run.save_manifest()


def _commit(run: RunDir, engine, completions, by_id: dict[str, EngineRequest], tokenizer) -> None:
    req_rows, tok = [], {k: [] for k in schema.TOKENS.names}
    for c in completions:
        r = by_id[c.request_id]
        text = tokenizer.decode(c.output_token_ids, skip_special_tokens=True) if c.error is None else None
        req_rows.append({
            "request_id": r.request_id, "seq": r.seq, "prompt_id": r.prompt_id, "rollout": r.rollout,
            "prompt_token_ids": list(r.prompt_token_ids), "output_token_ids": c.output_token_ids,
            "output_text": text, "finish_reason": "error" if c.error else c.finish_reason, "error": c.error,
            "t_submit": c.t_submit, "t_first_token": c.t_first_token, "t_finish": c.t_finish,
            "oracle_expected": r.expected,
            "oracle_ok": None if r.expected is None or text is None else text.strip() == r.expected.strip(),
        })
        n = len(c.logprobs)
        tok["request_id"] += [r.request_id] * n
        tok["position"] += list(range(n))
        tok["token_id"] += c.output_token_ids[:n]
        tok["engine_logprob"] += c.logprobs
        tok["engine_topk_ids"] += c.topk_ids or [[]] * n
        tok["engine_topk_logprobs"] += c.topk_logprobs or [[]] * n
    # side tables first: a request part must never exist without the trace that led to it
    for name, table in engine.side_tables().items():
        if table is not None and table.num_rows:
            run.append(name, table)
    run.append_requests(pa.Table.from_pylist(req_rows, schema=schema.REQUESTS),
                        pa.table(tok, schema=schema.TOKENS))


# -- rescore --------------------------------------------------------------------------------------
def rescore_run(run: RunDir, reference: str | None, dtype: str = "float32", token_budget: int = 16384,
                redo: bool = False, on_start: Callable[[int, int], None] = lambda total, done: None,
                tick: Tick = _noop) -> None:
    """Teacher-force the reference over every completed, not-yet-scored request."""
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
        for p in run.parts("reference") + run.parts("calibration"):  # a calibration run is of the old reference
            p.unlink()
        m.pop("calibration", None)
    m["reference"] = desc
    run.save_manifest()
    done = set(run.read("reference", ["request_id"]).column("request_id").to_pylist())
    req = run.read("requests", ["request_id", "prompt_token_ids", "output_token_ids", "error"]).to_pylist()
    items = [ScoreItem(r["request_id"], r["prompt_token_ids"], r["output_token_ids"])
             for r in req if r["error"] is None and r["output_token_ids"] and r["request_id"] not in done]
    total = sum(len(r["output_token_ids"]) for r in req if r["error"] is None)
    on_start(total, total - sum(len(it.output_token_ids) for it in items))
    for table in rescorer.score(items, tick):
        run.append("reference", table)


# -- calibrate ------------------------------------------------------------------------------------
def engine_dtype(m: dict) -> str | None:
    """The dtype the engine computed in: its manifest options, else its Options' default."""
    engine = m.get("engine") or {}
    opts = engine.get("options") or {}
    if opts.get("dtype"):
        return str(opts["dtype"])
    from dataclasses import fields

    try:
        default = {f.name: f.default for f in fields(get_engine_class(engine.get("name", "")).Options)}
    except LpfError:
        return None
    return default.get("dtype")


def calibrate_run(run: RunDir, token_budget: int = 16384,
                  on_start: Callable[[int, int], None] = lambda total, done: None, tick: Tick = _noop) -> dict:
    """The calibration run: teacher-force the reference model again, at the engine's dtype, over
    every request the reference scored, into `calibration/` parts (resumable like rescore). Its
    |calibration - reference| per token is what an honest implementation at that dtype deviates by:
    `analyze` takes the noise floor from it instead of from the engine's own (possibly lying)
    errors. When the engine's dtype is the reference's, the calibration run would be the reference
    itself (floor 0): nothing is computed and the manifest says so. Returns manifest["calibration"]."""
    from lpf.reference import Rescorer, ScoreItem

    m = run.manifest
    ref = m.get("reference")
    if not ref or not run.has("reference"):
        raise LpfError(f"{run.path} has no reference scores yet: rescore it before calibrating")
    dtype = engine_dtype(m)
    if dtype not in ("float32", "float16", "bfloat16"):
        raise LpfError(f"cannot calibrate {run.path}: the engine's dtype is {dtype or 'not recorded'} "
                       f"(a calibration run needs float32, float16 or bfloat16; set the engine's --dtype)")
    prev = m.get("calibration") or {}
    if (prev.get("spec"), prev.get("dtype"), prev.get("reference_dtype")) != (ref.get("spec"), dtype, ref.get("dtype")):
        for p in run.parts("calibration"):  # made for another reference or dtype: not this run's floor
            p.unlink()
        prev = {}
    if dtype == ref.get("dtype"):
        m["calibration"] = {"spec": ref.get("spec"), "dtype": dtype, "reference_dtype": ref.get("dtype"),
                            "same_as_reference": True}
        run.save_manifest()
        return m["calibration"]
    rescorer = Rescorer(resolve_model(ref["spec"]), dtype=dtype, token_budget=token_budget,
                        topk=m["sampling"].get("logprobs", 5))
    m["calibration"] = {**{k: v for k, v in rescorer.describe().items() if k != "tokenizer_sha256"},
                        "reference_dtype": ref.get("dtype"), "same_as_reference": False}
    run.save_manifest()
    scored = set(run.read("reference", ["request_id"]).column("request_id").to_pylist())
    done = set(run.read("calibration", ["request_id"]).column("request_id").to_pylist())
    req = run.read("requests", ["request_id", "prompt_token_ids", "output_token_ids"]).to_pylist()
    req = [r for r in req if r["request_id"] in scored]
    items = [ScoreItem(r["request_id"], r["prompt_token_ids"], r["output_token_ids"])
             for r in req if r["request_id"] not in done]
    total = sum(len(r["output_token_ids"]) for r in req)
    on_start(total, total - sum(len(it.output_token_ids) for it in items))
    for table in rescorer.score(items, tick):
        run.append("calibration", table)
    return m["calibration"]


def _calibration(run: RunDir, reference: pa.Table) -> tuple[pa.Table | None, dict | None]:
    """(calibration table, its manifest entry) when the run has a calibration run for its current
    reference; the reference itself when the engine computed at the reference's dtype."""
    cal, ref = run.manifest.get("calibration"), run.manifest.get("reference") or {}
    if not cal or (cal.get("spec"), cal.get("reference_dtype")) != (ref.get("spec"), ref.get("dtype")):
        return None, None
    if cal.get("same_as_reference"):
        return reference, cal
    return (run.read("calibration"), cal) if run.has("calibration") else (None, None)


# -- analyze --------------------------------------------------------------------------------------
def analyze_run(run: RunDir, thresholds: Thresholds) -> dict:
    m = run.manifest
    requests = run.read("requests")
    if requests.num_rows == 0:
        raise LpfError(f"{run.path} has no completed requests to analyze")
    trace = run.read("trace") if run.has("trace") else None  # engines without a trace: metadata only
    temperature = m["sampling"].get("temperature", 0) or 0
    reference = run.read("reference")
    calibration, cal_info = _calibration(run, reference)
    summary, findings = analyze(requests, run.read("tokens"), reference, thresholds,
                                greedy=temperature == 0, trace=trace, engine_info=m.get("engine"),
                                temperature=temperature, calibration=calibration, calibration_info=cal_info)
    findings = {"run_id": m.get("run_id"), "engine": m["engine"].get("name"), "model": m["model"].get("spec"),
                "reference": (m.get("reference") or {}).get("spec"), **findings}
    findings["run_complete"] = m.get("status") == "complete"
    import pyarrow.parquet as pq

    pq.write_table(summary, run.path / "summary.parquet")
    run.write_json("findings.json", finite(findings))
    return finite(findings)


