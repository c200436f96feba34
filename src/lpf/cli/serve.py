"""`lpf serve`: the built-in engine behind OpenAI /v1/completions and SGLang /generate.

Every option is validated (engine knobs through the builtin adapter's `BuiltinOptions`, the model's
architecture, the address) before the model loads; a bad one is one line, exit 2. The line "serving
NAME on http://HOST:PORT" goes to stderr once the server accepts connections; SIGINT and SIGTERM
shut it down cleanly (exit 0).
"""

from __future__ import annotations

from pathlib import Path

import click

from lpf.cli.options import KnobCommand, engine_knob_options, engine_knobs


@click.command("serve", cls=KnobCommand)
@click.option("--model", default=None, help="Model dir, zoo:NAME or tiny:NAME [default: zoo:hybrid].")
@click.option("--served-model-name", default=None, help="Name clients send as `model` [default: the --model text].")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="0 = any free port (printed when ready).")
@engine_knob_options(engines=("builtin",))
@click.option(
    "--trace-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Append the engine's per-step trace and fault ground truth here as Parquet parts.",
)
@click.option(
    "--repetition-penalty",
    type=float,
    default=1.0,
    show_default=True,
    help="Apply this repetition penalty to every /v1/completions request that does not set its own "
    "(as servers with a default penalty on their routes do); 1.0 = none. Reported logprobs stay raw.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="warning",
    show_default=True,
    help="uvicorn's log level (info logs every request).",
)
def serve(model, served_model_name, host, port, trace_dir, repetition_penalty, log_level, **knobs):
    """Serve the built-in engine over HTTP: OpenAI /v1/completions, SGLang /generate, /v1/models, /health.

    Concurrent requests are batched into the same engine steps; --inject makes a fault auditable
    through HTTP (`lpf audit --engine openai --base-url http://HOST:PORT/v1 --model NAME`).
    """
    from lpf.adapters.builtin import BuiltinEngine, BuiltinOptions
    from lpf.core.model_specs import DEFAULT_MODEL, resolve_model
    from lpf.pipeline import model_config
    from lpf.serve import server

    from lpf.core.sampling import SamplingParams

    options = BuiltinOptions.parse(engine_knobs(knobs, ("builtin",)))
    SamplingParams(repetition_penalty=repetition_penalty)  # its bounds: one line, exit 2
    spec = model or DEFAULT_MODEL
    name = served_model_name or spec
    shown = f"[{host}]" if ":" in host else host
    sock = server.bind(host, port)  # first: a busy port fails before the model loads
    try:
        ref = resolve_model(spec)
        BuiltinEngine.check_model(model_config(ref))
        stats = server.run(
            ref,
            name,
            options,
            sock,
            trace_dir,
            log_level,
            repetition_penalty=repetition_penalty,
            on_ready=lambda p: click.echo(f"serving {name} on http://{shown}:{p}", err=True),
        )
    finally:
        sock.close()
    click.echo(
        f"lpf serve: shut down cleanly after {stats.steps} steps and {stats.requests_finished} requests "
        f"(largest batch {stats.max_batch_size})",
        err=True,
    )


COMMANDS = (serve,)
