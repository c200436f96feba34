"""`lpf rl analyze` and `lpf rl simulate`: click bodies, registered in `lpf.cli` by one add_command.

Exit codes as everywhere: 0 fine, 1 with `--fail-on-spike` when a step spikes, 2 bad usage or input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lpf.errors import LpfError


@click.group()
def rl():
    """RL rollout/trainer mismatch: analyse dumps, simulate an RL rollout loop."""


@rl.command("analyze")
@click.argument("dump", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="RL directory to write [default: DUMP's name + '.rl' next to it].")
@click.option("--format", "fmt", type=click.Choice(["auto", "lpf", "verl"]), default="auto", show_default=True)
@click.option("--metric", default="k3_kl", show_default=True, help="Per-step metric that spikes are detected on.")
@click.option("--z-threshold", type=float, default=6.0, show_default=True, help="Robust z-score of a spike.")
@click.option("--strict", is_flag=True, help="Stop at the first bad row (exit 2) instead of listing and skipping it.")
@click.option("--json", "as_json", is_flag=True, help="Print rl_findings.json on stdout.")
@click.option("--fail-on-spike", is_flag=True, help="Exit 1 when any step spikes.")
def analyze_cmd(dump, out, fmt, metric, z_threshold, strict, as_json, fail_on_spike):
    """Per-step mismatch metrics of a rollout dump, spikes, their period, the requests behind them."""
    from lpf.cli import err
    from lpf.rl.analyze import analyze, write_outputs
    from lpf.rl.dump import read_dump

    if not z_threshold > 0:
        raise LpfError(f"--z-threshold must be > 0, got {z_threshold}")
    d = read_dump(dump, fmt, strict)
    steps, findings = analyze(d, metric, z_threshold)
    out = out or dump.with_name(dump.stem + ".rl")
    report, why = write_outputs(out, steps, findings)
    _print_summary(err, findings, out, report)
    if why:
        err.print(f"[yellow]report.html not written:[/] {why}", highlight=False)
    if as_json:
        click.echo(json.dumps(findings, indent=2))
    if fail_on_spike and findings["n_spikes"]:
        sys.exit(1)


def _print_summary(console, f: dict, out: Path, report: Path | None) -> None:
    console.print(f"[bold]{'SPIKES' if f['n_spikes'] else 'clean'}[/]  {f['summary']}", highlight=False)
    console.print(f"steps {f['n_steps']} · responses {f['n_responses']} · tokens {f['n_tokens']} · "
                  f"bad rows {len(f['bad_rows'])}" + (f" · empty steps {len(f['empty_steps'])}" if f["empty_steps"] else ""),
                  highlight=False)
    for b in f["bad_rows"][:5]:
        console.print(f"  bad row {b['row']}: {b['reason']}", highlight=False)
    for h in f["hypotheses"][:3]:
        console.print(f"  #{h['rank']} {h['sentence']} (p={h['p_value']:.2g})", highlight=False)
    console.print(f"results: {out}/rl_findings.json, rl_steps.parquet" + (f", {report}" if report else ""),
                  highlight=False)


@rl.command("simulate")
@click.option("--steps", type=int, default=20, show_default=True, help="Training steps.")
@click.option("--prompts", type=int, default=1, show_default=True, help="Prompts per step.")
@click.option("--rollouts", type=int, default=8, show_default=True, help="Rollouts per prompt.")
@click.option("--cache-mb", type=float, default=None, help="Built-in engine cache size [default: the engine's].")
@click.option("--inject", multiple=True, metavar="FAULT[:ARG]", help="Fault drill, e.g. offset-wrap:20 (repeatable).")
@click.option("--model", default="zoo:hybrid", show_default=True)
@click.option("--workload", default="zoo:oracle", show_default=True, help="Prompt source, cycled over steps.")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", default=None, help="Engine dtype, e.g. bfloat16 (the trainer side stays float32, as in RL).")
@click.option("--max-num-seqs", type=int, default=None)
@click.option("--max-num-batched-tokens", type=int, default=None)
@click.option("--out", type=click.Path(path_type=Path), default=Path("rl-dump.parquet"), show_default=True)
def simulate_cmd(steps, prompts, rollouts, cache_mb, inject, model, workload, max_tokens, temperature, seed,
                 dtype, max_num_seqs, max_num_batched_tokens, out):
    """An RL rollout loop on ONE persistent built-in engine; trainer logprobs from the reference."""
    from lpf.cli import progress_bar, err
    from lpf.rl.simulate import SimSpec, simulate

    knobs = {k: v for k, v in (("cache_mb", cache_mb), ("dtype", dtype), ("max_num_seqs", max_num_seqs),
                               ("max_num_batched_tokens", max_num_batched_tokens)) if v is not None}
    spec = SimSpec(steps=steps, prompts=prompts, rollouts=rollouts, inject=",".join(inject), model=model,
                   workload=workload, max_tokens=max_tokens, temperature=temperature, seed=seed, engine=knobs)
    with progress_bar("simulate", "steps") as (on_start, tick):
        info = simulate(spec, out, on_start, tick)
    err.print(f"dump: {out}  ({info['n_responses']} responses over {steps} steps; engine "
              f"{info['cache']['num_state_slots']} state slots, stride {info['cache']['state_slot_stride']}"
              + (f", faults {', '.join(info['cache']['faults'])}" if info["cache"]["faults"] else "") + ")",
              highlight=False)
    err.print(f"next: lpf rl analyze {out}", highlight=False)
