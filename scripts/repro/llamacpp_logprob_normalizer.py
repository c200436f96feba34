"""llama-server: the logprobs it reports are normalised by a float32 running sum that drops the tail.

Run: PYTHONPATH=src .venv/bin/python scripts/repro/llamacpp_logprob_normalizer.py [zoo:jamba]
(needs `make llamacpp`). One prompt, one greedy token, `n_probs` = the whole vocabulary, raw
(pre-sampling) probabilities: the returned distribution should sum to 1.
Observed (llama.cpp vendored by llama-cpp-python 0.3.36, zoo:jamba f32, 512-token vocabulary): it sums
to 1 + 2.5e-5 on a confident position, and every logprob is too high by the same log(sum).
Cause: tools/server/server-common.cpp `get_token_probabilities` (lines 1574-1597): after
`partial_sort` puts the largest logit first, `cum_sum` is a float32 running sum that starts at
exp(0) = 1, so each later term loses what lies below half an ulp of ~1 (6e-8): the terms under 6e-8
vanish and the rest round, always on the same side when they are small. The reported p = e / cum_sum
then sums to more than 1 (the bias grows with the vocabulary's tail). The script also replays that
float32 sum on the float64 logits of Hugging Face's model: the replay gives the server's number to ~1e-7,
so the model's own computation is exact at float32 and the departure is the normaliser alone.
"""

import json
import sys

import httpx
import numpy as np

from lpf.adapters.llamacpp_gguf import find_tools, gguf_for
from lpf.adapters.llamacpp_server import LlamaServer
from lpf.core.model_specs import load_tokenizer, resolve_model


def replay(logits: np.ndarray) -> np.ndarray:
    """llama.cpp's get_token_probabilities on these logits: float32, max first, running float32 sum."""
    l32 = logits.astype(np.float32)
    order = np.argsort(-l32, kind="stable")
    e = np.exp(l32[order] - l32[order[0]]).astype(np.float32)
    s = np.float32(0)
    for v in e:
        s = np.float32(s + v)
    out = np.empty_like(e)
    out[order] = np.log(e / s)
    return out.astype(np.float64)


if __name__ == "__main__":
    import torch
    from transformers import AutoModelForCausalLM

    spec = sys.argv[1] if len(sys.argv) > 1 else "zoo:jamba"
    model = resolve_model(spec)
    tok = load_tokenizer(model)
    tools = find_tools()
    gguf = gguf_for(model, "float32", tools)
    ids = tok("R:G65,H14,R49,J25|J")["input_ids"]  # a recall prompt: a confident first answer token
    server = LlamaServer(
        tools.server, gguf.path, ["-np", "1", "-c", "512", "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-t", "1"]
    ).start()
    try:
        n_vocab = len(tok)
        body = httpx.post(
            server.base_url + "/completion",
            timeout=60,
            json={
                "prompt": ids,
                "n_predict": 1,
                "n_probs": n_vocab,
                "post_sampling_probs": False,
                "samplers": ["temperature"],
                "temperature": 0,
                "cache_prompt": False,
            },
        ).json()
    finally:
        server.cleanup()
    if "completion_probabilities" not in body:
        sys.exit(f"the server answered {json.dumps(body)[:300]}")
    got = np.full(n_vocab, np.nan)
    for alt in body["completion_probabilities"][0]["top_logprobs"]:
        got[alt["id"]] = alt["logprob"]
    total = float(np.exp(got[np.isfinite(got)]).sum())
    m = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0, -1].double().numpy()
    exact = logits - np.logaddexp.reduce(logits)
    sim = replay(logits)
    top = int(np.argmax(logits))
    print(
        json.dumps(
            {
                "model": spec,
                "prompt_tokens": len(ids),
                "vocabulary": n_vocab,
                "returned": int(np.isfinite(got).sum()),
                "sum_of_returned_probabilities": total,
                "top_token": {
                    "id": top,
                    "server": got[top],
                    "exact_float64": exact[top],
                    "replayed_float32_sum": sim[top],
                },
                "max_abs_server_minus_exact": float(np.nanmax(np.abs(got - exact))),
                "max_abs_server_minus_replay": float(np.nanmax(np.abs(got - sim))),
            },
            indent=1,
        )
    )
