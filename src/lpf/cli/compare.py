"""Comparing engines: `lpf diff` (which of two runs, or the reference, departs) and `lpf conformance`
(every architecture an engine claims, under a grid of knobs, each non-clean cell attributed by diff).

`lpf.views.diff` and `lpf.experiments.conformance` (its planner included) do the work and return
documents; `render` draws them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lpf.adapters import engine_names
from lpf.cli.common import err, fails, out, progress_bar, write_report
from lpf.cli.options import fail_on_option
from lpf.cli.render_compare import print_conformance, print_diff


@click.command("diff")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the diff document on stdout.")
@click.option(
    "--out",
    "out_file",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write the diff document (JSON) to this file.",
)
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


CRASHED = ("engine error", "lpf error")  # cell statuses that fail --fail-on at any level but never


@click.command("conformance")
@click.option(
    "--engine",
    type=click.Choice(engine_names()),
    default="vllm",
    show_default=True,
    help="Engine under test: one whose adapter can say which architectures it loads (builtin, vllm, llamacpp).",
)
@click.option(
    "--arch",
    "archs",
    default=None,
    metavar="A,B,...",
    help="Only these architectures (name, name without ForCausalLM, or model type) [default: all].",
)
@click.option(
    "--grid",
    type=click.Choice(["small", "full"]),
    default="small",
    show_default=True,
    help="Knob cells: small (CI, 2 cells) or full (the documented 9-cell matrix).",
)
@click.option(
    "--cell", "cell_names", multiple=True, metavar="NAME", help="Only these cells of the catalogue (repeatable)."
)
@click.option(
    "--knob",
    "knobs",
    multiple=True,
    metavar="NAME=V1,V2,...",
    help="Instead of a grid: the cartesian product of these knobs, in lpf sweep's syntax (repeatable).",
)
@click.option("--prompts", "n_prompts", type=int, default=None, help="Prompts per cell [default: 8 small, 16 full].")
@click.option("--max-tokens", type=int, default=12, show_default=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="Conformance directory (rerun the same command to resume).",
)
@click.option("--json", "as_json", is_flag=True, help="Print conformance.json on stdout.")
@click.option(
    "--reference-column/--no-reference-column",
    default=None,
    help="Also check the reference against itself (decode vs teacher-forced, eager vs sdpa, float64 gold) "
    "on every selected stateful architecture with a tiny recipe [default: on with --grid full].",
)
@click.option(
    "--variants",
    "variant_kinds",
    default="none",
    show_default=True,
    metavar="KINDS",
    help="Config variants as rows of their own: toggle, pairwise, published, structural, limits (comma list), all, or none.",
)
@click.option(
    "--variant-cells",
    default=None,
    metavar="A,B,...",
    help="The cells variant rows run [default: the selected cells that are in the small grid (float32), "
    "else the selected float32 cells].",
)
@click.option(
    "--locate/--no-locate",
    default=True,
    show_default=True,
    help="Locate every cell that does not conform (lpf locate on its worst request).",
)
@fail_on_option("any cell")
def conformance(
    engine,
    archs,
    grid,
    cell_names,
    knobs,
    n_prompts,
    max_tokens,
    out_dir,
    as_json,
    reference_column,
    variant_kinds,
    variant_cells,
    locate,
    fail_on,
):
    """Audit every hybrid architecture the engine and transformers both load, under a grid of knob cells.

    Each cell is a run directory (outputs and prompt logprobs, rescored and analysed); each cell that
    is not clean is attributed by `lpf diff` against HF generate (engine bug / reference bug / both).
    Example:

    \b
    lpf conformance --engine vllm --grid full --out runs/conf
    lpf conformance --engine vllm --variants all --out runs/conf-variants
    """
    from lpf.adapters import capability, engines_with, get_engine_class
    from lpf.core.errors import LpfError
    from lpf.core.knobs import flag_knobs
    from lpf.experiments import sweep as sw
    from lpf.experiments.conformance import discover as disc
    from lpf.experiments.conformance.grid import PROMPTS, grid_cells, knob_cells
    from lpf.experiments.conformance.matrix import Settings, run_matrix
    from lpf.experiments.conformance.plan import plan
    from lpf.experiments.conformance.variants import select_kinds

    if max_tokens < 1:
        raise LpfError(f"--max-tokens must be >= 1, got {max_tokens}")
    if not capability(engine, "discovers_architectures"):
        can = ", ".join(engines_with("discovers_architectures"))
        raise LpfError(
            f"--engine {engine}: lpf conformance asks the engine which architectures it loads, and the {engine} "
            f"adapter cannot say (engines that can: {can})"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise LpfError(f"--out {out_dir} is a file, not a conformance directory")
    n_prompts = n_prompts or PROMPTS[grid]
    if n_prompts < 1:
        raise LpfError(f"--prompts must be >= 1, got {n_prompts}")
    if knobs:  # a cell is a setting of the engine's knobs: by its flag's name or its own
        options = get_engine_class(engine).Options
        flags = {k.flag_name[2:] for k in flag_knobs([options])}
        cells = knob_cells(sw.parse_knobs(list(knobs), flags, {engine: set(options.model_fields)}, {}), options, engine)
    else:
        cells = grid_cells(grid, list(cell_names), engine)
    kinds = select_kinds(variant_kinds)
    vcells = None
    if kinds:
        names = [n.strip() for n in (variant_cells or "").split(",") if n.strip()]
        small = [c.name for c in grid_cells("small", None, engine)]
        vcells = (
            grid_cells("small", names, engine)
            if names
            else [c for c in cells if c.name in small] or [c for c in cells if c.dtype == "float32"] or cells
        )
    err.print(f"asking {engine} and transformers which stateful architectures they load ...")
    found = disc.discover(engine)
    wanted = disc.select(found["architectures"], [a for a in (archs or "").split(",") if a.strip()])
    if kinds:
        err.print(f"building and checking config variants ({', '.join(kinds)}) against the reference ...")
    p = plan(engine, wanted, cells, out_dir, n_prompts, max_tokens, None if knobs else grid, found, kinds, vcells)
    n_arch = len({c.arch["architecture"] for c in p.plans if not c.arch.get("variant")})
    n_var = len({c.arch["architecture"] for c in p.plans if c.arch.get("variant")})
    err.print(
        f"conformance directory: {out_dir}  ({n_arch} architectures x {len(cells)} cells; "
        f"{len(wanted) - n_arch} listed with the reason they are not audited"
        + (f"; {n_var} config variants x {len(vcells or [])} cells" if kinds else "")
        + ")"
    )
    with progress_bar("cells   ", "cells") as (on_start, tick):
        doc = run_matrix(out_dir, p.head, p.plans, p.attribution, Settings(locate=locate), on_start, tick)
    if reference_column or (reference_column is None and grid == "full" and not knobs):
        from lpf.experiments.conformance.matrix import write_doc
        from lpf.experiments.conformance.reference_column import reference_column as check_column

        checked = [*wanted, *(a for a in p.head["architectures"] if a.get("variant"))]  # variant rows too
        with progress_bar("reference", "architectures") as (on_start, tick):
            on_start(len(checked), 0)
            doc["reference_column"] = check_column(out_dir, checked, out_dir / "workload.jsonl", max_tokens, tick=tick)
        write_doc(out_dir, doc)
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
