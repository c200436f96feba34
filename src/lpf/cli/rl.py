"""`lpf rl analyze`, `lpf rl explain`, `lpf rl rescore` and `lpf rl simulate`: RL rollout-vs-trainer dumps.

A dump is what an RL framework wrote (prime-rl token exports, NeMo-RL train_data_step{N}.jsonl,
slime --dump-details, verl rollout_data_dir with per-token fields) or lpf's own layout, told apart by
content. Its RL directory (default: next to the dump, named after it + ".rl") collects
reference.parquet (`rl rescore`), rl_steps.parquet, rl_findings.json and report.html (`rl analyze`),
rl_causes.json / rl_causes.parquet / rl_cause_steps.parquet (`rl explain`, and `rl analyze` too).
Exit codes as everywhere: 0 fine, 1 with `--fail-on-spike` when a step spikes (`--fail-on-cause` when
a cause is named), 2 bad usage or input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lpf.cli.common import err, progress_bar, write_report
from lpf.cli.options import KnobCommand, engine_knob_options, engine_knobs, reference_options, server_reference_options
from lpf.cli.render_rl import print_rl_explain, print_rl_rescore, print_rl_simulate, print_rl_summary
from lpf.core.errors import LpfError
from lpf.rl import FORMAT_NAMES, RL_DRILLS


@click.group()
def rl():
    """RL rollout/trainer mismatch: analyse dumps, rescore them with a reference, simulate an RL loop."""


def _default_out(dump: Path) -> Path:
    return dump.with_name((dump.name if dump.is_dir() else dump.stem) + ".rl")


def _dump_options(f):
    f = click.option(
        "--strict", is_flag=True, help="Stop at the first bad row (exit 2) instead of listing and skipping it."
    )(f)
    f = click.option(
        "--format",
        "fmt",
        type=click.Choice(["auto", *FORMAT_NAMES]),
        default="auto",
        show_default=True,
        help="Dump layout; auto tells it by content.",
    )(f)
    return click.option(
        "--out",
        "out_dir",
        type=click.Path(path_type=Path),
        default=None,
        help="RL directory [default: DUMP's name + '.rl' next to it].",
    )(f)


_DTYPES = click.Choice(["float32", "bfloat16", "float16"])


def _dtype_options(f):
    f = click.option(
        "--trainer-dtype",
        type=_DTYPES,
        default=None,
        help="The trainer's logprob dtype, for the dtype floor [default: what the dump says, else float32].",
    )(f)
    return click.option(
        "--rollout-dtype",
        type=_DTYPES,
        default=None,
        help="The rollout engine's dtype, for the dtype floor [default: what the dump says, else the "
        "floor is estimated from the dump's quiet steps or responses, said so].",
    )(f)


@rl.command("analyze")
@click.argument("dump", type=click.Path(path_type=Path))
@_dump_options
@click.option("--metric", default="k3_kl", show_default=True, help="Per-step metric that spikes are detected on.")
@click.option("--z-threshold", type=float, default=6.0, show_default=True, help="Robust z-score of a spike.")
@_dtype_options
@click.option("--json", "as_json", is_flag=True, help="Print rl_findings.json on stdout.")
@click.option("--fail-on-spike", is_flag=True, help="Exit 1 when any step spikes.")
def analyze_cmd(dump, out_dir, fmt, strict, metric, z_threshold, rollout_dtype, trainer_dtype, as_json, fail_on_spike):
    """Per-step mismatch metrics of a rollout dump, spikes, their period, the requests behind them;
    with `lpf rl rescore`'s reference scores in the RL directory, which side departs from the reference."""
    from lpf.rl import explain
    from lpf.rl.analyze import add_causes, analyze, detect, write_outputs
    from lpf.rl.formats import read_dump
    from lpf.rl.reference_scores import attach

    if not z_threshold > 0:
        raise LpfError(f"--z-threshold must be > 0, got {z_threshold}")
    d = read_dump(dump, fmt, strict)
    out_dir = out_dir or _default_out(dump)
    attach(d, out_dir)
    detected = detect(d, metric, z_threshold)
    steps, findings = analyze(d, metric, z_threshold, detected=detected)
    responses, cause_steps, block = explain.run(d, rollout_dtype, trainer_dtype, detected=detected)
    steps = add_causes(steps, findings, cause_steps, block)
    explain.write(out_dir, responses, cause_steps, block)
    write_outputs(out_dir, steps, findings)
    print_rl_summary(findings, out_dir, err)
    write_report(out_dir)
    if findings["n_spikes"] and not findings["reference"]:
        where = "" if out_dir == _default_out(dump) else f" --out {out_dir}"
        model = "" if (d.metadata.get("spec") or {}).get("model") else " --reference MODEL"
        err.print(
            f"next: lpf rl rescore {dump}{model}{where}  (which side departs from the reference)", highlight=False
        )
    if as_json:
        click.echo(json.dumps(findings, indent=2))
    if fail_on_spike and findings["n_spikes"]:
        sys.exit(1)


