"""Planning a conformance matrix: which architecture x cell runs, each as an `AuditSpec`, before any runs.

Contract: `plan(engine, architectures, cells, out, n_prompts, max_tokens, grid) -> Plan` writes (once)
the shared workload `out/workload.jsonl`, builds each audited architecture's tiny checkpoint (an
architecture without a recipe is marked `no tiny recipe` with the reason) and, for every architecture
and cell, the cell's spec: the engine, the tiny model, the workload, `max_tokens`, prompt logprobs
unless the cell turns them off, the engine's conformance base (`engine_base`) and the cell's knobs. A
cell the engine refuses (an option it lacks, a value out of range) is planned with the one-line
reason instead (the matrix records it as `not applicable`). One HF generate spec per architecture and
dtype attributes the non-clean cells (`attribution`). `Plan.head` is conformance.json's fixed part
(the spec a rerun must match, the engine, the cell catalogue, the architectures, the workload).

Config variants (`variant_kinds`, `lpf.experiments.conformance.variants`): for each audited
architecture, `variant_check.check_variants` builds its variants and drops those that leave the
reference's logits unchanged; each kept one becomes a matrix row of its own, `<Arch>~<variant>` (its
discovery entry with `variant_of` and `variant`: kind, the fields that differ, why, the source), run on
`variant_cells` only (float32 cells first: the default rows keep the whole grid). `head["variants"]`
holds every architecture's check (fields read, factors, skipped fields, every variant with its status
and reason); `head["architectures"]` lists each variant row after its architecture.

`engine_base(options_cls)` asks the engine's knobs by role (lpf.core.knobs): the `context_length`
knob at 512 (a short context keeps the KV cache small) and the `prefix_cache` knob off unless a cell
turns it on (vLLM turns it on by default, and for a hybrid model that selects mamba cache mode
'align', which refuses chunked prefill off); an engine without such a knob gets nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lpf.core.errors import LpfError
from lpf.experiments.conformance import discover as disc
from lpf.experiments.conformance.grid import GridCell, write_workload
from lpf.experiments.conformance.matrix import CellPlan, cell_dir

CONTEXT = 512  # the conformance context: the workload's longest prompt + max_tokens fit many times over


@dataclass
class Plan:
    head: dict
    plans: list[CellPlan] = field(default_factory=list)
    attribution: dict = field(default_factory=dict)  # (architecture, dtype) -> the HF generate AuditSpec


def engine_base(options_cls) -> dict:
    from lpf.core.knobs import knob_with_role

    base = {knob_with_role(options_cls, "context_length"): CONTEXT, knob_with_role(options_cls, "prefix_cache"): False}
    return {name: value for name, value in base.items() if name is not None}


def _spec(engine: str, model: Path, workload: Path, out: Path, max_tokens: int, prompt_logprobs: bool, options: dict):
    from lpf.core.sampling import SamplingParams
    from lpf.pipeline.rescore import RescoreSettings
    from lpf.pipeline.spec import AuditSpec, RunSpec

    run = RunSpec(
        engine=engine,
        model=str(model),
        workload=str(workload),
        out=out,
        engine_options=options,
        sampling=SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
    )
    return AuditSpec(run=run, rescore=RescoreSettings())  # the reference on the CPU, as the matrix always ran it


def plan(
    engine: str,
    architectures: list[dict],
    cells: list[GridCell],
    out: Path,
    n_prompts: int,
    max_tokens: int,
    grid: str | None,
    found: dict,
    variant_kinds: list[str] | None = None,
    variant_cells: list[GridCell] | None = None,
) -> Plan:
    from lpf.adapters import get_engine_class
    from lpf.core.model_specs import ModelRef, load_tokenizer
    from lpf.experiments.conformance.tiny import build_tiny
    from lpf.zoo.registry import tokenizer_dir

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    workload = out / "workload.jsonl"
    if not workload.is_file():
        tok = load_tokenizer(ModelRef("zoo tokenizer", tokenizer_dir()))
        write_workload(workload, n_prompts, len(tok), bos=tok.bos_token_id)
    engine_cls = get_engine_class(engine)
    base = engine_base(engine_cls.Options)
    # an engine that returns no prompt logprobs (llama-server) audits outputs only, in every cell
    with_prompts = bool(getattr(engine_cls, "supports_prompt_logprobs", False))
    result = Plan(head={})
    rows: list[tuple[dict, Path, list[GridCell]]] = []
    listed, checks = [], []
    for a in architectures:
        listed.append(a)
        if a["status"] != disc.AUDIT:
            continue
        try:
            model = build_tiny(a["model_type"])
        except LpfError as e:
            a.update(status="no tiny recipe", reason=str(e))
            continue
        rows.append((a, model, cells))
        if variant_kinds:
            check = _variant_check(out, a, variant_kinds, workload)
            checks.append(check)
            for v in check["variants"]:
                if v["status"] != "kept":
                    continue
                entry = {
                    **a,
                    "architecture": f"{a['architecture'].removesuffix('ForCausalLM')}~{v['name']}",
                    "variant_of": a["architecture"],
                    "variant": {
                        k: v.get(k) for k in ("name", "kind", "overrides", "why", "source", "max_abs_logit_change")
                    },
                }
                listed.append(entry)
                rows.append((entry, Path(v["model"]), list(variant_cells or cells)))
    for a, model, arch_cells in rows:
        for c in arch_cells:
            try:
                spec = _spec(
                    engine,
                    model,
                    workload,
                    cell_dir(out, a["architecture"], c.name),
                    max_tokens,
                    c.prompt_logprobs and with_prompts,
                    {**base, **dict(c.options)},
                )
                result.plans.append(CellPlan(a, c, spec))
            except LpfError as e:
                result.plans.append(CellPlan(a, c, None, refused=str(e)))
            key = (a["architecture"], c.dtype)
            if key not in result.attribution:
                result.attribution[key] = _spec(
                    "hf",
                    model,
                    workload,
                    cell_dir(out, a["architecture"], f"hf-{c.dtype}"),
                    max_tokens,
                    True,
                    {"dtype": c.dtype},
                )
    spec = {
        "engine": engine,
        "architectures": [a["architecture"] for a in architectures],
        "cells": [[c.name, dict(c.options)] for c in cells],
        "n_prompts": n_prompts,
        "max_tokens": max_tokens,
    }
    if variant_kinds:  # absent otherwise, so a matrix written before variants existed still resumes
        spec["variants"] = list(variant_kinds)
        spec["variant_cells"] = [c.name for c in variant_cells or cells]
    result.head = {
        "spec": spec,
        "engine": engine,
        "engine_version": found.get("engine_version"),
        "cpu_build": found.get("cpu_build"),
        "reference": found["reference"],
        "grid": grid,
        "cell_catalogue": [
            {
                "name": c.name,
                "args": c.args,
                "options": dict(c.options),
                "stresses": c.stresses,
                "dtype": c.dtype,
                "prompt_logprobs": c.prompt_logprobs,
            }
            for c in cells + [c for c in variant_cells or [] if c not in cells]
        ],
        "architectures": listed,
        **({"variants": checks} if variant_kinds else {}),
        "workload": {"path": "workload.jsonl", "n_prompts": n_prompts, "max_tokens": max_tokens},
    }
    return result


def _variant_check(out: Path, arch: dict, kinds: list[str], workload: Path) -> dict:
    """The architecture's variants, checked against its reference on the workload's first 4 prompts."""
    import json

    from lpf.experiments.conformance.variant_check import check_variants

    prompts = [json.loads(line)["prompt_token_ids"] for line in workload.read_text().splitlines() if line.strip()]
    try:
        return check_variants(out, arch, kinds, prompts[:4])
    except LpfError as e:
        return {"architecture": arch["architecture"], "model_type": arch["model_type"], "error": str(e), "variants": []}
