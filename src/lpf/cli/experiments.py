"""Experiments around audits: `lpf sweep` (one audit per knob cell), `lpf repeat` (the determinism
probe) and `lpf shrink` (a failing run cut down to the smallest reproducer).

Everything is validated before the first engine starts (every sweep cell's `AuditSpec` is built from
the options with the cell's values put in; a shrink's source run, target and signature are read
first); `lpf.experiments.sweep`, `.repeat` and `.shrink` do the work and return documents that
`render` draws.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lpf.cli.audit_spec import build_audit_spec
from lpf.cli.common import default_out, err, fails, progress_bar, write_report
from lpf.cli.options import KnobCommand, audit_settings_options, engine_knob_options, engine_knobs, fail_on_option
from lpf.cli.render_experiments import print_repeat, print_shrink, print_shrink_event, print_sweep
from lpf.core.errors import LpfError, did_you_mean

# the sweep's own parameters, and settings no cell varies (the rest are audit settings a knob may vary)
_NOT_KNOBS = {"knobs", "out_dir", "as_json", "fail_on", "engine_option", "part_size"}


@click.command(cls=KnobCommand, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--knob",
    "knobs",
    multiple=True,
    required=True,
    metavar="NAME=V1,V2,...",
    help="A knob and its values (repeatable; cells are the cartesian product). Any lpf audit option "
    "(cache-mb, max-num-seqs, n, temperature, dtype, inject, ...) or an engine -E option.",
)
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Sweep directory (rerun to resume)."
)
@click.option("--json", "as_json", is_flag=True, help="Print sweep.json on stdout.")
@fail_on_option("any cell")
@audit_settings_options
@click.pass_context
def sweep(ctx, knobs, out_dir, as_json, fail_on, **params):
    """One audit per cell of a knob grid, each in its own process; what moves the failure's shape.

    Every other option is every cell's (as `lpf audit` takes it); rerun the same command to
    resume (complete cells are skipped). Example:

    \b
    lpf sweep --knob cache-mb=1,4,16 --inject stale-state --model tiny:jamba --out runs/s1
    """
    from lpf.experiments import sweep as sw

    parsed, cells = plan_sweep(ctx, list(knobs), out_dir, params)
    err.print(
        f"sweep directory: {out_dir}  ({len(cells)} cells: "
        + " x ".join(f"{k.name} {len(k.values)}" for k in parsed)
        + ")"
    )
    with progress_bar("cells   ", "cells") as (on_start, tick):
        doc = sw.run_sweep(out_dir, parsed, cells, on_start, tick)
    print_sweep(doc, err)
    write_report(out_dir)
    err.print(f"results: {out_dir}/sweep.json, {out_dir}/sweep.parquet, cells under {out_dir}/cells/")
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    if fails((c["verdict"] for c in doc["cells"]), fail_on):
        sys.exit(1)


def plan_sweep(ctx: click.Context, knobs: list[str], out_dir: Path, params: dict):
    """The sweep's knobs and its cells, each with its AuditSpec built from these options with the cell's
    values put in (every cell is built, so checked, before the first one runs)."""
    from lpf.adapters import get_engine_class
    from lpf.experiments import sweep as sw

    if ctx.args:
        names = [o for p in ctx.command.get_params(ctx) for o in p.opts]
        raise LpfError(f"audit options: No such option: {ctx.args[0]}{did_you_mean(ctx.args[0], names)}")
    by_dashed = {
        o[2:]: p for p in ctx.command.get_params(ctx) if p.name not in _NOT_KNOBS for o in p.opts if o.startswith("--")
    }
    fixed = {
        o[2:]: o
        for p in ctx.command.get_params(ctx)
        if p.name not in _NOT_KNOBS and ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE
        for o in p.opts
        if o.startswith("--")
    }
    fixed.update({kv.partition("=")[0].strip().replace("-", "_"): "-E" for kv in params.get("engine_option") or ()})
    engines = {params["engine"]}
    engine_knob = [k for k in knobs if k.partition("=")[0].strip().lstrip("-") == "engine"]
    if engine_knob:
        engines = {v.strip() for v in engine_knob[0].partition("=")[2].split(",") if v.strip()}
    engine_fields = {e: set(get_engine_class(e).Options.model_fields) for e in engines}
    parsed = sw.parse_knobs(knobs, set(by_dashed), engine_fields, fixed)
    cells = sw.make_cells(parsed)
    for c in cells:
        values = dict(params, out=out_dir / "cells" / c.name)
        for k in parsed:
            text = c.values[k.name]
            if k.kind == "engine":
                values["engine_option"] = (*values.get("engine_option", ()), f"{k.name}={text}")
            else:
                values[by_dashed[k.name].name] = _knob_value(ctx, by_dashed[k.name], k.name, text)
        try:
            c.spec = build_audit_spec(values)
        except LpfError as e:
            raise LpfError(f"cell {c.name}: {e}") from None
    return parsed, cells


def _knob_value(ctx: click.Context, param: click.Parameter, name: str, text: str):
    """A knob's value as its option takes it: on/off for a flag or switch, `+`-joined parts for a
    repeatable option (none/off: no part), else the option's own type."""
    from lpf.experiments.sweep import parse_bool

    if getattr(param, "is_flag", False):
        return parse_bool(name, text)
    parts = ([] if text.lower() in ("none", "off") else [p for p in text.split("+") if p]) if param.multiple else [text]
    try:
        converted = [param.type.convert(p, param, ctx) for p in parts]
    except click.BadParameter as e:
        raise LpfError(f"knob {name}: {e.format_message()}") from None
    return tuple(converted) if param.multiple else converted[0]


