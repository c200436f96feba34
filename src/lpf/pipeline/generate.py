"""The run stage: a validated `RunSpec` becomes a run directory, and its requests become committed parts.

`create_run(spec)` (an `AuditSpec`, or a bare `RunSpec` audited with the defaults) checks everything
the user can get wrong (engine name, knobs, model, workload, a configuration that can hold no request)
before the directory exists, so a bad invocation writes nothing; the spec goes to `RUN/spec.json`.
`open_audit(spec)` is the same, or the directory reopened when it already holds this same audit (an
interrupted one: rerunning it finishes it), and refuses a directory holding another. `execute_run(run, on_start, tick)` sends every not-yet-completed request to the engine and
commits completions in parts as they finish (side tables such as the trace first, then tokens, then
requests: a request part never exists without what led to it); what finished before an error or
Ctrl-C is kept, and a rerun resumes (its engine's steps numbered after the earlier sessions', so a
step names one batch); the manifest's engine section gets `declared` (what the user said the engine
runs, `declared()`) at creation and `configuration` (`lpf.run.configuration.block`: what the engine
says of itself with what was declared) when the engine starts. `failed_requests(run)` is the one line on the requests that failed, their errors
grouped by shape with what to try; `all_failed(run)` is that line when every request failed (the run
ends with it, exit 2).
"""

from __future__ import annotations

import json
import platform
import socket
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

import lpf
from lpf.adapters import get_engine_class
from lpf.core.errors import LpfError
from lpf.core.model_specs import ModelRef, load_tokenizer, resolve_model, tokenizer_fingerprint
from lpf.pipeline.callbacks import OnStart, Tick, no_start, no_tick
from lpf.pipeline.trace import check_joinable
from lpf.run import configuration, schema
from lpf.run.store import RunDir
from lpf.core.sampling import SamplingParams
from lpf.core.workload import EngineRequest, expand, load_prompts, normalized, read_normalized


