"""Run the HTTP server: a bound socket, the built-in engine, uvicorn until SIGINT/SIGTERM.

Contract: `bind(host, port)` binds first (so a busy port fails at once and port 0 picks a free one)
or raises LpfError. `run(model, name, options, sock, trace_dir, log_level, on_ready,
repetition_penalty)` builds the engine from validated `BuiltinOptions` (the penalty: the completions
route's default), serves until a stop signal, calls `on_ready(port)` once the server accepts
connections, and returns the engine loop's stats. In-flight requests get up to 10 s
to finish, the engine loop stops, the trace sink is flushed; a server that never started is an
LpfError. It prints nothing: the command line says what happened.
"""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path
from typing import Callable

from lpf.core.errors import LpfError


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise LpfError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise LpfError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(
    ref,
    name: str,
    options,
    sock: socket.socket,
    trace_dir: Path | None,
    log_level: str,
    on_ready: Callable[[int], None],
    repetition_penalty: float = 1.0,
):
    import torch
    import uvicorn

    from lpf.adapters import engine_config
    from lpf.builtin.llm_engine import LLMEngine
    from lpf.core.model_specs import load_tokenizer
    from lpf.serve.app import create_app
    from lpf.serve.engine_loop import TraceSink
    from lpf.serve.protocol import ModelInfo

    if options.threads > 0:
        torch.set_num_threads(options.threads)
    engine = LLMEngine.from_options(ref.path, options)
    cfg = engine.config
    tokenizer = load_tokenizer(ref)
    info = ModelInfo(
        name=name,
        root=str(ref.path),
        vocab_size=int(engine.model.config.vocab_size),
        max_context=engine.max_context,
        eos_token_id=tokenizer.eos_token_id,
        prefill_limit=None if cfg.enable_chunked_prefill else cfg.max_num_batched_tokens,
        repetition_penalty=repetition_penalty,
        configuration={
            **engine_config.builtin(cfg.dtype, repetition_penalty, kv_cache_dtype=cfg.kv_quantized),
            "faults": [f for f in options.inject.split(",") if f],
        },
    )
    sink = None
    if trace_dir is not None:
        sink = TraceSink(trace_dir)
        (Path(trace_dir) / "serve.json").write_text(
            json.dumps(
                {
                    "model": ref.describe(),
                    "served_model_name": name,
                    "options": options.to_dict(),
                    "repetition_penalty": repetition_penalty,
                    "cache": engine.describe(),
                },
                indent=2,
            )
        )
    app = create_app(engine, tokenizer, info, sink)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10, lifespan="on"))
    if not serve_until_stopped(server, sock, on_ready):
        raise LpfError("the server did not start (see the messages above)")
    return app.state.loop.stats


def serve_until_stopped(server, sock: socket.socket, on_ready: Callable[[int], None], before=None) -> bool:
    """Run a `uvicorn.Server` on `sock` until SIGINT/SIGTERM (or its `should_exit`), calling `on_ready(port)`
    once it accepts connections; whether it started. `before()` runs once the signal handlers are in place
    (a child started there is never left behind by a signal that kills this process first). Shared by
    `lpf serve` and `lpf watch`."""
    import asyncio

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            on_ready(sock.getsockname()[1])
        await task

    # uvicorn re-raises the signal that stopped it once it has shut down; these no-op handlers make
    # that a clean exit (0) instead of a KeyboardInterrupt or a kill by SIGTERM.
    stop_signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _frame: stop_signals.append(s))
    if before is not None:
        before()
    asyncio.run(main())
    return bool(server.started)
