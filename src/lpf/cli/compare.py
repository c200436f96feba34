"""Comparing engines: `lpf diff` (which of two runs, or the reference, departs) and `lpf conformance`
(every architecture an engine claims, under a grid of knobs, each non-clean cell attributed by diff).

`lpf.views.diff` and `lpf.experiments.conformance` do the work and return documents; `render` draws them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lpf.cli.common import (audit_option_kinds, build_run_spec, err, fail_on_option, fails, out, parse_audit_args,
                            progress_bar, write_report)
from lpf.cli.render_compare import print_conformance, print_diff


@click.command("diff")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the diff document on stdout.")
@click.option("--out", "out_file", type=click.Path(path_type=Path), default=None,
              help="Also write the diff document (JSON) to this file.")
@fail_on_option("any request's departure from the reference (by either engine, or the reference's own)")
def diff(run_a, run_b, as_json, out_file, fail_on):
    """Who is wrong: two engines' runs of one workload, rescored by one reference, compared request by request.

    Per request: do A and B agree with each other, and which departs from the reference? When both
    agree with each other and not with the reference, the reference is named the suspect.
    """
    from lpf.views.diff import diff_runs

    from lpf.core.errors import LpfError

    if run_a.resolve() == run_b.resolve():
        raise LpfError(f"RUN_A and RUN_B are the same directory ({run_a}): diff two engines' runs")
    if out_file is not None and not out_file.parent.is_dir():
        raise LpfError(f"--out {out_file}: {out_file.parent} is not a directory")
    level = "divergent" if fail_on == "never" else fail_on
    _, doc = diff_runs(run_a, run_b, level)
    print_diff(doc, err if as_json else out)
    if out_file is not None:
        out_file.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    if fail_on != "never" and doc["suspect"] != "none":  # someone departs at or above --fail-on
        sys.exit(1)


# audit options a conformance cell may not vary: the matrix fixes them (or they are not knobs at all)
_NOT_KNOBS = {"out", "json", "fail-on", "engine-option", "help", "part-size", "engine", "model", "workload",
              "prompt-logprobs", "base-url", "api-key-env", "served-model"}

CRASHED = ("engine error", "lpf error")  # cell statuses that fail --fail-on at any level but never
ENGINES = ("builtin", "vllm")  # the engines discovery can ask


def _engine_base(engine: str) -> list[str]:
    """Engine options every conformance cell gets, by knob role: a short context keeps the KV cache small;
    prefix caching off unless a cell turns it on (vLLM turns it on by default, and for a hybrid model that
    selects mamba cache mode 'align', which refuses chunked prefill off)."""
    from lpf.adapters import get_engine_class
    from lpf.core.knobs import knob_with_role

    options = get_engine_class(engine).Options
    base = {knob_with_role(options, "context_length"): 512, knob_with_role(options, "prefix_cache"): "false"}
    return [a for name, value in base.items() if name is not None for a in ("-E", f"{name}={value}")]


@click.command("conformance")
@click.option("--engine", type=click.Choice(ENGINES), default="vllm", show_default=True,
              help="Engine under test.")
@click.option("--arch", "archs", default=None, metavar="A,B,...",
              help="Only these architectures (name, name without ForCausalLM, or model type) [default: all].")
@click.option("--grid", type=click.Choice(["small", "full"]), default="small", show_default=True,
              help="Knob cells: small (CI, 2 cells) or full (the documented 9-cell matrix).")
@click.option("--cell", "cell_names", multiple=True, metavar="NAME", help="Only these cells of the catalogue (repeatable).")
@click.option("--knob", "knobs", multiple=True, metavar="NAME=V1,V2,...",
              help="Instead of a grid: the cartesian product of these knobs, in lpf sweep's syntax (repeatable).")
@click.option("--prompts", "n_prompts", type=int, default=None, help="Prompts per cell [default: 8 small, 16 full].")
@click.option("--max-tokens", type=int, default=12, show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Conformance directory (rerun the same command to resume).")
@click.option("--json", "as_json", is_flag=True, help="Print conformance.json on stdout.")
@fail_on_option("any cell")
def conformance(engine, archs, grid, cell_names, knobs, n_prompts, max_tokens, out_dir, as_json, fail_on):
    """Audit every hybrid architecture the engine and transformers both load, under a grid of knob cells.

    Each cell is a run directory (outputs and prompt logprobs, rescored and analysed); each cell that
    is not clean is attributed by `lpf diff` against HF generate (engine bug / reference bug / both).
    Example:

    \b
    lpf conformance --engine vllm --grid full --out runs/conf
    """
    from lpf.experiments import sweep as sw
    from lpf.adapters import get_engine_class
    from lpf.analysis.thresholds import Thresholds
    from lpf.experiments.conformance import discover as disc
    from lpf.experiments.conformance.grid import PROMPTS, GridCell, grid_cells, write_workload
    from lpf.experiments.conformance.matrix import CellPlan, Settings, cell_dir, run_matrix
    from lpf.experiments.conformance.tiny import build_tiny
    from lpf.core.errors import LpfError

    if max_tokens < 1:
        raise LpfError(f"--max-tokens must be >= 1, got {max_tokens}")
    if out_dir.exists() and not out_dir.is_dir():
        raise LpfError(f"--out {out_dir} is a file, not a conformance directory")
    n_prompts = n_prompts or PROMPTS[grid]
    if n_prompts < 1:
        raise LpfError(f"--prompts must be >= 1, got {n_prompts}")
    if knobs:
        fields = {engine: set(get_engine_class(engine).Options.model_fields)}
        kinds = {k: v for k, v in audit_option_kinds().items() if k not in _NOT_KNOBS}
        parsed = sw.parse_knobs(list(knobs), kinds, fields, [])
        cells = [GridCell(c.name, tuple(c.argv), "--knob " + ", ".join(f"{k}={v}" for k, v in c.values.items()))
                 for c in sw.make_cells(parsed, [])]
    else:
        cells = grid_cells(grid, list(cell_names))
    err.print(f"asking {engine} and transformers which stateful architectures they load ...")
    found = disc.discover(engine)
    wanted = disc.select(found["architectures"], [a for a in (archs or "").split(",") if a.strip()])
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = out_dir / "workload.jsonl"
    from lpf.core.model_specs import ModelRef, load_tokenizer
    from lpf.zoo.registry import tokenizer_dir

    tok = load_tokenizer(ModelRef("zoo tokenizer", tokenizer_dir()))
    if not workload.is_file():
        write_workload(workload, n_prompts, len(tok), bos=tok.bos_token_id)
    plans, attribution = [], {}
    for a in wanted:
        if a["status"] != disc.AUDIT:
            continue
        try:
            model = build_tiny(a["model_type"])
        except LpfError as e:
            a.update(status="no tiny recipe", reason=str(e))
            continue
        common = ["--model", str(model), "--workload", str(workload), "--max-tokens", str(max_tokens)]
        for c in cells:
            argv = ["--engine", engine, *common, *(["--prompt-logprobs"] if c.prompt_logprobs else []),
                    *_engine_base(engine), *c.args,
                    "--out", str(cell_dir(out_dir, a["architecture"], c.name))]
            try:
                spec = build_run_spec(parse_audit_args(argv, f"cell {c.name}"))
                get_engine_class(engine).Options.parse(spec.engine_options)
                plans.append(CellPlan(a, c, spec))
            except LpfError as e:
                plans.append(CellPlan(a, c, None, refused=str(e)))
            key = (a["architecture"], c.dtype)
            if key not in attribution:
                hf = ["--engine", "hf", *common, "--prompt-logprobs", "--dtype", c.dtype,
                      "--out", str(cell_dir(out_dir, a["architecture"], f"hf-{c.dtype}"))]
                attribution[key] = build_run_spec(parse_audit_args(hf, "the HF generate run"))
    spec = {"engine": engine, "architectures": [a["architecture"] for a in wanted],
            "cells": [[c.name, list(c.args)] for c in cells], "n_prompts": n_prompts, "max_tokens": max_tokens}
    head = {"spec": spec, "engine": engine, "engine_version": found.get("engine_version"),
            "cpu_build": found.get("cpu_build"), "reference": found["reference"], "grid": None if knobs else grid,
            "cell_catalogue": [{"name": c.name, "args": list(c.args), "stresses": c.stresses, "dtype": c.dtype,
                                "prompt_logprobs": c.prompt_logprobs} for c in cells],
            "architectures": wanted, "workload": {"path": "workload.jsonl", "n_prompts": n_prompts,
                                                   "max_tokens": max_tokens}}
    n_arch = len({p.arch["architecture"] for p in plans})
    err.print(f"conformance directory: {out_dir}  ({n_arch} architectures x {len(cells)} cells; "
              f"{len(wanted) - n_arch} listed with the reason they are not audited)")
    with progress_bar("cells   ", "cells") as (on_start, tick):
        doc = run_matrix(out_dir, head, plans, attribution, Settings(Thresholds()), on_start, tick)
    print_conformance(doc, err if as_json else out)
    write_report(out_dir)
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    # a bf16 cell counts with its verdict against the bf16 expectation; a cell the engine crashed on
    # (vLLM could not start, or failed every request) counts too: that is what the matrix looks for
    crashed = any(c.get("status") in CRASHED for c in doc["cells"])
    if fails([c.get("conformance") for c in doc["cells"]], fail_on) or (crashed and fail_on != "never"):
        sys.exit(1)


COMMANDS = (diff, conformance)
