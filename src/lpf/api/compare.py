"""`lpf.compare`: outputs a test produced with its own engine, in its own process, judged like an audit.

`Reference(model, dtype)` loads the reference once (on first use); `Reference.compare(outputs, ...)` writes
a run directory of the run schema from the outputs (`lpf.api.outputs`: prompt ids, output ids, logprobs,
top-k), rescores it with that loaded model, analyses it (the same `lpf.pipeline` stages as `lpf audit`,
no engine adapter), writes report.html and returns `Findings`. `compare(outputs, reference=..., dtype=...)`
is the same with a reference loaded for the call, its `dtype` naming the engine's dtype too (when neither
`engine_dtype=` nor the engine's description names one): `compare(outputs, reference=M, dtype="float32")`
is judged against the float32/float32 floor, not the lenient floor of an engine of unknown dtype.

The reference is any that `lpf audit --reference` takes except `self` (there is no server to ask: refused in
one line): a model (transformers, loaded here), a trusted deployment `http(s)://HOST:PORT/v1` with
`reference_model=` (its served name) and `model=` (`Reference(local_model=)`: the local copy of the served
model, for its tokenizer), or `vllm:MODEL` with `reference_option=["KEY=VALUE"]` (vLLM's reference
configuration). A server or vLLM reference scores the run through the audit's own rescore stage
(`lpf.pipeline.rescore.rescore_run`: the same construction, the same checks, the same manifest block).

What the analysis can say grows with what the test hands over: `trace` (a table of the run schema's trace
columns, request ids as in the outputs, kept whole: the built-in engine's side table) or `trace_dir` (the lpf-vllm-trace
plugin's directory of a vLLM run, `LPF_VLLM_TRACE_DIR`: its rows, and the drills' ground truth in
`faults/`, are copied in with vLLM's ids mapped to the outputs' `request_id`s) lets the hypotheses name a
mechanism; `engine` (a name, or the engine's own description: name, version, options, cache) goes to the
manifest; `engine_dtype` picks the expected noise floor. `rule="first-mismatch-topk"` also runs the peer's
rule (`lpf.analysis.peer_rule`) on the same tokens: findings.json's `peer_rule`, `Findings.rule`.
Every bad input is an `LpfError` raised before the run directory exists.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from lpf.api.findings import Findings
from lpf.api.outputs import Output, read_outputs
from lpf.core.errors import LpfError

DEFAULT_TOPK = 5
DTYPES = ("float32", "bfloat16", "float16")  # the reference's (lpf.core.torch_utils.DTYPES, without importing torch)


class Reference:
    """The reference model for `compare`, loaded once (on first use) and kept: a test session's fixture."""

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        device: str = "cpu",
        token_budget: int = 16384,
        topk: int = DEFAULT_TOPK,
        runs_dir: Path | str | None = None,
        *,
        reference_model: str | None = None,
        reference_concurrency: int | None = None,
        reference_option: Sequence[str] = (),
        local_model: str | None = None,
    ):
        """`runs_dir`: where `compare` puts a run directory when it is given no `out` (default: the system's
        temporary directory). `model` may also be a server or vLLM reference (module docstring), with
        `reference_model`, `reference_concurrency`, `reference_option` and `local_model` as `lpf audit`'s
        --reference-model, --reference-concurrency, -R and --model."""
        from lpf.core.model_specs import resolve_model
        from lpf.pipeline.reference_http import reference_form

        if dtype not in DTYPES:
            raise LpfError(f"dtype={dtype!r}: choose from {', '.join(DTYPES)}")
        if topk < 1:
            raise LpfError(f"topk must be >= 1, got {topk}")
        self.spec, self.dtype, self.device, self.token_budget, self.topk = model, dtype, device, token_budget, topk
        self.form = reference_form(model)
        self.settings = None
        if self.form == "self":
            raise LpfError(
                "reference='self' re-scores on the audited server, and lpf.compare has outputs, not a server: pass a "
                "model, a trusted deployment http(s)://HOST:PORT/v1 (with reference_model=) or vllm:MODEL"
            )
        if self.form == "transformers":
            from lpf.pipeline.reference_http import check_settings

            if local_model is not None:
                raise LpfError(
                    "local_model (model=) goes with an http(s):// or vllm: reference, not a transformers one"
                )
            check_settings(model, reference_model, reference_concurrency, "local", tuple(reference_option))
        else:
            from lpf.pipeline.rescore import RescoreSettings

            self.settings = RescoreSettings(
                reference=model,
                dtype=dtype,
                device=device,
                token_budget=token_budget,
                reference_model=reference_model,
                reference_concurrency=reference_concurrency,
                reference_option=tuple(reference_option),
            )
            self.settings.validate()  # the audit's one-line refusals, before anything is written
            if self.form == "http" and local_model is None:
                raise LpfError(
                    f"reference={model!r}: give model= (the local copy of the served model: its tokenizer and ids)"
                )
            if local_model is None:  # vllm:MODEL: the model is local already
                from lpf.pipeline.reference_vllm import parse_spec

                local_model = parse_spec(model)
        self.model = resolve_model(local_model or model)  # LpfError for a model that is not there
        self.runs_dir = None if runs_dir is None else Path(runs_dir)
        self._rescorer = None

    @property
    def rescorer(self):
        """The loaded transformers rescorer (a transformers reference only)."""
        if self._rescorer is None:
            from lpf.pipeline.reference import Rescorer

            self._rescorer = Rescorer(
                self.model, dtype=self.dtype, device=self.device, token_budget=self.token_budget, topk=self.topk
            )
        return self._rescorer

    def compare(
        self,
        outputs,
        *,
        out: Path | str | None = None,
        rule: str | None = None,
        engine: str | Mapping[str, Any] = "external",
        engine_dtype: str | None = None,
        temperature: float = 0.0,
        trace=None,
        trace_dir: Path | str | None = None,
        thresholds: Mapping[str, float] | None = None,
        threshold: Sequence[str] = (),
        attribution: bool = False,
    ) -> Findings:
        """Judge `outputs` against this reference; the run directory goes to `out` (default: a new
        directory `lpf-compare-*` under `runs_dir`). See the module docstring for the arguments."""
        from lpf.analysis.peer_rule import RULES
        from lpf.analysis.thresholds import Thresholds

        if rule is not None and rule not in RULES:
            raise LpfError(f"rule={rule!r}: choose from {', '.join(RULES)}")
        th = Thresholds().with_overrides([*threshold, *(f"{k}={v!r}" for k, v in (thresholds or {}).items())])
        records = read_outputs(outputs)
        engine_section = _engine_section(engine, engine_dtype)
        ids = {r.request_id for r in records}
        trace_table, faults, trace_info = _trace(trace, trace_dir, ids)
        self._check_tokens(records)
        if out is None:
            if self.runs_dir is not None:
                self.runs_dir.mkdir(parents=True, exist_ok=True)
            out = tempfile.mkdtemp(prefix="lpf-compare-", dir=self.runs_dir)
        run = _create(out, records, engine_section, self, temperature, trace_info)
        try:
            if trace_table is not None and trace_table.num_rows:
                run.append("trace", trace_table)
            if faults is not None and faults.num_rows:
                run.append("faults", faults)
            _commit(run, records)
            self._rescore(run, records)
            return finish(run, th, attribution=attribution, rule=rule)
        except BaseException:
            run.manifest["status"] = "failed"
            run.save_manifest()
            raise

    def _vocab_size(self) -> int:
        if self.settings is None:
            return self.rescorer.vocab_size
        import json

        cfg = json.loads((self.model.path / "config.json").read_text())
        return int((cfg.get("text_config") or cfg)["vocab_size"])

    def _check_tokens(self, records: list[Output]) -> None:
        vocab = self._vocab_size()
        for r in records:
            bad = next((t for t in (*r.prompt_token_ids, *r.output_token_ids) if not 0 <= t < vocab), None)
            if bad is not None:
                raise LpfError(
                    f"{r.request_id}: token id {bad} is outside the reference's vocabulary of {vocab} "
                    f"(is {self.spec} the engine's model?)"
                )

    def _rescore(self, run, records: list[Output]) -> None:
        if self.settings is not None:  # a server or vLLM: the audit's rescore stage
            from lpf.pipeline.rescore import rescore_run

            rescore_run(run, settings=self.settings)
            return
        from lpf.pipeline.reference import ScoreItem

        rescorer = self.rescorer
        run.manifest["reference"] = {**rescorer.describe(), "executor": "local"}
        run.save_manifest()
        items = [ScoreItem(r.request_id, r.prompt_token_ids, r.output_token_ids) for r in records if r.output_token_ids]
        with run.writer():
            for scored in rescorer.score_all(items):
                run.append_reference(scored.reference, scored.prompt_reference, scored.seeded)


