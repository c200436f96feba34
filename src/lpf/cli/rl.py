"""`lpf rl analyze` and `lpf rl simulate`: RL rollout-vs-trainer dumps.

Exit codes as everywhere: 0 fine, 1 with `--fail-on-spike` when a step spikes, 2 bad usage or input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lpf.cli.common import engine_knob_options, engine_knobs, err, progress_bar, write_report
from lpf.cli.render import print_rl_summary
from lpf.errors import LpfError


@click.group()
def rl():
    """RL rollout/trainer mismatch: analyse dumps, simulate an RL rollout loop."""


@rl.command("analyze")
@click.argument("dump", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="RL directory to write [default: DUMP's name + '.rl' next to it].")
@click.option("--format", "fmt", type=click.Choice(["auto", "lpf", "verl"]), default="auto", show_default=True)
@click.option("--metric", default="k3_kl", show_default=True, help="Per-step metric that spikes are detected on.")
@click.option("--z-threshold", type=float, default=6.0, show_default=True, help="Robust z-score of a spike.")
@click.option("--strict", is_flag=True, help="Stop at the first bad row (exit 2) instead of listing and skipping it.")
@click.option("--json", "as_json", is_flag=True, help="Print rl_findings.json on stdout.")
@click.option("--fail-on-spike", is_flag=True, help="Exit 1 when any step spikes.")
def analyze_cmd(dump, out_dir, fmt, metric, z_threshold, strict, as_json, fail_on_spike):
    """Per-step mismatch metrics of a rollout dump, spikes, their period, the requests behind them."""
    from lpf.rl.analyze import analyze, write_outputs
    from lpf.rl.dump import read_dump

    if not z_threshold > 0:
        raise LpfError(f"--z-threshold must be > 0, got {z_threshold}")
    d = read_dump(dump, fmt, strict)
    steps, findings = analyze(d, metric, z_threshold)
    out_dir = out_dir or dump.with_name(dump.stem + ".rl")
    write_outputs(out_dir, steps, findings)
    print_rl_summary(findings, out_dir, err)
    write_report(out_dir)
    if as_json:
        click.echo(json.dumps(findings, indent=2))
    if fail_on_spike and findings["n_spikes"]:
        sys.exit(1)


@rl.command("simulate")
@click.option("--steps", type=int, default=20, show_default=True, help="Training steps.")
@click.option("--prompts", type=int, default=1, show_default=True, help="Prompts per step.")
@click.option("--rollouts", type=int, default=8, show_default=True, help="Rollouts per prompt.")
@click.option("--model", default="zoo:hybrid", show_default=True)
@click.option("--workload", default="zoo:oracle", show_default=True, help="Prompt source, cycled over steps.")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@engine_knob_options
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=Path("rl-dump.parquet"), show_default=True)
def simulate_cmd(steps, prompts, rollouts, model, workload, max_tokens, temperature, seed, out_path, **knobs):
    """An RL rollout loop on ONE persistent built-in engine; trainer logprobs from the float32 reference.

    --dtype sets the engine's (rollout) dtype; the trainer side stays float32, as in RL.
    """
    from lpf.rl.simulate import SimSpec, simulate

    engine = engine_knobs(knobs)
    inject = engine.pop("inject", "")
    spec = SimSpec(steps=steps, prompts=prompts, rollouts=rollouts, inject=inject, model=model,
                   workload=workload, max_tokens=max_tokens, temperature=temperature, seed=seed, engine=engine)
    with progress_bar("simulate", "steps") as (on_start, tick):
        info = simulate(spec, out_path, on_start, tick)
    err.print(f"dump: {out_path}  ({info['n_responses']} responses over {steps} steps; engine "
              f"{info['cache']['num_state_slots']} state slots, stride {info['cache']['state_slot_stride']}"
              + (f", faults {', '.join(info['cache']['faults'])}" if info["cache"]["faults"] else "") + ")",
              highlight=False)
    err.print(f"next: lpf rl analyze {out_path}", highlight=False)


COMMANDS = (rl,)