@rl.command("explain")
@click.argument("dump", type=click.Path(path_type=Path))
@_dump_options
@_dtype_options
@click.option("--json", "as_json", is_flag=True, help="Print rl_causes.json on stdout.")
@click.option(
    "--fail-on-cause", is_flag=True, help="Exit 1 when a cause is named or more than 5% of the mismatch is unexplained."
)
def explain_cmd(dump, out_dir, fmt, strict, rollout_dtype, trainer_dtype, as_json, fail_on_cause):
    """Split the rollout/trainer mismatch into named causes, per step and per response: processed logprobs,
    stale weights, batch shape, position-dependent growth, the dtype floor, and what stays unexplained;
    each with its test, its share, and the fix each framework offers. With `lpf rl rescore`'s reference
    scores in the RL directory more causes can be tested (the output says what each untested one needs)."""
    from lpf.rl import explain
    from lpf.rl.formats import read_dump
    from lpf.rl.reference_scores import attach

    d = read_dump(dump, fmt, strict)
    out_dir = out_dir or _default_out(dump)
    attach(d, out_dir)
    responses, steps, block = explain.run(d, rollout_dtype, trainer_dtype)
    explain.write(out_dir, responses, steps, block)
    print_rl_explain(block, out_dir, err)
    if as_json:
        click.echo(json.dumps(block, indent=2))
    if fail_on_cause and block["verdict"] != "inside-floor":
        sys.exit(1)


RL_WHERE = (
    "Where the reference runs: the trainer's checkpoint (a template holding {step}: one per step), "
    "http(s)://HOST:PORT/v1 (a trusted deployment of the same model) or vllm:MODEL [default: the model the dump names]."
)


def _rl_reference(f):
    """`lpf rl rescore`'s reference options: `lpf rescore`'s, the server's and vLLM's included."""
    return server_reference_options(reference_options(f, where=RL_WHERE))


@rl.command("rescore")
@click.argument("dump", type=click.Path(path_type=Path))
@_dump_options
@_rl_reference
@click.option(
    "--model",
    default=None,
    help="--reference http(s)://...: the local copy of the served model (its tokenizer) [default: the dump's model].",
)
@click.option(
    "--lags",
    default=None,
    metavar="K[,K...]",
    help="Checkpoints to score with, in steps before each step (needs --reference with {step}); "
    "0 = the trainer's own. [default: 0, and 1 for a simulated drifting policy]",
)
@click.option(
    "--top-p", type=float, default=None, help="The rollout's top-p (for the kept mass processed logprobs carry)."
)
@click.option("--top-k", type=int, default=None, help="The rollout's top-k (0 or -1: off).")
@click.option(
    "--temperature",
    type=float,
    default=None,
    help="The rollout's sampling temperature [default: 1 when --top-p or --top-k is given].",
)
def rescore_cmd(
    dump,
    out_dir,
    fmt,
    strict,
    reference,
    reference_dtype,
    reference_device,
    token_budget,
    reference_model,
    reference_concurrency,
    reference_option,
    model,
    lags,
    top_p,
    top_k,
    temperature,
):
    """Score the dumped responses with the reference: the third opinion `lpf rl analyze` and `lpf rl explain`
    then read (RL directory/reference.parquet). --reference defaults to the model an `lpf rl simulate` dump
    names; a template holding {step} scores each step with its own checkpoint (and --lags with earlier ones,
    for stale weights). With the rollout's --top-p/--top-k, the reference's kept mass is stored too (for
    processed logprobs)."""
    from lpf.rl.formats import read_dump
    from lpf.rl.reference_scores import score, write

    d = read_dump(dump, fmt, strict)
    sim = d.metadata or {}
    policy = sim.get("policy") or {}
    named = (sim.get("spec") or {}).get("model")
    reference = reference or policy.get("checkpoints") or named
    if not reference:
        raise LpfError("--reference is required: this dump does not name its model (give the policy's HF checkpoint)")
    lag_list = _parse_lags(lags) if lags is not None else ([0, 1] if policy.get("checkpoints") else [0])
    sampling = _sampling(top_p, top_k, temperature) or sim.get("sampling")
    if max(lag_list) > 0 and "{step}" not in reference:  # refused before any scoring starts
        raise LpfError(
            f"--lags {','.join(map(str, lag_list))} needs a reference per step: give --reference as a "
            f"template holding {{step}} (the policy's checkpoints, e.g. ckpt/step_{{step}})"
        )
    from lpf.pipeline.reference_http import reference_form
    from lpf.pipeline.rescore import RescoreSettings

    server = RescoreSettings(
        reference=reference,
        dtype=reference_dtype,
        reference_model=reference_model,
        reference_concurrency=reference_concurrency,
        reference_option=tuple(reference_option),
    )
    if reference_form(reference) == "http":
        model = model or named  # the served model's local copy: the dump's own model unless given
    out_dir = out_dir or _default_out(dump)
    for lag in lag_list:
        with progress_bar("rescore " if not lag else f"lag {lag}  ", "tokens") as (on_start, tick):
            table = score(
                d,
                reference,
                reference_dtype,
                token_budget,
                on_start,
                tick,
                device=reference_device,
                sampling=sampling,
                lag=lag,
                server=server,
                model=model,
            )
        path = write(out_dir, table, lag)
        print_rl_rescore(path, table.num_rows, d.responses.num_rows, reference, reference_dtype, err)
    where = "" if out_dir == _default_out(dump) else f" --out {out_dir}"
    err.print(f"next: lpf rl analyze {dump}{where}  (lpf rl explain: the causes alone)", highlight=False)


