"""Click commands `lpf sweep`, `lpf repeat` and `lpf inspect`, registered on the main group by
`register(cli)` (called at the end of `lpf.cli`, so this module may use its helpers).

Thin, like `lpf.cli`: parse, validate everything before any work, call `lpf.sweep` /
`lpf.repeat` / `lpf.inspect_request`, draw with rich. Progress and tables go to stderr except where
the table IS the output (`inspect`); `--json` prints the document on stdout.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

import click

from lpf.errors import LpfError

# audit options that belong to the sweep itself, not to a cell
_NOT_KNOBS = {"out", "json", "fail-on", "engine-option", "help", "part-size"}


def _audit_kinds(audit: click.Command) -> dict[str, str]:
    kinds = {}
    for p in audit.params:
        if not isinstance(p, click.Option) or p.hidden:
            continue
        kind = ("switch" if p.secondary_opts else "flag") if p.is_flag else ("multi" if p.multiple else "option")
        for opt in p.opts:
            if opt.startswith("--") and opt[2:] not in _NOT_KNOBS:
                kinds[opt[2:]] = kind
    return kinds


def _parse_audit(audit: click.Command, argv: list[str], what: str) -> dict:
    try:
        with audit.make_context("audit", list(argv), resilient_parsing=False) as ctx:
            return dict(ctx.params)
    except click.ClickException as e:
        raise LpfError(f"{what}: {e.format_message()}") from None


def register(cli: click.Group) -> None:
    from lpf.cli import audit, err, out, progress_bar

    @cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.option("--knob", "knobs", multiple=True, required=True, metavar="NAME=V1,V2,...",
                  help="A knob and its values (repeatable; cells are the cartesian product). Any lpf audit option "
                       "(cache-mb, max-num-seqs, n, temperature, dtype, inject, ...) or an engine -E option.")
    @click.option("--out", type=click.Path(path_type=Path), required=True, help="Sweep directory (rerun to resume).")
    @click.option("--json", "as_json", is_flag=True, help="Print sweep.json on stdout.")
    @click.option("--fail-on", type=click.Choice(["noise", "divergent", "corrupt", "never"]), default="divergent",
                  show_default=True, help="Exit 1 when any cell has a request at or above this verdict.")
    @click.pass_context
    def sweep(ctx, knobs, out, as_json, fail_on):
        """One audit per cell of a knob grid, each in its own process; what moves the failure's shape.

        Every other option is passed to each cell's `lpf audit` unchanged; rerun the same command to
        resume (complete cells are skipped). Example:

        \b
        lpf sweep --knob cache-mb=1,4,16 --inject stale-state --model tiny:jamba --out runs/s1
        """
        from lpf import sweep as sw
        from lpf.analysis.thresholds import Thresholds
        from lpf.analysis.verdicts import SEVERITY
        from lpf.cli import _run_spec
        from lpf.engines import get_engine_class

        base_args = list(ctx.args)
        base = _parse_audit(audit, base_args, "audit options")
        engines = {base["engine"]}
        engine_knob = [k for k in knobs if k.partition("=")[0].strip().lstrip("-") == "engine"]
        if engine_knob:
            engines = {v.strip() for v in engine_knob[0].partition("=")[2].split(",") if v.strip()}
        engine_fields = {e: {f.name for f in fields(get_engine_class(e).Options)} for e in engines}
        parsed = sw.parse_knobs(list(knobs), _audit_kinds(audit), engine_fields, base_args)
        cells = sw.make_cells(parsed, base_args)
        run_params = set(inspect.signature(_run_spec).parameters)
        for c in cells:  # every cell is checked before the first one runs
            p = _parse_audit(audit, c.argv, f"cell {c.name}")
            spec = _run_spec(**{k: v for k, v in p.items() if k in run_params})
            get_engine_class(spec.engine).Options.parse(spec.engine_options)
            Thresholds().with_overrides(list(p["threshold"]))
            rescore = (["--reference", p["reference"]] if p["reference"] else []) + [
                "--reference-dtype", p["reference_dtype"], "--token-budget", str(p["token_budget"])]
            c.resume = {"rescore": rescore, "analyze": [a for t in p["threshold"] for a in ("--threshold", t)]}
        sw.check_out(out, parsed, base_args)
        err.print(f"sweep directory: {out}  ({len(cells)} cells: "
                  + " x ".join(f"{k.name} {len(k.values)}" for k in parsed) + ")")
        with progress_bar("cells   ", "cells") as (on_start, tick):
            doc = sw.run_sweep(out, parsed, base_args, cells, on_start, tick)
        sw.render(doc, err)
        _write_report(out, err)
        err.print(f"results: {out}/sweep.json, {out}/sweep.parquet, cells under {out}/cells/")
        if as_json:
            click.echo(json.dumps(doc, indent=2))
        if fail_on != "never" and any(SEVERITY.get(c["verdict"], -1) >= SEVERITY[fail_on] for c in doc["cells"]):
            sys.exit(1)

    @cli.command()
    @click.option("--engine", default="builtin", show_default=True, help="Engine under test (see `lpf engines`).")
    @click.option("--model", default=None, help="Model dir, zoo:NAME or tiny:NAME [default: zoo:hybrid].")
    @click.option("--prompt", default=None, help="The prompt text (tokenized as a workload's 'prompt' would be).")
    @click.option("--workload", default=None, help="Take the prompt from this JSONL or zoo:NAME workload ...")
    @click.option("--index", type=int, default=0, show_default=True, help="... at this 0-based index.")
    @click.option("--times", type=int, default=8, show_default=True, help="Copies of the prompt.")
    @click.option("--max-tokens", type=int, default=16, show_default=True)
    @click.option("--seed", type=int, default=0, show_default=True)
    @click.option("--ignore-eos", is_flag=True, help="Generate max_tokens even past EOS.")
    @click.option("--tolerance", type=float, default=None,
                  help="Logprob vectors within this of each other count as one [default: 1e-4, above float32 rounding].")
    @click.option("--dtype", default=None, help="Engine dtype (float32, bfloat16, float16).")
    @click.option("-E", "--engine-option", "engine_option", multiple=True, metavar="KEY=VALUE", help="Engine knob (repeatable).")
    @click.option("--inject", multiple=True, metavar="FAULT[:ARG]", help="builtin engine: a fault drill (repeatable).")
    @click.option("--cache-mb", type=float, default=None, help="builtin engine: cache size.")
    @click.option("--max-num-seqs", type=int, default=None, help="Fix it (otherwise it is varied across copies).")
    @click.option("--max-num-batched-tokens", type=int, default=None)
    @click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=None)
    @click.option("--out", type=click.Path(path_type=Path), default=None, help="Directory for repeat.json.")
    @click.option("--json", "as_json", is_flag=True, help="Print repeat.json on stdout.")
    def repeat(engine, model, prompt, workload, index, times, max_tokens, seed, ignore_eos, tolerance, dtype,
               engine_option, inject, cache_mb, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, out, as_json):
        """The determinism probe: one prompt N times at temperature 0 under different batches."""
        from lpf.models import DEFAULT_MODEL
        from lpf.repeat import DEFAULT_TOLERANCE, RepeatSpec, run_repeat

        from lpf.knobs import engine_options

        options = engine_options(engine_option, inject, dtype=dtype, cache_mb=cache_mb, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 enable_chunked_prefill=enable_chunked_prefill)
        if max_tokens < 1:
            raise LpfError(f"--max-tokens must be >= 1, got {max_tokens}")
        tol = DEFAULT_TOLERANCE if tolerance is None else tolerance
        if not tol >= 0:
            raise LpfError(f"--tolerance must be >= 0, got {tolerance}")
        out = out or Path("runs") / time.strftime("repeat-%Y%m%d-%H%M%S")
        spec = RepeatSpec(engine=engine, model=model or DEFAULT_MODEL, times=times, max_tokens=max_tokens, seed=seed,
                          ignore_eos=ignore_eos, engine_options=options, prompt=prompt, workload=workload,
                          index=index, tolerance=tol)
        with progress_bar("repeat  ", "copies") as (on_start, tick):
            doc = run_repeat(spec, out, lambda total: on_start(total, 0), tick)
        _render_repeat(doc, err)
        err.print(f"results: {out}/repeat.json")
        if as_json:
            click.echo(json.dumps(doc, indent=2))

    @cli.command("inspect")
    @click.argument("run_dir", type=click.Path(path_type=Path))
    @click.argument("request_id")
    @click.option("--json", "as_json", is_flag=True, help="Print the request, tokens and trace as JSON.")
    @click.option("--top", type=int, default=3, show_default=True, help="Top-k alternatives shown per side.")
    def inspect_cmd(run_dir, request_id, as_json, top):
        """One request token by token (engine vs reference) and its trace step by step."""
        from lpf.inspect_request import inspect_request, render

        info = inspect_request(run_dir, request_id)
        if as_json:
            click.echo(json.dumps(info, indent=2, default=str))
        else:
            render(info, out, top=max(0, top))


def _write_report(path: Path, console) -> None:
    """The HTML report, when the report workstream's module is installed (it is optional here)."""
    try:
        from lpf.report import write_report
    except ImportError:
        return
    try:
        console.print(f"report: {write_report(path)}")
    except LpfError as e:
        console.print(f"[yellow]report not written:[/] {e}")


