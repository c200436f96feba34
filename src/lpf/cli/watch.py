"""`lpf watch`: a correctness canary in front of an OpenAI-compatible server (see docs/watch.md).

Every option is checked (`lpf.watch.spec.build_watch_spec`: the upstream URL, the sampling rate, the
address, every bound, the executor; then the reference model) before the proxy listens; a bad one is one line, exit 2. "watching UPSTREAM on http://HOST:PORT" goes to stderr
once the proxy accepts connections. Exit 0 after SIGINT/SIGTERM, 1 once `--fail-after N` windows alarmed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from lpf.cli import render_watch


@click.command("watch")
@click.option(
    "--upstream", required=True, help="The server to watch, e.g. http://127.0.0.1:8000 (with or without /v1)."
)
@click.option(
    "--listen", default="127.0.0.1:8100", show_default=True, help="HOST:PORT the proxy listens on (port 0: any)."
)
@click.option(
    "--reference",
    required=True,
    help="Where the reference runs: a model (dir, zoo:NAME, tiny:NAME: what the upstream should serve, in the "
    "scorer), http(s)://HOST:PORT/v1 (a trusted deployment, with --reference-model) or self (the upstream "
    "re-scores its own sampled answers, one at a time).",
)
@click.option(
    "--model",
    default=None,
    help="--reference self or http(s)://: the model the upstream serves, held here (dir, zoo:NAME, tiny:NAME) "
    "for its tokenizer [default: --reference].",
)
@click.option("--reference-model", default=None, metavar="NAME", help="--reference http(s)://: the name it serves.")
@click.option(
    "--reference-concurrency",
    type=int,
    default=None,
    metavar="N",
    help="--reference http(s):// or self: re-scores in flight [default: 8; self: 1, so the upstream's own "
    "clients wait behind at most one].",
)
@click.option("--sample", type=float, default=0.01, show_default=True, help="Fraction of requests recorded and scored.")
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Sampling seed (a replay samples the same requests)."
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The run directory to record into (new).")
@click.option("--no-text", is_flag=True, help="Record token ids only (no prompt or output text).")
@click.option("--window", type=int, default=50, show_default=True, help="Sampled requests per judged window.")
@click.option(
    "--top-k", type=int, default=5, show_default=True, help="Logprob alternatives asked for a sampled request."
)
@click.option("--upstream-dtype", default=None, help="The dtype the upstream computes in (its expected floor).")
@click.option("--reference-dtype", default="float32", show_default=True)
@click.option("--reference-device", default="cpu", show_default=True)
@click.option(
    "--queue",
    "queue_size",
    type=int,
    default=1024,
    show_default=True,
    help="Samples waiting to be written before new ones are dropped.",
)
@click.option(
    "--part-rows", type=int, default=256, show_default=True, help="A part is committed at this many samples..."
)
@click.option(
    "--part-seconds", type=float, default=2.0, show_default=True, help="...or when its oldest sample is this old."
)
@click.option(
    "--upstream-timeout", type=float, default=None, help="Seconds to wait for the upstream (default: no limit)."
)
@click.option(
    "--max-lag",
    type=int,
    default=10_000,
    show_default=True,
    help="Recorded requests waiting for the reference beyond which the oldest are given up (kept, not scored).",
)
@click.option(
    "--retain",
    multiple=True,
    help="Delete the oldest recorded parts beyond a size (20GB) or an age (7d); may be given twice.",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where the scorer's reference runs: local (its own process) or ray (actors on a Ray cluster, the [ray] extra).",
)
@click.option(
    "--ray-address",
    default=None,
    metavar="ADDR",
    help="--executor ray: the cluster to join, e.g. ray://head:10001 [default: a local Ray].",
)
@click.option(
    "--actors", type=click.IntRange(min=1), default=1, show_default=True, help="--executor ray: reference actors."
)
@click.option(
    "--gpus-per-actor",
    type=click.FloatRange(min=0),
    default=0,
    show_default=True,
    help="--executor ray: GPUs per actor (0: CPU actors).",
)
@click.option("--alert-webhook", default=None, help="POST each alarm as JSON to this URL.")
@click.option("--fail-after", type=int, default=None, help="Exit 1 after this many alarmed windows (a CI canary).")
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="warning",
    show_default=True,
)
def watch(**params):
    """Proxy an OpenAI-compatible server, record a sample of its traffic, and re-score it with a reference.

    Clients see the upstream's answers unchanged; sampled requests are recorded into --out (a run
    directory: `lpf analyze`, `lpf report` work on it) and judged window by window in the background.
    /metrics serves Prometheus metrics.
    """
    from lpf.serve import server as listen_on
    from lpf.watch.service import serve
    from lpf.watch.spec import build_watch_spec

    settings = build_watch_spec(params)  # every option checked before the proxy listens
    host, port = settings.host_port()
    sock = listen_on.bind(host, port)
    shown = f"[{host}]" if ":" in host else host
    try:
        outcome = serve(
            settings,
            sock,
            on_ready=lambda p: click.echo(
                f"watching {settings.upstream} on http://{shown}:{p} (recording into {settings.out})", err=True
            ),
            on_window=render_watch.window_line,
        )
    finally:
        sock.close()
    render_watch.summary(outcome)
    if outcome.failed:
        sys.exit(1)


COMMANDS = (watch,)
