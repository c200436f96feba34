"""`lpf serve`: the built-in engine behind an OpenAI / SGLang-compatible HTTP server.

protocol.py   what both wire formats share: errors, prompts, sampling, budgets, stop strings (no torch)
openai_api.py   /v1/completions as vLLM serves it: request model, planning, rendering
sglang_api.py   SGLang's native /generate: request model, planning, rendering
engine_loop.py  the one asyncio loop that owns the engine, so concurrent HTTP requests share engine steps
app.py        the FastAPI app: routes, error responses, /health, /v1/models, /metrics
server.py     bind the socket, build the engine, run uvicorn until SIGINT/SIGTERM (the command: lpf.cli.serve)
process.py    `served(...)`: start `lpf serve` as a child process, wait for /health, stop it (tests, benches)

Nothing heavy is imported here; `lpf --help` stays fast.
"""