@click.command(cls=KnobCommand)
@click.option("--engine", default="builtin", show_default=True, help="Engine under test (see `lpf engines`).")
@click.option("--model", default=None, help="Model dir, zoo:NAME or tiny:NAME [default: zoo:hybrid].")
@click.option("--prompt", default=None, help="The prompt text (tokenized as a workload's 'prompt' would be).")
@click.option("--workload", default=None, help="Take the prompt from this JSONL or zoo:NAME workload ...")
@click.option("--index", type=int, default=0, show_default=True, help="... at this 0-based index.")
@click.option("--times", type=int, default=8, show_default=True, help="Copies of the prompt.")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--ignore-eos", is_flag=True, help="Generate max_tokens even past EOS.")
@click.option(
    "--tolerance",
    type=float,
    default=None,
    help="Logprob vectors within this of each other count as one [default: 1e-4, above float32 rounding].",
)
@engine_knob_options
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None, help="Directory for repeat.json.")
@click.option("--json", "as_json", is_flag=True, help="Print repeat.json on stdout.")
def repeat(
    engine, model, prompt, workload, index, times, max_tokens, seed, ignore_eos, tolerance, out_dir, as_json, **knobs
):
    """The determinism probe: one prompt N times at temperature 0 under different batches.

    The engine's concurrency knob (max_num_seqs; batch_size for hf) is varied across copies unless
    you fix it; a server you started (--base-url) is varied from the client side only (requests in
    flight, the requests sent with the probe, its place among them).
    """
    from lpf.core.model_specs import DEFAULT_MODEL
    from lpf.experiments.repeat import DEFAULT_TOLERANCE, RepeatSpec, run_repeat

    options = engine_knobs(knobs)
    if max_tokens < 1:
        raise LpfError(f"--max-tokens must be >= 1, got {max_tokens}")
    tol = DEFAULT_TOLERANCE if tolerance is None else tolerance
    if not tol >= 0:
        raise LpfError(f"--tolerance must be >= 0, got {tolerance}")
    out_dir = out_dir or default_out("repeat")
    spec = RepeatSpec(
        engine=engine,
        model=model or DEFAULT_MODEL,
        times=times,
        max_tokens=max_tokens,
        seed=seed,
        ignore_eos=ignore_eos,
        engine_options=options,
        prompt=prompt,
        workload=workload,
        index=index,
        tolerance=tol,
    )
    with progress_bar("repeat  ", "copies") as (on_start, tick):
        doc = run_repeat(spec, out_dir, lambda total: on_start(total, 0), tick)
    print_repeat(doc, err)
    err.print(f"results: {out_dir}/repeat.json")
    if as_json:
        click.echo(json.dumps(doc, indent=2))


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="Shrink directory (rerun the same command to resume).",
)
@click.option(
    "--request", "request_id", default=None, help="The flagged request to shrink for [default: the worst one]."
)
@click.option(
    "--budget-runs",
    type=int,
    default=60,
    show_default=True,
    help="Most candidate runs (each one `lpf audit` in its own process).",
)
@click.option(
    "--tries",
    type=int,
    default=3,
    show_default=True,
    help="Runs a configuration gets to show the lie (n of k-of-n; one once the engine proves deterministic).",
)
@click.option("--need", type=int, default=1, show_default=True, help="Runs of --tries that must show it (k of k-of-n).")
@click.option("--json", "as_json", is_flag=True, help="Print shrink.json on stdout.")
def shrink(run_dir, out_dir, request_id, budget_runs, tries, need, as_json):
    """Cut a run with a lying request down to the smallest configuration that still tells the same lie.

    Fewer requests (ddmin, arrival order kept), shorter prompts and max_tokens, and knobs moved toward
    the engine's defaults one at a time; each candidate is one `lpf audit` in its own process. A run
    with nothing flagged whose requests failed with an exception is shrunk on that crash (its type and
    innermost frame). Writes DIR/workload.jsonl, command.sh, repro.py (standalone: the engine and
    transformers), report.md and shrink.json. Exit 0 with a minimum, 1 when the lie did not reproduce,
    2 for bad input. Example:

    \b
    lpf shrink runs/stale --out runs/stale-min
    """
    from lpf.experiments.shrink import session

    plan = session.prepare(run_dir, request_id)
    doc = session.run(plan, out_dir, tries, need, budget_runs, lambda e: print_shrink_event(e, err))
    print_shrink(doc, err)
    what = "the crash" if plan.crash else f"the lie of {plan.target['request_id']}"
    if doc["status"] == "not-reproduced":
        err.print(
            f"{what} did not reproduce in {tries} tries of the original "
            f"configuration, nor in any smaller one: a one-off (the environment?), not a minimum",
            highlight=False,
        )
    elif not doc.get("minimal"):
        err.print(
            f"the budget ran out before {what} reproduced: raise --budget-runs and rerun to continue",
            highlight=False,
        )
    else:
        write_report(out_dir)
        err.print(f"results: {out_dir}/" + ", ".join(doc.get("files") or []) + ", shrink.json", highlight=False)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    if not doc.get("minimal"):
        sys.exit(1)


COMMANDS = (sweep, repeat, shrink)
