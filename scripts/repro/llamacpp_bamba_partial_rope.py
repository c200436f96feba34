"""llama.cpp: Bamba with partial rotary attention rotates the wrong pairs of q/k dimensions.

Run with lpf's Python (transformers of the reference; llama.cpp built by `make llamacpp`):
  env -u PYTHONPATH .venv/bin/python scripts/repro/llamacpp_bamba_partial_rope.py
Prints the max |logprob diff| between llama-server (float32 GGUF, float32 KV cache, one slot) and
transformers (float32) on the greedy tokens of one 40-token prompt, for three GGUFs of lpf's tiny Bamba
(head_dim 32, transformers' fixed partial_rotary_factor 0.5: 16 rotated dimensions per head):
  as converted                           the converter reads the rotary width from `attn_rotary_emb`
                                         only; transformers 5 writes none, so the GGUF says 32
  attn_rotary_emb=16                     the width right, the pairs still wrong
  attn_rotary_emb=16, q/k pre-arranged   rows arranged so the converter's whole-head reorder ends as a
                                         reorder of the first 16 dimensions: agrees to float32 rounding
Measured (llama.cpp of llama-cpp-python 0.3.36, transformers 5.24.0, 2026-12-02): 3.20, 5.10, 0.0000.
Cause: Bamba runs llama.cpp's NORM (pair-adjacent) rope (src/llama-model.cpp:3076, returned at :3095), so
the converter un-permutes q/k rows (`undo_permute = True`, conversion/granite.py:397; the reorder,
conversion/llama.py:176-181, applied at :260-264) across the whole head: with 16 of 32 dimensions
rotated it pairs dimension j with j+16 where transformers' rotate_half over the rotated 16 pairs j with
j+8. The rotary width itself comes only from `attn_rotary_emb` (conversion/granite.py:510-511), while
transformers' BambaConfig fixes partial_rotary_factor at 0.5 (configuration_bamba.py:92).
"""

import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from lpf.adapters.llamacpp_gguf import find_tools  # noqa: E402
from lpf.experiments.conformance.tiny import build_tiny  # noqa: E402


def convert(model_dir: Path, out: Path) -> Path:
    tools = find_tools()
    subprocess.run(
        [sys.executable, str(ROOT / "src/lpf/adapters/llamacpp_convert.py"), str(tools.root / "llama.cpp"), "--"]
        + [str(model_dir), "--outtype", "f32", "--outfile", str(out)],
        check=True,
        capture_output=True,
    )
    return out


def server_tokens(gguf: Path, prompt: list[int], n: int) -> list[tuple[int, int, float]]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cmd = [str(find_tools().root / "bin/llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", "1", "-c", "512", "-ctk", "f32", "-ctv", "f32", "--no-webui", "--no-cache-prompt", "-t", "1"]
    cmd += ["-tb", "1", "--fit", "off", "-fa", "off"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if json.load(r).get("status") == "ok":
                        break
            except OSError:
                pass
            time.sleep(0.5)
        req = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "n_probs": 1}
        req |= {"cache_prompt": False, "samplers": ["top_k"], "return_tokens": True}
        body = urllib.request.Request(
            f"http://127.0.0.1:{port}/completion", json.dumps(req).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(body, timeout=120) as r:
            out = json.load(r)
    finally:
        p.terminate()
        p.wait()
    gen, steps, j = out["tokens"], [], 0
    for c in out["completion_probabilities"]:  # a token ending inside a UTF-8 character has no entry
        while gen[j] != c["id"]:
            j += 1
        steps.append((j, c["id"], c["logprob"]))
        j += 1
    return gen, steps


def max_diff(hf_dir: Path, gguf: Path, prompt: list[int]) -> float:
    gen, steps = server_tokens(gguf, prompt, 16)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([prompt + gen])).logits[0].float(), -1)
    return max(abs(lsm[len(prompt) - 1 + i, t].item() - lp) for i, t, lp in steps)


def with_rotary_width(src: Path, dst: Path, prearrange: bool) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    config["attn_rotary_emb"] = 16
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if prearrange:  # rows such that the converter's whole-head reorder leaves a reorder of the first 16
        d, r = 32, 16
        whole = np.array([e * (d // 2) + j for j in range(d // 2) for e in range(2)])
        part = np.array([e * (r // 2) + j for j in range(r // 2) for e in range(2)] + list(range(r, d)))
        pre = torch.from_numpy(part[np.argsort(whole)])
        sd = load_file(src / "model.safetensors")
        for k, w in sd.items():
            if k.endswith(("q_proj.weight", "k_proj.weight")):
                sd[k] = w.reshape(w.shape[0] // d, d, -1)[:, pre].reshape(w.shape).contiguous()
        save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    random.seed(0)
    prompt = [1] + [random.randrange(3, 512) for _ in range(39)]
    src, tmp = build_tiny("bamba"), Path(tempfile.mkdtemp(prefix="repro-bamba-"))
    width = with_rotary_width(src, tmp / "width", prearrange=False)
    fixed = with_rotary_width(src, tmp / "fixed", prearrange=True)
    print(f"as converted: max |d| {max_diff(src, convert(src, tmp / 'a.gguf'), prompt):.4f}")
    print(f"attn_rotary_emb=16: max |d| {max_diff(src, convert(width, tmp / 'b.gguf'), prompt):.4f}")
    # the pre-arranged copy's GGUF is compared with transformers on the original weights
    print(f"attn_rotary_emb=16, q/k pre-arranged: max |d| {max_diff(src, convert(fixed, tmp / 'c.gguf'), prompt):.4f}")
