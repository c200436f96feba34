"""`transformers serve` (transformers' own OpenAI-compatible server, the `[serving]` extra) audited end to end.

A real server started here on 127.0.0.1 serves a zoo model under the name `hybrid`: it refuses token-id
prompts ("prompt must be a string") and returns no logprobs, so lpf falls back to text prompts (once, said
in the findings) and audits from tokens alone. The full-precision model is clean and the tokens-only
run-level test `same`; a 4-bit copy (every decoder linear weight rounded group-wise to 4 bits, written
here) served under the same name is `different`; and asked to sample at temperature 1 the server answers
greedily (transformers' own behaviour, traced below), which the tokens-only test calls `different` too. The workload is prose the zoo models were not trained
to continue: their greedy tokens are contested there, which is where tokens alone can show a changed
model (on the trained tasks the 4-bit copy flips no token). Answers whose text does not re-encode to the
server's token count (a lone byte of a UTF-8 character decodes to U+FFFD) stay unscored, with why.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import write_prompts
from scripted_http import free_port

pytestmark = pytest.mark.slow

SERVED = "hybrid"


def _transformers_cli() -> Path | None:
    exe = Path(sys.executable).with_name("transformers")
    try:
        import fastapi, openai, uvicorn  # noqa: F401,E401  (transformers' [serving] extra)
    except ImportError:
        return None
    return exe if exe.is_file() else None


needs_serving = pytest.mark.skipif(
    _transformers_cli() is None, reason="transformers' [serving] extra is not installed (pip install '.[serving]')"
)


def _model_copies(root: Path) -> tuple[Path, Path]:
    """(full, quantized): directories each holding a model directory named SERVED."""
    import torch
    from transformers import AutoModelForCausalLM

    from lpf.builtin.numeric_drills import linear_weights, rtn_groupwise
    from lpf.zoo.registry import model_dir

    full, quant = root / "full", root / "quant"
    shutil.copytree(model_dir("hybrid"), full / SERVED)
    shutil.copytree(model_dir("hybrid"), quant / SERVED)
    model = AutoModelForCausalLM.from_pretrained(full / SERVED, dtype=torch.float32)
    with torch.no_grad():
        for _, w in linear_weights(model):
            w.copy_(rtn_groupwise(w, 4, 128))
    (quant / SERVED / "model.safetensors").unlink()
    model.save_pretrained(quant / SERVED)
    return full, quant


class _Server:
    def __init__(self, cwd: Path, log: Path):
        self.port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            [
                str(_transformers_cli()),
                "serve",
                SERVED,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ],
            cwd=cwd,
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.url, self.log = f"http://127.0.0.1:{self.port}", log

    def __enter__(self):
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        pytest.fail(f"transformers serve not healthy after 180 s:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def prose(tmp_path_factory) -> Path:
    from lpf.zoo.tasks import filler_text

    rng = random.Random(5)
    return write_prompts(
        tmp_path_factory.mktemp("prose") / "prose32.jsonl",
        [{"id": f"f{i:03d}", "prompt": filler_text(rng, rng.randint(8, 20))} for i in range(32)],
    )


def _audit(lpf_cli, server: _Server, prompts: Path, out: Path, *extra):
    return lpf_cli(
        "audit",
        "--engine",
        "openai",
        "--base-url",
        server.url + "/v1",
        "--model",
        SERVED,
        "--reference",
        "zoo:hybrid",
        "-E",
        "dtype=float32",
        "--workload",
        prompts,
        "--max-tokens",
        16,
        "--out",
        out,
        "--json",
        "--fail-on",
        "never",
        *extra,
    )


@needs_serving
def test_transformers_serve_audited_from_tokens_alone_clean_then_a_4bit_copy_is_different(lpf_cli, tmp_path, prose):
    full, quant = _model_copies(tmp_path / "models")
    with _Server(full, tmp_path / "full.log") as server:
        r = _audit(lpf_cli, server, prose, tmp_path / "clean")
        # asked to sample at temperature 1, transformers 5.24 answers greedily: it sets the temperature but
        # turns do_sample on never (cli/serving/utils.py, _build_generation_config: do_sample is only set,
        # to False, at temperature 0; the model's generation_config says do_sample false)
        hot = _audit(lpf_cli, server, prose, tmp_path / "t1", "--temperature", 1, "--seed", 4)
    assert hot.code == 0, hot.err
    h = json.loads(hot.out)["run_test"]
    assert h["result"] == "different" and h["test"] == "sampling", h["sentence"]  # every token the top-1
    assert h["tests"]["sampling"]["k"] == h["tests"]["sampling"]["n"]
    assert r.code == 0, r.err
    f = json.loads(r.out)
    assert f["errors"] == 0 and f["n_requests"] == 32
    assert f["judged"]["logprobs"] == "none" and f["judged"]["prompt_form"] == "text"
    assert any("refused token-id prompts" in n for n in f["judged"]["notes"])  # the fallback, said once
    assert f["verdict"] == "clean" and f["counts"]["divergent"] == f["counts"]["corrupt"] == 0
    assert f["counts"]["clean"] >= 16 and f["n_scored_tokens"] >= 50
    rt = f["run_test"]
    assert rt["kind"] == "tokens" and rt["result"] == "same", rt["sentence"]
    # what could not be recovered from text is kept and said, never scored as the server's tokens
    unscored = f["unscored"]
    assert unscored == f["evidence"]["inconsistent"]["by_reason"].get("retokenized", 0)

    with _Server(quant, tmp_path / "quant.log") as server:
        r = _audit(lpf_cli, server, prose, tmp_path / "quant")
    assert r.code == 0, r.err
    f = json.loads(r.out)
    rt = f["run_test"]
    assert rt["kind"] == "tokens" and rt["result"] == "different", rt["sentence"]
    assert f["verdict"] in ("systematic", "divergent", "corrupt")
    assert rt["tests"]["flips"]["k"] >= 5
