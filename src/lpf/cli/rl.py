"""`lpf rl analyze`, `lpf rl rescore` and `lpf rl simulate`: RL rollout-vs-trainer dumps.

A dump is what an RL framework wrote (prime-rl token exports, NeMo-RL train_data_step{N}.jsonl,
slime --dump-details, verl rollout_data_dir with per-token fields) or lpf's own layout, told apart by
content. Its RL directory (default: next to the dump, named after it + ".rl") collects
reference.parquet (`rl rescore`), rl_steps.parquet, rl_findings.json and report.html (`rl analyze`).
Exit codes as everywhere: 0 fine, 1 with `--fail-on-spike` when a step spikes, 2 bad usage or input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lpf.cli.common import KnobCommand, engine_knob_options, engine_knobs, err, progress_bar, reference_options, write_report
from lpf.cli.render import print_rl_rescore, print_rl_summary
from lpf.core.errors import LpfError
from lpf.rl import FORMAT_NAMES


@click.group()
def rl():
    """RL rollout/trainer mismatch: analyse dumps, rescore them with a reference, simulate an RL loop."""


def _default_out(dump: Path) -> Path:
    return dump.with_name((dump.name if dump.is_dir() else dump.stem) + ".rl")


def _dump_options(f):
    f = click.option("--strict", is_flag=True,
                     help="Stop at the first bad row (exit 2) instead of listing and skipping it.")(f)
    f = click.option("--format", "fmt", type=click.Choice(["auto", *FORMAT_NAMES]), default="auto", show_default=True,
                     help="Dump layout; auto tells it by content.")(f)
    return click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
                        help="RL directory [default: DUMP's name + '.rl' next to it].")(f)


@rl.command("analyze")
@click.argument("dump", type=click.Path(path_type=Path))
@_dump_options
@click.option("--metric", default="k3_kl", show_default=True, help="Per-step metric that spikes are detected on.")
@click.option("--z-threshold", type=float, default=6.0, show_default=True, help="Robust z-score of a spike.")
@click.option("--json", "as_json", is_flag=True, help="Print rl_findings.json on stdout.")
@click.option("--fail-on-spike", is_flag=True, help="Exit 1 when any step spikes.")
def analyze_cmd(dump, out_dir, fmt, strict, metric, z_threshold, as_json, fail_on_spike):
    """Per-step mismatch metrics of a rollout dump, spikes, their period, the requests behind them;
    with `lpf rl rescore`'s reference scores in the RL directory, which side departs from the reference."""
    from lpf.rl.analyze import analyze, write_outputs
    from lpf.rl.formats import read_dump
    from lpf.rl.reference_scores import attach

    if not z_threshold > 0:
        raise LpfError(f"--z-threshold must be > 0, got {z_threshold}")
    d = read_dump(dump, fmt, strict)
    out_dir = out_dir or _default_out(dump)
    attach(d, out_dir)
    steps, findings = analyze(d, metric, z_threshold)
    write_outputs(out_dir, steps, findings)
    print_rl_summary(findings, out_dir, err)
    write_report(out_dir)
    if findings["n_spikes"] and not findings["reference"]:
        where = "" if out_dir == _default_out(dump) else f" --out {out_dir}"
        model = "" if (d.metadata.get("spec") or {}).get("model") else " --reference MODEL"
        err.print(f"next: lpf rl rescore {dump}{model}{where}  (which side departs from the reference)", highlight=False)
    if as_json:
        click.echo(json.dumps(findings, indent=2))
    if fail_on_spike and findings["n_spikes"]:
        sys.exit(1)


@rl.command("rescore")
@click.argument("dump", type=click.Path(path_type=Path))
@_dump_options
@reference_options
def rescore_cmd(dump, out_dir, fmt, strict, reference, reference_dtype, reference_device, token_budget):
    """Score the dumped responses with the HF reference: the third opinion `lpf rl analyze` then reads
    (RL directory/reference.parquet). --reference defaults to the model an `lpf rl simulate` dump names."""
    from lpf.rl.formats import read_dump
    from lpf.rl.reference_scores import score, write

    d = read_dump(dump, fmt, strict)
    reference = reference or ((d.metadata.get("spec") or {}).get("model"))
    if not reference:
        raise LpfError("--reference is required: this dump does not name its model (give the policy's HF checkpoint)")
    out_dir = out_dir or _default_out(dump)
    with progress_bar("rescore ", "tokens") as (on_start, tick):
        table = score(d, reference, reference_dtype, token_budget, on_start, tick, device=reference_device)
    path = write(out_dir, table)
    print_rl_rescore(path, table.num_rows, d.responses.num_rows, reference, reference_dtype, err)
    where = "" if out_dir == _default_out(dump) else f" --out {out_dir}"
    err.print(f"next: lpf rl analyze {dump}{where}", highlight=False)


@rl.command("simulate", cls=KnobCommand)
@click.option("--steps", type=int, default=20, show_default=True, help="Training steps.")
@click.option("--prompts", type=int, default=1, show_default=True, help="Prompts per step.")
@click.option("--rollouts", type=int, default=8, show_default=True, help="Rollouts per prompt.")
@click.option("--model", default="zoo:hybrid", show_default=True)
@click.option("--workload", default="zoo:oracle", show_default=True, help="Prompt source, cycled over steps.")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@engine_knob_options(engines=("builtin",))
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=Path("rl-dump.parquet"), show_default=True,
              help="The dump: a file when it ends in .parquet, else a directory holding dump.parquet.")
def simulate_cmd(steps, prompts, rollouts, model, workload, max_tokens, temperature, seed, out_path, **knobs):
    """An RL rollout loop on ONE persistent built-in engine; trainer logprobs from the float32 reference.

    --dtype sets the engine's (rollout) dtype; the trainer side stays float32, as in RL.
    """
    from lpf.rl.simulate import SimSpec, simulate

    engine = engine_knobs(knobs, ("builtin",))
    inject = engine.pop("inject", "")
    spec = SimSpec(steps=steps, prompts=prompts, rollouts=rollouts, inject=inject, model=model,
                   workload=workload, max_tokens=max_tokens, temperature=temperature, seed=seed, engine=engine)
    with progress_bar("simulate", "steps") as (on_start, tick):
        info = simulate(spec, out_path, on_start, tick)
    err.print(f"dump: {info['dump']}  ({info['n_responses']} responses over {steps} steps; engine "
              f"{info['cache']['num_state_slots']} state slots, stride {info['cache']['state_slot_stride']}"
              + (f", faults {', '.join(info['cache']['faults'])}" if info["cache"]["faults"] else "") + ")",
              highlight=False)
    err.print(f"next: lpf rl analyze {out_path}", highlight=False)


COMMANDS = (rl,)