def model_config(model: ModelRef) -> dict:
    try:
        cfg = json.loads((model.path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LpfError(f"model {model.spec}: unreadable config.json ({e})") from None
    return cfg.get("text_config", cfg)


def create_run(spec) -> RunDir:
    """`spec`: an AuditSpec, or a RunSpec (audited with the defaults)."""
    from lpf.pipeline.spec import AuditSpec  # pydantic: not for every importer of lpf.pipeline (the rescorer's)

    audit = spec if isinstance(spec, AuditSpec) else AuditSpec(run=spec)
    spec = audit.run
    engine_cls = get_engine_class(spec.engine)
    if spec.trace_dir is not None:
        check_joinable(spec.engine)
    options = engine_cls.Options.parse(spec.engine_options)  # a bad knob is refused before anything is written
    model = resolve_model(spec.model)
    cfg = model_config(model)
    engine_cls.check_model(cfg)
    if spec.sampling.prompt_logprobs and not engine_cls.supports_prompt_logprobs:
        raise LpfError(f"--prompt-logprobs: the {spec.engine} engine cannot return prompt logprobs")
    tokenizer = load_tokenizer(model)
    context = cfg.get("max_position_embeddings")
    prompts, source = load_prompts(
        spec.workload,
        tokenizer,
        cfg.get("vocab_size", len(tokenizer)),
        context,
        chat=engine_cls.chat_prompts(options),
        limit=spec.limit,
    )
    requests = expand(prompts, spec.n, spec.sampling, context)
    engine_cls.check_capacity(model, options, requests)
    manifest = {
        "run_id": uuid.uuid4().hex[:12],
        "lpf_version": lpf.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "status": "running",
        "engine": {"name": spec.engine, "options": dict(spec.engine_options), "declared": declared(spec, options)},
        "model": {**model.describe(), "architecture": (cfg.get("architectures") or ["?"])[0]},
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "workload": {**source, "n_prompts": len(prompts), "n": spec.n, "n_requests": len(requests)},
        "sampling": spec.sampling.to_dict(),
        "seed": spec.sampling.seed,
        "part_size": spec.part_size,
        **({"trace_dir": str(Path(spec.trace_dir).resolve())} if spec.trace_dir is not None else {}),
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    return RunDir.create(
        spec.out, manifest, {"workload.jsonl": normalized(prompts), "spec.json": audit.to_json().encode()}
    )


def declared(spec, options) -> dict:
    """What the user declared of the engine's configuration: the spec's `declared` and, for a server the
    user started (`base_url`), its `dtype` knob (on an engine lpf starts, the dtype is a setting it applies)."""
    out = spec.declared.model_dump(exclude_none=True)
    if getattr(options, "base_url", "") and getattr(options, "dtype", None):
        out["dtype"] = options.dtype
    return out


def open_audit(spec) -> RunDir:
    """`create_run(spec)`, or the run directory reopened when it already holds this same audit (its
    spec.json equal but for the directory's own path)."""
    from lpf.pipeline.spec import read_spec

    out = Path(spec.run.out)
    if not (out / "manifest.json").is_file():
        return create_run(spec)
    run = RunDir.open(out)
    stored = read_spec(out)
    if stored is None or stored.identity() != spec.identity():
        what = "a run without spec.json" if stored is None else "another audit (its spec.json differs)"
        raise LpfError(f"{out} holds {what}: choose another --out")
    return run


def pending_requests(run: RunDir) -> list[EngineRequest]:
    m = run.manifest
    prompts = read_normalized(run.path / "workload.jsonl")
    requests = expand(prompts, m["workload"]["n"], SamplingParams.from_dict(m["sampling"]))
    done = run.done_request_ids()
    return [r for r in requests if r.request_id not in done]


def execute_run(run: RunDir, on_start: OnStart = no_start, tick: Tick = no_tick) -> None:
    """Send every not-yet-completed request to the engine, committing parts as they finish."""
    with run.writer():
        _execute(run, on_start, tick)


def _execute(run: RunDir, on_start: OnStart, tick: Tick) -> None:
    m = run.manifest
    pending = pending_requests(run)
    on_start(m["workload"]["n_requests"], m["workload"]["n_requests"] - len(pending))
    if pending:
        engine_cls = get_engine_class(m["engine"]["name"])
        model = resolve_model(m["model"]["spec"])
        sampling = SamplingParams.from_dict(m["sampling"])
        engine = engine_cls(model, sampling, engine_cls.Options.parse(m["engine"]["options"]))
        m["engine"].update(engine.describe())
        m["engine"]["configuration"] = configuration.block(engine.configuration(), m["engine"].get("declared"))
        run.save_manifest()
        tokenizer = load_tokenizer(model)
        by_id = {r.request_id: r for r in pending}
        step_base = _next_step(run)  # a resumed run's engine counts steps from 0 again: keep them unique
        buffer, last = [], time.monotonic()
        try:
            for c in engine.generate(pending):
                buffer.append(c)
                tick(1)
                if len(buffer) >= m.get("part_size", 64) or time.monotonic() - last > 10:
                    _commit(run, engine, buffer, by_id, tokenizer, step_base)
                    buffer, last = [], time.monotonic()
            m["engine"].update(engine.describe())  # what the run taught it (HTTP retries, token identity)
        finally:
            if buffer:  # what finished before an error or Ctrl-C is kept
                _commit(run, engine, buffer, by_id, tokenizer, step_base)
            from lpf.pipeline.reference_vllm_self import hold

            if not hold(engine):  # an audit's self-reference re-scores in this same engine
                engine.close()
    m["status"] = "complete"
    run.save_manifest()


def failed_requests(run: RunDir) -> str | None:
    """One line on the run's failed requests (None when none failed): how many of how many, and
    their errors grouped by shape (ids and numbers aside), commonest first, with what to try."""
    from lpf.analysis.error_shapes import summary

    t = run.read("requests", ["request_id", "error"])
    errors = t.column("error").to_pylist()
    failed = sum(e is not None for e in errors)
    if not failed:
        return None
    everything = "every request failed" if failed == len(errors) else "requests failed"
    return f"{everything} ({failed} of {len(errors)}): {summary(errors, t.column('request_id').to_pylist())}"


def all_failed(run: RunDir) -> str | None:
    """`failed_requests`' line when every request of the run failed (None when any completed)."""
    line = failed_requests(run)
    return line if line and line.startswith("every request failed") else None


def _next_step(run: RunDir) -> int:
    steps = [run.read(t, ["step"]).column("step") for t in ("trace", "faults") if run.has(t)]
    top = max((pc.max(s).as_py() for s in steps if len(s)), default=None)
    return 0 if top is None else int(top) + 1


def _commit(run: RunDir, engine, completions, by_id: dict[str, EngineRequest], tokenizer, step_base: int = 0) -> None:
    req_rows, tok, ptok = [], {k: [] for k in schema.TOKENS.names}, {k: [] for k in schema.PROMPT_TOKENS.names}
    for c in completions:
        r = by_id[c.request_id]
        text = tokenizer.decode(c.output_token_ids, skip_special_tokens=True) if c.error is None else None
        req_rows.append(
            {
                "request_id": r.request_id,
                "seq": r.seq,
                "prompt_id": r.prompt_id,
                "rollout": r.rollout,
                "prompt_token_ids": list(r.prompt_token_ids),
                "output_token_ids": c.output_token_ids,
                "output_text": text,
                "finish_reason": "error" if c.error else c.finish_reason,
                "error": c.error,
                "t_submit": c.t_submit,
                "t_first_token": c.t_first_token,
                "t_finish": c.t_finish,
                "oracle_expected": r.expected,
                "oracle_ok": None if r.expected is None or text is None else text.strip() == r.expected.strip(),
                "inconsistency": c.inconsistency,
                "attempts": c.attempts,
            }
        )
        n = len(c.logprobs)
        tok["request_id"] += [r.request_id] * n
        tok["position"] += list(range(n))
        tok["token_id"] += c.output_token_ids[:n]
        tok["engine_logprob"] += c.logprobs
        tok["engine_topk_ids"] += c.topk_ids or [[]] * n
        tok["engine_topk_logprobs"] += c.topk_logprobs or [[]] * n
        if c.prompt_logprobs:  # positions 1..P-1 of the prompt: position 0 has nothing before it
            k = min(len(c.prompt_logprobs), len(r.prompt_token_ids) - 1)
            if k != len(c.prompt_logprobs) and req_rows[-1]["inconsistency"] is None:  # kept, and said so
                req_rows[-1]["inconsistency"] = (
                    f"{len(c.prompt_logprobs)} prompt logprobs for a prompt of "
                    f"{len(r.prompt_token_ids)} tokens (positions 1..{k} kept)"
                )
            ptok["request_id"] += [r.request_id] * k
            ptok["position"] += list(range(1, k + 1))
            ptok["token_id"] += list(r.prompt_token_ids[1 : k + 1])
            ptok["engine_logprob"] += c.prompt_logprobs[:k]
            ptok["engine_topk_ids"] += c.prompt_topk_ids[:k] or [[]] * k
            ptok["engine_topk_logprobs"] += c.prompt_topk_logprobs[:k] or [[]] * k
    # side tables first: a request part must never exist without the trace that led to it
    for name, table in engine.side_tables().items():
        if table is not None and table.num_rows:
            if step_base and "step" in table.column_names:
                table = table.set_column(
                    table.column_names.index("step"), "step", pc.add(table.column("step"), step_base)
                )
            run.append(name, table)
    run.append_requests(
        pa.Table.from_pylist(req_rows, schema=schema.REQUESTS),
        pa.table(tok, schema=schema.TOKENS),
        pa.table(ptok, schema=schema.PROMPT_TOKENS) if ptok["request_id"] else None,
    )
