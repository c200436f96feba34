"""What a shrink leaves for a bug report: `DIR/workload.jsonl`, `command.sh`, `repro.py`, `report.md`.

Contract: `write_outputs(out, source, doc) -> list[Path]` writes, for the shrink
document's minimum (`doc["minimal"]`):
- `workload.jsonl`: the minimal requests in arrival order (ids are the original request ids);
- `command.sh`: the one `lpf audit` line that reproduces it (exit 1 when the lie shows), rendered
  from the minimum's AuditSpec (`spec.audit_command`: argv exists only here, for people);
- `repro.py` (built-in engine and vLLM only): `repro_script.py` with its `CONFIG` filled in
  (`script_config`), standalone: the engine and transformers, nothing else of lpf;
- `report.md`: engine and model versions, the model config fields that matter, the knobs, the
  observed vs expected logprobs at the first divergence (from a minimal run that showed the lie),
  the original run's ranked hypotheses and the shrink log.
Every file appears atomically. `script_config` and `write_script` are public so a reproducer can
be written for a configuration given by hand (tests, other engines' runs).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from lpf.adapters.vllm import VLLM_ENV
from lpf.adapters import capability
from lpf.core.sampling import request_seed
from lpf.experiments.shrink.config import Config, Source
from lpf.experiments.shrink.signature import Signature

CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "layer_types",
    "attn_layer_period",
    "attn_layer_offset",
    "num_attention_heads",
    "num_key_value_heads",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_expand",
    "mamba_n_heads",
    "mamba_d_head",
    "num_experts",
    "num_local_experts",
    "vocab_size",
    "max_position_embeddings",
    "torch_dtype",
    "dtype",
)
VLLM_INJECT_ENV = "LPF_VLLM_INJECT"  # the lpf vLLM trace plugin's drill switch


def _write(path: Path, text: str, mode: int | None = None) -> Path:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)
    return path


def script_config(
    engine: dict,
    model_dir: str,
    items: list[dict],
    target_id: str,
    sampling: dict,
    thresholds: dict,
    position_class: str,
    reference_dtype: str = "float32",
) -> dict:
    """The reproducer's data. `engine`: a run manifest's engine section (name, options, and for vLLM
    the `engine_args` it started with); `items`: the workload items in arrival order."""
    from lpf.analysis.thresholds import Thresholds

    name, options = engine["name"], dict(engine.get("options") or {})
    th = {k: thresholds.get(k, v) for k, v in Thresholds().to_dict().items()}
    cfg = {
        "engine": name,
        "model_dir": str(model_dir),
        "target": target_id,
        "reference_dtype": reference_dtype,
        "position_class": position_class,
        "thresholds": th,
        "sampling": {
            k: sampling[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "seed", "ignore_eos", "logprobs")
        },
        "requests": [
            {
                "id": it["id"],
                "prompt_token_ids": it["prompt_token_ids"],
                "max_tokens": it["max_tokens"],
                "seed": request_seed(sampling["seed"], i),
                **({"abort_after_tokens": it["abort_after_tokens"]} if it.get("abort_after_tokens") else {}),
            }
            for i, it in enumerate(items)
        ],
    }
    if name == "builtin":
        from lpf.builtin.config import EngineConfig

        cfg.update(
            engine_config={k: options[k] for k in EngineConfig.model_fields if k in options},
            inject=options.get("inject") or "",
            threads=options.get("threads") or 1,
        )
    elif name == "vllm":
        env = dict(VLLM_ENV, VLLM_CPU_KVCACHE_SPACE=f"{options.get('cpu_kvcache_space') or 1.0:g}")
        if options.get("inject"):
            env[VLLM_INJECT_ENV] = str(options["inject"])
        cfg.update(engine_args=dict(engine.get("engine_args") or {}), env=env)
    else:
        raise ValueError(f"no standalone reproducer for engine {name!r}")
    return cfg


def write_script(path: Path, cfg: dict) -> Path:
    template = (Path(__file__).with_name("repro_script.py")).read_text()
    marker = "CONFIG = None  # lpf shrink writes the reproducer's data here"
    if marker not in template:
        raise RuntimeError("repro_script.py lost its CONFIG marker")
    data = json.dumps(cfg, indent=1)
    return _write(Path(path), template.replace(marker, f"CONFIG = json.loads(r'''{data}''')"), 0o755)


def locate_offer(out: Path, doc: dict) -> dict:
    """`lpf locate` on the minimum: the minimal run that showed the lie and its target request."""
    minimal = doc["minimal"]
    cand = next(c for c in doc["candidates"] if c["id"] == minimal["candidate"])
    shown = next((t for t in cand["tries"] if t["lie"]), cand["tries"][0])
    run_dir = Path(out) / shown["dir"]
    return {
        "run_dir": str(run_dir),
        "request_id": shown["request_id"],
        "command": f"lpf locate {run_dir} --request {shown['request_id']}",
    }


def write_outputs(out: Path, source: Source, doc: dict) -> list[Path]:
    from lpf.run.store import RunDir

    out = Path(out)
    minimal = doc["minimal"]
    config = source.config(minimal["config"])
    cand = next(c for c in doc["candidates"] if c["id"] == minimal["candidate"])
    shown = next((t for t in cand["tries"] if t["lie"]), cand["tries"][0])
    run = RunDir.open(out / shown["dir"])
    items = source.workload_items(config)
    sig = Signature.from_dict(doc["signature"])
    crash = doc.get("crash")
    what = f"the crash ({doc['signature_description']})" if crash else f"the lie of {doc['target']} ({sig.describe()})"
    shows = "the audit fails (every request errs)" if crash else "the lie shows (--fail-on divergent)"
    written = [_write(out / "workload.jsonl", "".join(json.dumps(i) + "\n" for i in items))]
    from lpf.pipeline.spec import audit_command

    args = ["lpf", "audit", *audit_command(source.spec(config, Path("workload.jsonl"), out), with_out=False)]
    written.append(
        _write(
            out / "command.sh",
            "#!/bin/sh\n"
            f"# {what[0].upper() + what[1:]}, reproduced with {len(items)} request(s)\n"
            f"# by `lpf shrink` from {source.path.resolve()}. Exit non-zero when {shows}.\n"
            'cd "$(dirname "$0")" || exit 2\n'
            'out="${1:-runs/repro-$(date +%Y%m%d-%H%M%S)}"\n'
            f'exec {" ".join(shlex.quote(a) for a in args)} --out "$out"\n',
            0o755,
        )
    )
    engine = run.manifest["engine"]
    if capability(engine["name"], "repro_script", False):
        th = source.findings.get("thresholds") or {}
        cfg = script_config(
            engine,
            run.manifest["model"]["path"],
            items,
            crash_target(items, shown["request_id"]) if crash else doc["target"],
            run.manifest["sampling"],
            th,
            sig.position_class,
            (run.manifest.get("reference") or {}).get("dtype") or "float32",
        )
        if crash:
            cfg["crash"] = {k: crash.get(k) for k in ("exception", "file", "function", "line")}
        written.append(write_script(out / "repro.py", cfg))
    written.append(_write(out / "report.md", report_md(out, source, doc, config, run, shown, sig)))
    return written


def crash_target(items: list[dict], run_id: str | None) -> str:
    """The workload id of the request a crash's minimal run failed first (a candidate run names its
    requests `<id>-r0`); the first request when none failed."""
    return next((i["id"] for i in items if run_id in (i["id"], f"{i['id']}-r0")), items[0]["id"])


def _evidence(run, request_id: str, position: int | None) -> dict | None:
    """Engine and reference numbers of one output position of a request, with the tokens as text."""
    import pyarrow.compute as pc

    if position is None:
        return None
    rows = {}
    for table in ("tokens", "reference"):
        t = run.read(table)
        t = t.filter(pc.and_(pc.equal(t.column("request_id"), request_id), pc.equal(t.column("position"), position)))
        rows[table] = t.to_pylist()[0] if t.num_rows else {}
    tok, ref = rows["tokens"], rows["reference"]
    if not tok or not ref:
        return None
    from lpf.core.model_specs import ModelRef, load_tokenizer

    tokenizer = load_tokenizer(ModelRef(run.manifest["model"]["spec"], Path(run.manifest["model"]["path"])))
    return {
        "position": position,
        "token_id": tok["token_id"],
        "token": tokenizer.decode([tok["token_id"]]),
        "engine_logprob": tok["engine_logprob"],
        "ref_logprob": ref["ref_logprob"],
        "ref_rank": ref["ref_rank"],
        "ref_top1_id": ref["ref_top1_id"],
        "ref_top1": tokenizer.decode([ref["ref_top1_id"]]),
        "ref_top1_logprob": ref["ref_top1_logprob"],
    }


def _knobs(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(d.items())) or "all at the engine's defaults"


def report_md(out: Path, source: Source, doc: dict, config: Config, run, shown: dict, sig: Signature) -> str:
    m, original = run.manifest, source.original()
    ev = _evidence(run, shown["request_id"], shown["first_divergence"])
    model_cfg = json.loads((Path(m["model"]["path"]) / "config.json").read_text())
    crash = doc.get("crash")
    title = (
        f"# {crash['exception']} with {len(config.members)} of {len(original.members)} requests"
        if crash
        else f"# `{doc['target']}` lies with {len(config.members)} of {len(original.members)} requests"
    )
    lines = [
        title,
        "",
        f"Found by `lpf shrink` from `{source.path.resolve()}` (run {source.manifest.get('run_id')}); "
        f"signature: {doc['signature_description'] if crash else sig.describe()}.",
        "",
    ]
    if doc.get("signature_note"):
        lines += [f"({doc['signature_note']}.)", ""]
    lines += [
        "## Versions",
        "",
        f"- engine: {m['engine']['name']} {m['engine'].get('version') or ''}".rstrip(),
        f"- model: `{m['model']['spec']}` ({m['model'].get('architecture')}), weights sha256 "
        f"`{m['model'].get('weights_sha256')}`",
        f"- reference: {(m.get('reference') or {}).get('implementation')} ({(m.get('reference') or {}).get('dtype')})",
        f"- lpf {m.get('lpf_version')}, Python {(m.get('host') or {}).get('python')} on "
        f"{(m.get('host') or {}).get('platform')}",
        "",
        "## Model config fields that matter",
        "",
    ]
    lines += [f"- `{k}`: {json.dumps(model_cfg[k])}" for k in CONFIG_FIELDS if k in model_cfg]
    lines += [
        "",
        "## Original vs minimal",
        "",
        "| | original | minimal |",
        "|---|---|---|",
        f"| requests | {len(original.members)} | {len(config.members)} |",
        f"| tokens (prompt + max_tokens) | {source.size(original)[1]} | {source.size(config)[1]} |",
        f"| knobs off the engine's default | {_knobs(source.off_default(original))} | "
        f"{_knobs(source.off_default(config))} |",
        "",
        f"Sampling: {json.dumps(m['sampling'])}; thresholds pinned to the original run's: "
        f"{', '.join(source.thresholds())}.",
        "",
        "## The lie at the first divergence",
        "",
    ]
    if ev:
        lines += [
            f"In the minimal run (`{shown['dir']}`), `{shown['request_id']}` first diverges at output position "
            f"{ev['position']}: the engine sampled "
            f"{json.dumps(ev['token'])} (#{ev['token_id']}) with logprob {ev['engine_logprob']:.4f}; the "
            f"reference gives that token {ev['ref_logprob']:.4f} (rank {ev['ref_rank']}) and prefers "
            f"{json.dumps(ev['ref_top1'])} (#{ev['ref_top1_id']}, {ev['ref_top1_logprob']:.4f}).",
            "",
        ]
    else:
        lines += [f"The minimal run (`{shown['dir']}`): {shown['seen']}.", ""]
    if not crash:  # a crash has no first divergence to locate
        offer = locate_offer(out, doc)
        lines += [
            "## Where the lie is born",
            "",
            "The first op of the forward pass that departs, and whose fault it is "
            f"(the engine's or the reference's): `{offer['command']}`.",
            "",
        ]
    lines += ["## Ranked hypotheses (original run)", ""]
    hyps = (source.findings.get("hypotheses") or [])[:5]
    lines += [f"{h['rank']}. {h['sentence']} (p={h['p_value']:.2g})" for h in hyps] or ["(none)"]
    conf = doc.get("confirmation") or {}
    lines += ["", "## Reproduce", "", "- `sh command.sh [OUT]`: the same `lpf audit` (exit 1 when the lie shows)"]
    if capability(run.manifest["engine"]["name"], "repro_script", False):
        lines.append(
            "- `python repro.py`: standalone, the engine and transformers only (exit 1 when the lie reproduces)"
        )
    if conf.get("note"):
        lines += ["", f"Reproducibility: {conf['note']}."]
    lines += [
        "",
        f"## Shrink log ({doc['runs_used']} runs of {doc['budget_runs']}, status {doc['status']})",
        "",
        "| candidate | phase | tried | size | outcome | runs |",
        "|---|---|---|---|---|---|",
    ]
    path = set(doc.get("path") or [])
    for c in doc["candidates"]:
        mark = " (adopted)" if c["id"] in path else ""
        lines.append(
            f"| {c['id']} | {c['phase']} | {c['step']} | {c['description']} | {c['status']}{mark} | "
            f"{'; '.join(t['seen'] for t in c['tries'])} |"
        )
    return "\n".join(lines) + "\n"