def compare(
    outputs,
    reference: str,
    dtype: str | None = None,
    rule: str | None = None,
    *,
    device: str | None = None,
    reference_dtype: str | None = None,
    reference_device: str | None = None,
    token_budget: int = 16384,
    model: str | None = None,
    reference_model: str | None = None,
    reference_concurrency: int | None = None,
    reference_option: Sequence[str] = (),
    **kwargs,
) -> Findings:
    """`Reference(reference, dtype, device, token_budget).compare(outputs, rule=rule, **kwargs)`: the reference
    loaded for this call only (a test suite keeps one: the pytest plugin's `lpf_reference` fixture).
    `reference_dtype` / `reference_device` are `lpf audit`'s names for `dtype` / `device` (give one of each).
    The short `dtype` names the engine's dtype too unless `engine_dtype=` (or the engine description's
    `options.dtype`) says otherwise: the floor is that of the pair, never the lenient one of an engine of
    unknown dtype; `reference_dtype` names the reference's alone. A server or vLLM `reference` takes `model`
    (the local copy of the served model), `reference_model`, `reference_concurrency` and `reference_option`
    as `lpf audit` does (module docstring)."""
    for name, short, long in (("dtype", dtype, reference_dtype), ("device", device, reference_device)):
        if short is not None and long is not None:
            raise LpfError(f"give reference_{name} or {name}, not both")
    engine = kwargs.get("engine")
    named = isinstance(engine, Mapping) and (engine.get("options") or {}).get("dtype") is not None
    if dtype is not None and kwargs.get("engine_dtype") is None and not named:
        kwargs["engine_dtype"] = dtype
    dtype = dtype or reference_dtype or "float32"
    device = device or reference_device or "cpu"
    return Reference(
        reference,
        dtype=dtype,
        device=device,
        token_budget=token_budget,
        reference_model=reference_model,
        reference_concurrency=reference_concurrency,
        reference_option=reference_option,
        local_model=model,
    ).compare(outputs, rule=rule, **kwargs)


