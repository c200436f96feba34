"""LiteLLM's proxy (PyPI `litellm[proxy]`, the gateway users put in front of their servers) as a child process.

Contract: `executable()` is the `litellm` to run (`$LPF_LITELLM`, else the repository's .venv-litellm that
`make setup` creates, else one on PATH) or None. `LiteLLM(exe, routes, tmp)` writes a config mapping each model
name to a model of an OpenAI-compatible server (`routes`: name -> (api_base, upstream model name, forward client
headers?): a model group named in `model_group_settings.forward_client_headers_to_llm_api` gets the client's `x-` headers, the others do
not, LiteLLM's default) and starts the proxy on a free 127.0.0.1 port at once (it takes ~25 s to import here:
start it first, do other work, then `wait()`); `wait()` returns its base URL once /health/liveliness answers
(RuntimeError with its log if it exits or 120 s pass); `stop()` ends it (SIGTERM, SIGKILL after 20 s). Used as a
context manager it stops on exit, on failure too. No network: the model cost map is its packaged copy, telemetry
off, no master key (the config permits it: 127.0.0.1 only).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from lpf.serve.process import free_port

ROOT = Path(__file__).resolve().parent.parent


def executable() -> str | None:
    exe = os.environ.get("LPF_LITELLM") or str(ROOT / ".venv-litellm" / "bin" / "litellm")
    return exe if Path(exe).is_file() else shutil.which("litellm")


class LiteLLM:
    def __init__(self, exe: str, routes: dict[str, tuple[str, str, bool]], tmp: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model_list = [  # (api_key: the upstream checks none; LiteLLM's OpenAI client wants one)
            {"model_name": name, "litellm_params": {"model": f"openai/{model}", "api_base": base, "api_key": "unused"}}
            for name, (base, model, _) in routes.items()
        ]
        config = {
            "model_list": model_list,
            "general_settings": {"dangerously_permit_weak_or_unset_master_key": True},
            "litellm_settings": {
                "telemetry": False,
                "model_group_settings": {
                    "forward_client_headers_to_llm_api": [n for n, (*_, fwd) in routes.items() if fwd]
                },
            },
        }
        cfg = tmp / "litellm.yaml"
        cfg.write_text(json.dumps(config, indent=2))  # YAML reads JSON
        self.log_path = tmp / "litellm.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False")
        self.proc = subprocess.Popen(
            [exe, "--config", str(cfg), "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/health/liveliness", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"LiteLLM's proxy did not come up: {self.log_path.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> LiteLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