def _render_repeat(doc: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    knob = doc.get("varied_knob") or "concurrency"
    t = Table(title=f"{doc['times']} copies, temperature 0, engine {doc['engine']}", title_justify="left")
    for c in ("copy", knob, "fillers", "arrival", "batch sizes seen", "tokens", "logprobs (bitwise)",
              f"logprobs (<= {doc['tolerance']:g})", "max |d| vs copy 0"):
        t.add_column(c)
    letter = lambda i: chr(ord("A") + i) if i < 26 else str(i)  # noqa: E731
    for c in doc["copies"]:
        bs = c.get("batch_sizes")
        t.add_row(str(c["copy"]), "-" if c["concurrency"] is None else str(c["concurrency"]), str(c["n_fillers"]),
                  str(c["arrival"]), "-" if not bs else f"{min(bs)}..{max(bs)} over {len(bs)} steps",
                  letter(c["tokens_group"]), letter(c["logprobs_group"]), letter(c["tolerance_group"]),
                  f"{c['max_abs_diff_vs_copy0']:.3g}")
    console.print(t)
    console.print(f"unique completions: token sequences {doc['unique_token_sequences']}, logprob vectors "
                  f"{doc['unique_logprob_vectors']} bitwise, {doc['unique_logprob_vectors_at_tolerance']} within "
                  f"{doc['tolerance']:g}; max logprob spread {doc['max_logprob_spread']:.3g}")
    fd = doc["first_divergence"]
    if fd["logprobs"] is None:
        console.print("[green]all copies identical[/]: same tokens, bit-identical logprobs")
    else:
        lp = fd["logprobs"]
        console.print(f"first logprob divergence at position {lp['position']}: logprob {lp['min_logprob']:.6g} .. "
                      f"{lp['max_logprob']:.6g} across copies" + ("" if lp["tokens_agree"] else " (tokens differ)"))
    if fd["tokens"] is not None:
        console.print(f"[bold red]first token divergence at position {fd['tokens']['position']}[/]: tokens "
                      f"{escape(str(fd['tokens']['distinct_tokens']))}")