def finish(run, thresholds, attribution: bool = True, rule: str | None = None) -> Findings:
    """Analyse a rescored run, add the peer's rule when asked, write report.html: its `Findings`."""
    from lpf.pipeline import analyze_run

    findings = analyze_run(run, thresholds, attribution)
    if rule is not None:
        from lpf.analysis.peer_rule import first_mismatch_topk, summarize

        results = first_mismatch_topk(
            run.read("tokens", ["request_id", "position", "token_id", "engine_topk_ids"]),
            run.read("reference", ["request_id", "position", "ref_top1_id", "ref_topk_ids"]),
        )
        findings["peer_rule"] = {**summarize(results), "requests": results}
        run.write_json("findings.json", findings)
    try:
        from lpf.report import write_report

        write_report(run.path)
    except LpfError:  # a report that cannot be drawn never costs the findings (Findings.report stays None)
        pass
    return Findings.load(run.path)


# -- the run directory ------------------------------------------------------------------------------
def _engine_section(engine, engine_dtype: str | None) -> dict:
    if isinstance(engine, str):
        section: dict = {"name": engine, "options": {}}
    elif isinstance(engine, Mapping):
        section = {"name": "external", **dict(engine)}
        section["options"] = dict(section.get("options") or {})
    else:
        raise LpfError(f"engine: a name or a mapping (the engine's description), got {type(engine).__name__}")
    if engine_dtype is not None:
        section["options"]["dtype"] = engine_dtype
    return section