def _parse_lags(text: str) -> list[int]:
    try:
        lags = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise LpfError(f"--lags expects integers like 0,1, got {text!r}") from None
    if not lags or lags[0] != 0:
        raise LpfError("--lags must include 0 (the trainer's own checkpoint, which every other test needs)")
    return lags


def _sampling(top_p, top_k, temperature) -> dict | None:
    if top_p is None and top_k is None and temperature is None:
        return None
    top_p = 1.0 if top_p is None else top_p
    top_k = 0 if top_k in (None, -1) else top_k
    temperature = 1.0 if temperature is None else temperature
    if not 0 < top_p <= 1 or top_k < 0 or not temperature > 0:
        raise LpfError("rollout sampling out of range: --top-p in (0, 1], --top-k >= 0 (or -1), --temperature > 0")
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p}


@rl.command("simulate", cls=KnobCommand)
@click.option("--steps", type=int, default=20, show_default=True, help="Training steps.")
@click.option("--prompts", type=int, default=1, show_default=True, help="Prompts per step.")
@click.option("--rollouts", type=int, default=8, show_default=True, help="Rollouts per prompt.")
@click.option("--model", default="zoo:hybrid", show_default=True)
@click.option("--workload", default="zoo:oracle", show_default=True, help="Prompt source, cycled over steps.")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Rollout top-p (logprobs stay raw).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Rollout top-k (0: off; logprobs stay raw).")
@click.option("--ignore-eos", is_flag=True, help="Generate max-tokens tokens whatever the model says (long responses).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--drill",
    "drills",
    multiple=True,
    metavar="NAME[:ARG]",
    help="RL-cause drill (repeatable): " + ", ".join(RL_DRILLS) + " (docs/rl.md).",
)
@click.option(
    "--policy-drift",
    type=float,
    default=0.0,
    show_default=True,
    help="Relative weight change per step (simulated training; stale-policy brings 0.002).",
)
@click.option(
    "--micro-batch-tokens",
    type=int,
    default=96,
    show_default=True,
    help="The trainer's micro-batch budget in padded tokens.",
)
@engine_knob_options(engines=("builtin",))
@click.option(
    "--out",
    "out_path",
    type=click.Path(path_type=Path),
    default=Path("rl-dump.parquet"),
    show_default=True,
    help="The dump: a file when it ends in .parquet, else a directory holding dump.parquet.",
)
def simulate_cmd(
    steps,
    prompts,
    rollouts,
    model,
    workload,
    max_tokens,
    temperature,
    top_p,
    top_k,
    ignore_eos,
    seed,
    drills,
    policy_drift,
    micro_batch_tokens,
    out_path,
    **knobs,
):
    """An RL rollout loop on ONE persistent built-in engine; trainer logprobs from the float32 reference.

    --dtype sets the engine's (rollout) dtype; the trainer side stays float32, as in RL. --drill puts
    back one cause of rollout/trainer mismatch each (ground truth in <stem>.causes.parquet).
    """
    from lpf.rl.simulate import SimSpec, simulate

    engine = engine_knobs(knobs, ("builtin",))
    inject = engine.pop("inject", "")
    spec = SimSpec(
        steps=steps,
        prompts=prompts,
        rollouts=rollouts,
        inject=inject,
        model=model,
        workload=workload,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        engine=engine,
        drills=tuple(drills),
        top_p=top_p,
        top_k=top_k,
        ignore_eos=ignore_eos,
        policy_drift=policy_drift,
        micro_batch_tokens=micro_batch_tokens,
    )
    with progress_bar("simulate", "steps") as (on_start, tick):
        info = simulate(spec, out_path, on_start, tick)
    print_rl_simulate(info, steps, err)
    if info["policy"]:  # stale weights are tested against the checkpoints the run just wrote
        err.print(
            f"next: lpf rl rescore {out_path} (each step's checkpoint and the one before), then "
            f"lpf rl analyze {out_path}",
            highlight=False,
        )
    else:
        err.print(f"next: lpf rl analyze {out_path}  (lpf rl explain: the causes alone)", highlight=False)


COMMANDS = (rl,)
