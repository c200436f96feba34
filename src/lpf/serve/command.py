"""The `lpf serve` command: options -> built-in engine -> uvicorn on one pre-bound socket.

Contract: every option is validated (engine knobs through the builtin adapter's own `BuiltinOptions`,
the model's architecture, the address) before the model loads, and a bad one is an `LpfError` (one
line, exit 2). The socket is bound first, so a busy port fails at once and `--port 0` picks a free
port; the line "serving NAME on http://HOST:PORT" is printed to stderr once the server accepts
connections. SIGINT and SIGTERM shut down cleanly: in-flight requests get up to 10 s to finish, the
engine loop stops, the trace sink is flushed, and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import click

from lpf.errors import LpfError


def _drills() -> str:
    from lpf.engine.faults import DRILLS

    return ", ".join(DRILLS)


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise LpfError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _engine_options(engine_option, inject, cache_mb, max_num_seqs, max_num_batched_tokens,
                    enable_chunked_prefill, dtype):
    from lpf.engines.builtin import BuiltinOptions

    from lpf.knobs import engine_options

    return BuiltinOptions.parse(engine_options(
        engine_option, inject, dtype=dtype, cache_mb=cache_mb, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill))


@click.command("serve")
@click.option("--model", default=None, help="Model dir, zoo:NAME or tiny:NAME [default: zoo:hybrid].")
@click.option("--served-model-name", default=None, help="Name clients send as `model` [default: the --model text].")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="0 = any free port (printed when ready).")
@click.option("--inject", multiple=True, metavar="FAULT[:ARG]", help="Enable a fault drill (repeatable).")
@click.option("--cache-mb", type=float, default=None, help="Cache size (the gpu_memory_utilization analogue).")
@click.option("--max-num-seqs", type=int, default=None, help="Engine knob (vLLM's name).")
@click.option("--max-num-batched-tokens", type=int, default=None, help="Engine knob (vLLM's name).")
@click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=None, help="Engine knob (vLLM's name).")
@click.option("--dtype", default=None, help="Engine dtype (float32, bfloat16, float16).")
@click.option("-E", "--engine-option", "engine_option", multiple=True, metavar="KEY=VALUE",
              help="Engine knob, e.g. -E block_size=32 or -E threads=2 (repeatable).")
@click.option("--trace-dir", type=click.Path(path_type=Path), default=None,
              help="Append the engine's per-step trace and fault ground truth here as Parquet parts.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="warning", show_default=True, help="uvicorn's log level (info logs every request).")
def serve(model, served_model_name, host, port, inject, cache_mb, max_num_seqs, max_num_batched_tokens,
          enable_chunked_prefill, dtype, engine_option, trace_dir, log_level):
    """Serve the built-in engine over HTTP: OpenAI /v1/completions, SGLang /generate, /v1/models, /health.

    Concurrent requests are batched into the same engine steps; --inject makes a fault auditable
    through HTTP (`lpf audit --engine openai --base-url http://HOST:PORT/v1 --model NAME`).
    """
    from lpf.engines.builtin import BuiltinEngine
    from lpf.models import DEFAULT_MODEL, resolve_model
    from lpf.pipeline import model_config

    options = _engine_options(engine_option, inject, cache_mb, max_num_seqs, max_num_batched_tokens,
                              enable_chunked_prefill, dtype)
    if not 0 <= port <= 65535:
        raise LpfError(f"--port must be in 0..65535, got {port}")
    spec = model or DEFAULT_MODEL
    ref = resolve_model(spec)
    BuiltinEngine.check_model(model_config(ref))
    sock = _bind(host, port)
    try:
        _run(ref, served_model_name or spec, options, sock, host, trace_dir, log_level)
    finally:
        sock.close()


def _run(ref, name: str, options, sock: socket.socket, host: str, trace_dir: Path | None, log_level: str) -> None:
    import asyncio
    from dataclasses import asdict, fields

    import torch
    import uvicorn

    from lpf.engine.config import EngineConfig
    from lpf.engine.faults import FaultSet
    from lpf.engine.llm_engine import LLMEngine
    from lpf.models import load_tokenizer
    from lpf.serve.app import create_app
    from lpf.serve.engine_loop import TraceSink
    from lpf.serve.protocol import ModelInfo

    if options.threads > 0:
        torch.set_num_threads(options.threads)
    cfg = EngineConfig(**{f.name: getattr(options, f.name) for f in fields(EngineConfig)})
    engine = LLMEngine(ref.path, cfg, FaultSet.parse(options.inject))
    tokenizer = load_tokenizer(ref)
    info = ModelInfo(name=name, root=str(ref.path), vocab_size=int(engine.model.config.vocab_size),
                     max_context=engine.max_context, eos_token_id=tokenizer.eos_token_id,
                     prefill_limit=None if cfg.enable_chunked_prefill else cfg.max_num_batched_tokens)
    sink = None
    if trace_dir is not None:
        sink = TraceSink(trace_dir)
        (Path(trace_dir) / "serve.json").write_text(json.dumps(
            {"model": ref.describe(), "served_model_name": name, "options": asdict(options),
             "cache": engine.describe()}, indent=2))
    app = create_app(engine, tokenizer, info, sink)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10,
                                           lifespan="on"))
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            click.echo(f"serving {name} on http://{shown}:{port}", err=True)
        await task

    # uvicorn re-raises the signal that stopped it once it has shut down; these no-op handlers make
    # that a clean exit (0) instead of a KeyboardInterrupt or a kill by SIGTERM.
    stop_signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _frame: stop_signals.append(s))
    asyncio.run(main())
    if not server.started:
        raise LpfError("the server did not start (see the messages above)")
    s = app.state.loop.stats
    click.echo(f"lpf serve: shut down cleanly after {s.steps} steps and {s.requests_finished} requests "
               f"(largest batch {s.max_batch_size})", err=True)