def _create(out, records: list[Output], engine: dict, ref: Reference, temperature: float, trace_info: dict | None):
    import json as _json
    import platform
    import socket

    import lpf
    from lpf.core.model_specs import load_tokenizer, tokenizer_fingerprint
    from lpf.core.sampling import SamplingParams
    from lpf.core.workload import Prompt, normalized
    from lpf.run.store import RunDir

    path = Path(out)
    k = max((len(t) for r in records for t in r.topk_ids), default=0)
    sampling = SamplingParams(
        temperature=temperature,
        max_tokens=max(1, max(len(r.output_token_ids) for r in records)),
        logprobs=min(20, max(k, ref.topk)),
    )
    cfg = _json.loads((ref.model.path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    # one prompt per request (two requests of one prompt are two prompts here: their order is what counts)
    workload = normalized(
        [Prompt(r.request_id, tuple(r.prompt_token_ids), None, len(r.output_token_ids)) for r in records]
    )
    manifest = {
        "run_id": uuid.uuid4().hex[:12],
        "lpf_version": lpf.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "status": "complete",  # the engine ran before lpf saw it: nothing left to generate
        "source": "lpf.compare",
        "engine": engine,
        "model": {**ref.model.describe(), "architecture": (cfg.get("architectures") or ["?"])[0]},
        "tokenizer_sha256": tokenizer_fingerprint(load_tokenizer(ref.model)),
        "workload": {"source": "lpf.compare", "n_prompts": len(records), "n": 1, "n_requests": len(records)},
        "sampling": sampling.to_dict(),
        "seed": sampling.seed,
        "part_size": len(records),
        **({"trace": trace_info} if trace_info else {}),
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    return RunDir.create(path, manifest, {"workload.jsonl": workload})


def _commit(run, records: list[Output]) -> None:
    import pyarrow as pa

    from lpf.run import schema

    now = time.time()
    req = pa.Table.from_pylist(
        [
            {
                "request_id": r.request_id,
                "seq": i,
                "prompt_id": r.prompt_id or r.request_id,
                "rollout": 0,
                "prompt_token_ids": r.prompt_token_ids,
                "output_token_ids": r.output_token_ids,
                "finish_reason": r.finish_reason,
                "t_finish": now,
                "attempts": [],
            }
            for i, r in enumerate(records)
        ],
        schema=schema.REQUESTS,
    )
    tok = {
        "request_id": [r.request_id for r in records for _ in r.output_token_ids],
        "position": [p for r in records for p in range(len(r.output_token_ids))],
        "token_id": [t for r in records for t in r.output_token_ids],
        "engine_logprob": [x for r in records for x in r.logprobs],
        "engine_topk_ids": [t for r in records for t in (r.topk_ids or [[]] * len(r.output_token_ids))],
        "engine_topk_logprobs": [t for r in records for t in (r.topk_logprobs or [[]] * len(r.output_token_ids))],
    }
    with run.writer():
        run.append_requests(req, pa.table(tok, schema=schema.TOKENS))


# -- the trace ----------------------------------------------------------------------------------------
def _trace(trace, trace_dir, ids: set[str]):
    """(trace table, faults table, manifest["trace"]) from a trace table or a vLLM plugin directory."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if trace is not None and trace_dir is not None:
        raise LpfError("trace and trace_dir: give one")
    if trace is not None:
        if (
            not isinstance(trace, pa.Table)
            or "request_id" not in trace.column_names
            or "step" not in trace.column_names
        ):
            raise LpfError("trace: a pyarrow Table with the run schema's trace columns (request_id, step, phase, ...)")
        # every row, those of ids the outputs do not carry included: a cancelled attempt's rows (`ID~attempt0`)
        # are where the prefix-cache features find an aborted publisher
        return trace, None, {"source": "engine", "recorded": trace.num_rows > 0, "rows": trace.num_rows, "why": None}
    if trace_dir is None:
        return None, None, None
    from lpf.adapters.vllm_trace import PluginDir, prefix_cache_info, relabel

    plugin = PluginDir(trace_dir)
    status = plugin.status()
    if status is None:
        raise LpfError(
            f"trace_dir {trace_dir}: no trace_status.json (was vLLM run with LPF_VLLM_TRACE_DIR={trace_dir} "
            f"and lpf-vllm-trace installed?)"
        )
    info = {
        "source": "vllm-plugin",
        "dir": str(plugin.path),
        "plugin_version": status.get("plugin_version"),
        "vllm_version": status.get("vllm_version"),
        "state_slot_stride": status.get("state_slot_stride"),
        "faults": [d for d in (status.get("inject") or "").split(",") if d],
        "cache": prefix_cache_info(status),
        "why": status.get("why"),
    }
    tables = {}
    for name in ("trace", "faults"):
        t = plugin.take(name)
        if t is not None:
            mapping = _vllm_ids(t.column("request_id").to_pylist(), ids)
            t = relabel(t, mapping)
            t = t.filter(pc.is_in(t.column("request_id"), value_set=pa.array(sorted(ids), pa.string())))
        tables[name] = t
    n = tables["trace"].num_rows if tables["trace"] is not None else 0
    info.update(recorded=n > 0, rows=n)
    if not n and info["why"] is None:
        info["why"] = f"none of the trace rows in {plugin.path} name the outputs' request ids"
    return tables["trace"], tables["faults"], info


def _vllm_ids(vllm_ids, ids: set[str]) -> dict[str, str]:
    """{vLLM's runner id: the outputs' id}: the same, or with the random suffix vLLM appends internally."""
    from lpf.adapters.vllm_trace import _RANDOM_SUFFIX

    out = {}
    for vid in set(v for v in vllm_ids if v is not None):
        m = _RANDOM_SUFFIX.match(vid)
        if vid in ids:
            out[vid] = vid
        elif m and m.group(1) in ids:
            out[vid] = m.group(1)
    return out
