"""llama-cpp-python's own OpenAI-compatible server (`python -m llama_cpp.server`, 0.3.36, built by
`make llamacpp-python` from the sdist lpf's llama.cpp comes from) as a user runs it: its defaults are a
`repeat_penalty` of 1.1 over the tokens it generated (completions and chat alike), an f16 KV cache and no
flash attention, and it says none of that (no /props). Audited with `--engine openai` on zoo:jamba's float32
GGUF, greedy: the penalty is named with its kind, scope and value and an interval of real width, the requests
whose flips it explains are the server's sampling (not divergent), the run-level test is `same` against the
f16 KV copy its top-k spread shows (named as inferred), and the default gate passes (docs/real-engines.md).
The server documents its defaults in /openapi.json, which lpf reads: on completions, where two flips are too
few for a fit, the stated penalty tested as stated ends the run right.
Skipped without the build (`make test` builds it; $LPF_LLAMACPP_PYTHON names another interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from lpf.core.errors import LpfError

ROOT = Path(__file__).resolve().parent.parent


def _python() -> str | None:
    exe = os.environ.get("LPF_LLAMACPP_PYTHON") or str(ROOT / ".venv-llamacpp-python" / "bin" / "python")
    return exe if Path(exe).is_file() else None


def _gguf_tools():
    from lpf.adapters.llamacpp_gguf import find_tools

    try:
        return find_tools()
    except LpfError:
        return None


needs_server = pytest.mark.skipif(
    _python() is None or _gguf_tools() is None,
    reason="llama-cpp-python's server or llama.cpp's converter not built: make llamacpp-python llamacpp",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """llama-cpp-python's server on zoo:jamba's float32 GGUF with every default left as it ships."""
    from lpf.adapters.llamacpp_gguf import gguf_for
    from lpf.core.model_specs import resolve_model
    from lpf.serve.process import free_port

    gguf = gguf_for(resolve_model("zoo:jamba"), "float32", _gguf_tools())
    port = free_port()
    log = tmp_path_factory.mktemp("llamacpp-python") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [_python(), "-m", "llama_cpp.server", "--model", str(gguf.path), "--host", "127.0.0.1"]
            + ["--port", str(port), "--n_threads", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise RuntimeError(f"llama-cpp-python's server did not come up: {log.read_text(errors='replace')[-2000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@needs_server
@pytest.mark.slow  # the server's start (~20 s) and 200 requests with their reference (~50 s)
def test_its_default_repeat_penalty_is_named_and_the_gate_passes(lpf_cli, tmp_path, server):
    """The chat route (the zoo models' chat template takes them off their tasks: longer answers that repeat
    themselves, so the penalty changes a greedy choice in about 1 answer in 5; on completions zoo:stress's
    short, sure answers give 2 flips in 300: docs/real-engines.md). 200 requests: a repetition penalty over the
    output and a presence penalty act on the same tokens and are told apart from ~30 flips on (the first 150
    requests, without the server's word, named a presence penalty of about 0.6 [0.49, 0.82]; the kind the server
    states is named wherever the evidence cannot tell it from the best)."""
    r = lpf_cli(
        "audit", "--engine", "openai", "--base-url", server, "--model", "zoo:jamba", "--workload", "zoo:stress",
        "--limit", 200, "--seed", 17, "--max-tokens", 32, "--api", "chat", "--out", tmp_path / "run", "--json",
    )  # fmt: skip
    found = json.loads(r.out)
    fit = (found.get("server_processing") or {}).get("penalty")
    assert fit is not None, (found["counts"], [f.get("mechanism") for f in found.get("flagged", [])])
    assert (fit["mechanism"], fit["scope"]) == ("repetition_penalty", "output"), fit
    assert abs(fit["value"] - 1.1) <= 0.03 and fit["interval"][0] <= 1.1 <= fit["interval"][1], fit
    assert fit["interval"][1] > fit["interval"][0] and fit["lowered"] > 0
    assert found["run_test"]["result"] == "same" and "f16 KV copy" in found["run_test"]["configured_sentence"]
    assert r.code == 0 and found["counts"]["divergent"] == found["counts"]["corrupt"] == 0, found["counts"]
    # the server's own word: its /openapi.json documents repeat_penalty 1.1, and its sampler sees the output only;
    # the fit names the stated kind (a presence penalty is not told apart from it on this evidence alone)
    said = json.loads((tmp_path / "run" / "manifest.json").read_text())["engine"]["configuration"]
    said = said["sampling_defaults"]
    assert said["source"] == "engine" and "/openapi.json" in said["via"], said
    assert said["value"]["repeat_penalty"] == 1.1 and said["value"]["penalty_scope"] == "output", said
    assert fit["stated"]["named"] and found["errors"] == 0, (fit, found["errors"])


@needs_server
@pytest.mark.slow  # with the server above; ~4.5 s of its own
def test_a_few_flips_its_stated_default_explains_end_right_and_without_its_word_they_do_not(lpf_cli, tmp_path, server):
    """On completions zoo:stress's short, sure answers give the default penalty almost nothing to act on: 2 flips
    in 300 answers (stress-0-00058, stress-0-00106), too few to fit a kind (docs/real-engines.md). Those two
    prompts and 14 others: the penalty the server states is tested as stated, named with source "stated", its
    flips its sampling, the gate passes; the same run with the server's word taken out of its manifest names
    nothing and stays `divergent`, exit 1 (no kind is fitted from two flips)."""
    from conftest import write_prompts
    from lpf.zoo import registry

    items = registry.workload_items("stress", seed=0, n=110)
    keep = [it for it in items if it["id"].endswith(("00058-copy", "00106-copy"))] + items[:14]
    assert len(keep) == 16
    prompts = write_prompts(tmp_path / "p.jsonl", keep)
    run = tmp_path / "run"
    r = lpf_cli(
        "audit", "--engine", "openai", "--base-url", server, "--model", "zoo:jamba", "--workload", prompts,
        "--seed", 17, "--max-tokens", 32, "--out", run, "--json",
    )  # fmt: skip
    found = json.loads(r.out)
    fit = (found.get("server_processing") or {}).get("penalty")
    assert fit is not None and fit["source"] == "stated", (found["counts"], fit)
    assert (fit["mechanism"], fit["scope"], fit["value"]) == ("repetition_penalty", "output", 1.1)
    assert fit["explained"] == fit["flips"] == 2 and fit["lost"] == 0 and fit["lowered"] == 2, fit
    assert fit["consistent"] and "cannot tell it from" in fit["sentence"]
    assert r.code == 0 and found["counts"]["divergent"] == 0, found["counts"]
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["engine"]["configuration"]["sampling_defaults"] = {"value": None, "source": "absent", "via": None}
    (run / "manifest.json").write_text(json.dumps(manifest))
    again = lpf_cli("analyze", run, "--json")
    unsaid = json.loads(again.out)
    assert (unsaid.get("server_processing") or {}).get("penalty") is None
    assert again.code == 1 and unsaid["counts"]["divergent"] == 2, unsaid["counts"]
