"""`lpf serve`: the built-in engine behind an OpenAI / SGLang-compatible HTTP server.

protocol.py   request models and response rendering for /v1/completions and SGLang's /generate (no torch)
engine_loop.py  the one asyncio loop that owns the engine, so concurrent HTTP requests share engine steps
app.py        the FastAPI app: routes, error responses, /health, /v1/models, /metrics
command.py    the `lpf serve` click command: options -> engine -> uvicorn, clean shutdown on SIGINT/SIGTERM
process.py    `served(...)`: start `lpf serve` as a child process, wait for /health, stop it (tests, benches)

Nothing heavy is imported here; `lpf --help` stays fast.
"""
