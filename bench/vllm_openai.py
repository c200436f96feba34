"""vLLM's own OpenAI server (the CPU build in .venv-vllm) as a child process, for the benches that audit it.

Contract: `with vllm_openai_server(model, log, args, env) as base:` starts `vllm.entrypoints.openai.api_server`
serving `model` (a zoo name, resolved to its local path, served under that name) at float32 unless `args` says
`--dtype`, eager, up to 20 logprobs, on 127.0.0.1 and a free port, in its own session, with vLLM's in-process
settings (no V1 multiprocessing, no dynamo, 1 GiB of KV cache) plus `env` and without PYTHONPATH (lpf's source
must not shadow what .venv-vllm has installed); waits until GET /health answers 200 (RuntimeError with the log's
tail if it exits or 600 s pass); yields `http://127.0.0.1:PORT`; on exit SIGTERMs its process group (SIGKILL
after 30 s). Its output goes to `log`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


@contextlib.contextmanager
def vllm_openai_server(model: str, log: Path, args: tuple | list = (), env: dict | None = None):
    import httpx

    from lpf.adapters.vllm import vllm_python
    from lpf.core.model_specs import resolve_model
    from lpf.serve.process import free_port

    port = free_port()
    full_env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1", VLLM_CPU_KVCACHE_SPACE="1")
    full_env.update(env or {})
    full_env.pop("PYTHONPATH", None)
    dtype = [] if "--dtype" in args else ["--dtype", "float32"]
    argv = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model(model).path)]
    argv += ["--served-model-name", model, "--host", "127.0.0.1", "--port", str(port), *dtype]
    argv += ["--enforce-eager", "--max-logprobs", "20", *map(str, args)]
    proc = subprocess.Popen(
        argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=full_env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not healthy in 600 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
