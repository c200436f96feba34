"""The built-in engine's Kimi Delta Attention (tiny:kimi-linear: every layer KDA, dense MLPs) against
transformers' `modeling_kimi_linear` torch path.

- float64, every engine path (one-step prefill, chunked prefill, mixed prefill/decode batches, a reused
  slot; test_engine_models' cases) equals transformers' float64 forward to 1e-10 once transformers' float32
  islands are widened (its kernels cast q/k/v/g/beta and the norms to float32, and the chunked form's decay
  mask with `.float()`); without the widening they differ by ~2e-5;
- the chunked form (`chunk_kda`, per-channel decay) equals a naive per-token recurrence written here, in
  float64, across several chunks from a non-zero initial state;
- engine level in float32 (as `lpf run` drives it): greedy tokens equal transformers' teacher-forced argmax
  and logprobs are within TOL, plain and with chunked prefill.
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest
import torch

from lpf.adapters.builtin import BuiltinEngine, BuiltinOptions
from lpf.builtin.models.kimi_delta import chunk_kda, recurrent_step
from lpf.core.model_specs import load_tokenizer, resolve_model
from lpf.core.sampling import SamplingParams
from lpf.core.workload import expand, load_prompts
from lpf.zoo import registry

MODEL = "tiny:kimi-linear"
TOL = 5e-4


def test_chunked_form_equals_the_per_token_recurrence():
    g = torch.Generator().manual_seed(0)
    b, L, H, d = 2, 21, 3, 8
    q, k, v = (torch.randn(b, L, H, d, generator=g, dtype=torch.float64) for _ in range(3))
    gate = -torch.rand(b, L, H, d, generator=g, dtype=torch.float64)  # a per-channel log decay
    beta = torch.rand(b, L, H, generator=g, dtype=torch.float64)
    init = torch.randn(b, H, d, d, generator=g, dtype=torch.float64)
    out, final = chunk_kda(q, k, v, gate, beta, 8, init)  # three chunks, the last one padded
    state, rows = init, []
    for t in range(L):  # S_t = diag(exp g_t) S + k (beta (v - k^T diag(exp g_t) S))^T, o = q^T S / sqrt(d)
        qt = q[:, t] / (q[:, t].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()  # FLA's l2norm, eps inside
        kt = k[:, t] / (k[:, t].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        state = state * gate[:, t].exp()[..., None]
        delta = beta[:, t][..., None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, state))
        state = state + torch.einsum("bhk,bhv->bhkv", kt, delta)
        rows.append(torch.einsum("bhk,bhkv->bhv", qt, state) / d**0.5)
    assert torch.allclose(out, torch.stack(rows, dim=1), atol=1e-10, rtol=0)
    assert torch.allclose(final, state, atol=1e-10, rtol=0)
    # and the one-token form is the same step as the chunked form's
    o1, s1 = recurrent_step(q[:, 0], k[:, 0], v[:, 0], gate[:, 0], beta[:, 0], init)
    o2, s2 = chunk_kda(q[:, :1], k[:, :1], v[:, :1], gate[:, :1], beta[:, :1], 8, init)
    assert torch.allclose(o1, o2[:, 0], atol=1e-12) and torch.allclose(s1, s2, atol=1e-12)


@pytest.mark.slow  # ~11 s alone (transformers' Kimi Linear and test_engine_models' cases loaded)
def test_float64_layers_equal_transformers_with_its_float32_islands_widened(monkeypatch):
    import transformers.models.kimi_linear.modeling_kimi_linear as hf_mod
    from test_engine_models import CASES, Driver
    from transformers import AutoModelForCausalLM

    from lpf.builtin.models import load_model

    class Wide:  # the module's `torch`, with float32 meaning float64
        def __getattr__(self, name):
            return torch.float64 if name == "float32" else getattr(torch, name)

    to_float = torch.Tensor.float
    monkeypatch.setattr(hf_mod, "torch", Wide())
    monkeypatch.setattr(
        torch.Tensor, "float", lambda t, *a, **k: t if t.dtype == torch.float64 else to_float(t, *a, **k)
    )
    path = resolve_model(MODEL).path
    ours, hf = load_model(path, dtype=torch.float64), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    worst = 0.0
    for case in ("prefill", "chunked", "mixed", "reused-slot"):
        for req in CASES[case](Driver(ours, torch.float64)):
            with torch.no_grad():
                ref = hf.eval()(torch.tensor([req.tokens[: req.computed]]), use_cache=False).logits[0]
            worst = max(worst, (req.rows() - ref.log_softmax(-1)).abs().max().item())
    assert worst <= 1e-10, worst


@pytest.mark.slow  # ~2 s each here, out of `make test-fast`'s budget as test_builtin_gdn
@pytest.mark.parametrize("budget", [256, 16])
def test_engine_equals_transformers_greedy(budget):
    from transformers import AutoModelForCausalLM

    ref = resolve_model(MODEL)
    tok = load_tokenizer(ref)
    sampling = SamplingParams(max_tokens=8)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(i) + "\n" for i in registry.workload_items("shared-prefix", n=6)))
    prompts, _ = load_prompts(f.name, tok, len(tok), None)
    requests = expand(prompts, 1, sampling)
    engine = BuiltinEngine(ref, sampling, BuiltinOptions.parse({"max_num_batched_tokens": budget}))
    done = {c.request_id: c for c in engine.generate(requests)}
    trace = engine.side_tables()["trace"].to_pylist()
    assert budget > 16 or any(r["phase"] == "extend" for r in trace)  # prompts really split into chunks
    hf = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32).eval()
    for r in requests:
        c = done[r.request_id]
        assert c.error is None and c.output_token_ids, c.error
        ids = list(r.prompt_token_ids) + c.output_token_ids
        with torch.no_grad():
            lp = hf(torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)
        rows = lp[len(r.prompt_token_ids) - 1 : len(ids) - 1]
        assert rows.argmax(-1).tolist() == c.output_token_ids, r.request_id
        got = rows.gather(1, torch.tensor(c.output_token_ids)[:, None])[:, 0].numpy()
        assert np.max(np.abs(got - np.asarray(c.logprobs))) <= TOL
