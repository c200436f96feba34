"""The built-in engine's Gated DeltaNet hybrid (zoo:qwen35, Qwen3.5's shape, trained) against transformers.

Engine level, as `lpf run` drives it (the built-in adapter), on zoo:shared-prefix prompts (shared
prefixes, so prefix caching really hits) and zoo:oracle ones, 12 greedy tokens past `</s>` (so every
request decodes, and speculates, for 12 steps): every output token must be the argmax of transformers'
teacher-forced float32 forward of prompt + output (greedy tokens identical) and its logprob within
TOL of that forward's, in four configurations: plain; chunked prefill (max_num_batched_tokens 16
splits every prompt); prefix caching (GDN state checkpoints at 16-token blocks, resumed from); and
speculative decoding with prefix caching, n-gram drafts and a draft model's (the GDN state rolled
back to the snapshot of the last accepted draft). Each configuration also shows its mechanism really ran
(chunks, cache hits, drafts accepted and rejected). Measured 2026-12-08: at most 1.2e-5 from transformers
in every configuration (TOL 1e-4); the random tiny:qwen35 (initializer range 0.25) was ill-conditioned
(transformers' own float32 forward up to ~3.4e-4 from its float64 one) and needed 5e-4; the layer-level
exactness (float64, every path to 1e-9) is in test_engine_models.py.
The reference agrees with itself here (full forward vs prefill + cached decode: <= 1e-4), with
transformers' pure-torch GDN path (no `fla`).
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest
import torch

from lpf.adapters.builtin import BuiltinEngine, BuiltinOptions
from lpf.core.model_specs import load_tokenizer, resolve_model
from lpf.core.sampling import SamplingParams
from lpf.core.workload import expand, load_prompts
from lpf.zoo import registry

pytestmark = pytest.mark.slow  # the engine against transformers on every path: ~12 s (make test-fast's budget)

MODEL = "zoo:qwen35"
TOL = 1e-4
N = 8  # zoo:shared-prefix requests (prefix caching hits), then ORACLE zoo:oracle ones
ORACLE = 4


@pytest.fixture(scope="module")
def setup():
    ref = resolve_model(MODEL)
    tok = load_tokenizer(ref)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    items = registry.workload_items("shared-prefix", n=N) + registry.workload_items("oracle", n=ORACLE)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(i) + "\n" for i in items))
    prompts, _ = load_prompts(f.name, tok, len(tok), None)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32).eval()
    return ref, sampling, expand(prompts, 1, sampling), hf


def run(setup, **knobs):
    ref, sampling, requests, _ = setup
    engine = BuiltinEngine(ref, sampling, BuiltinOptions.parse(knobs))
    done = {c.request_id: c for c in engine.generate(requests)}
    return done, engine.side_tables()["trace"].to_pylist(), engine.engine.describe()


def check_against_hf(setup, done) -> float:
    """Asserts greedy tokens equal HF's teacher-forced argmax; returns the worst |logprob diff|."""
    _, _, requests, hf = setup
    worst = 0.0
    for r in requests:
        c = done[r.request_id]
        assert c.error is None and c.output_token_ids, c.error
        ids = list(r.prompt_token_ids) + c.output_token_ids
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        rows = lp[len(r.prompt_token_ids) - 1 : len(ids) - 1]
        assert rows.argmax(-1).tolist() == c.output_token_ids, r.request_id
        ref = rows.gather(1, torch.tensor(c.output_token_ids)[:, None])[:, 0].numpy()
        worst = max(worst, float(np.max(np.abs(ref - np.asarray(c.logprobs)))))
    return worst


def test_plain_and_chunked_prefill_equal_transformers(setup):
    done, _, _ = run(setup, max_num_batched_tokens=256)
    assert check_against_hf(setup, done) <= TOL
    done, trace, _ = run(setup, max_num_batched_tokens=16)
    assert check_against_hf(setup, done) <= TOL
    assert any(r["phase"] == "extend" for r in trace)  # prompts really split into chunks


def test_prefix_caching_equals_transformers_while_hitting(setup):
    done, trace, info = run(setup, max_num_batched_tokens=32, enable_prefix_caching=True, mamba_block_size=16)
    assert check_against_hf(setup, done) <= TOL
    assert info["prefix_cache"]["hit_tokens"] > 0
    assert any(r["prefix_cache_hit_tokens"] for r in trace)


def _noisy_draft(setup, tmp_path) -> str:
    """The model with noise on its LM head: a draft whose greedy tokens agree with the target's often,
    not always, so verify steps accept some drafts and roll the GDN state back past others."""
    from transformers import AutoModelForCausalLM

    ref = setup[0]
    draft = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * 0.5 * w.std())
    draft.save_pretrained(tmp_path / "draft")
    load_tokenizer(ref).save_pretrained(tmp_path / "draft")
    return str(tmp_path / "draft")


def test_speculative_decoding_with_prefix_caching_equals_transformers(setup, tmp_path):
    knobs = dict(max_num_batched_tokens=32, enable_prefix_caching=True, mamba_block_size=16)
    done, trace, _ = run(setup, speculative="ngram:3", **knobs)
    assert check_against_hf(setup, done) <= TOL
    drafted = sum(r["num_draft_tokens"] or 0 for r in trace)
    assert 0 < sum(r["num_accepted_tokens"] or 0 for r in trace) < drafted  # n-gram drafts kept and rejected
    done, trace, _ = run(setup, speculative=f"draft:{_noisy_draft(setup, tmp_path)}:3", **knobs)
    assert check_against_hf(setup, done) <= TOL
    rows = [r for r in trace if r["num_draft_tokens"]]
    assert sum(r["num_accepted_tokens"] for r in rows) > 0  # drafts kept
    partial = [r for r in rows if 0 < r["num_accepted_tokens"] < r["num_draft_tokens"]]
    assert partial and all(
        r["state_tokens_after_rollback"] == r["num_computed_tokens"] + 1 + r["num_accepted_tokens"] for r in partial
    )  # the GDN state rolled back to a snapshot inside the verified run


def test_float64_layers_equal_transformers_with_its_float32_islands_widened(setup, monkeypatch):
    """The exactness anchor: transformers computes the delta rule, the gated norm and the zero-centred
    norms in float32 even for a float64 model (so its float64 forward is ~3e-4 from ours); with those
    widened to float64 it agrees with the engine's float64 model, chunked prefill, extends, batched
    decodes and a reused slot included, to ~1e-6 (what is left: HF's float32 RoPE angles)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as hf_mod
    from test_engine_models import CASES, Driver
    from transformers import AutoModelForCausalLM

    from lpf.builtin.models import load_model

    class Wide:  # the module's `torch`, with float32 meaning float64
        def __getattr__(self, name):
            return torch.float64 if name == "float32" else getattr(torch, name)

    def centred_norm(self, x):
        return (self._norm(x.double()) * (1.0 + self.weight.double())).type_as(x)

    monkeypatch.setattr(hf_mod, "torch", Wide())
    monkeypatch.setattr(hf_mod.Qwen3_5RMSNorm, "forward", centred_norm)
    path = setup[0].path
    ours, hf = load_model(path, dtype=torch.float64), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    worst = 0.0
    for case in ("chunked", "mixed", "reused-slot"):
        for req in CASES[case](Driver(ours, torch.float64)):
            with torch.no_grad():
                ref = hf.eval()(torch.tensor([req.tokens[: req.computed]])).logits[0].log_softmax(-1)
            worst = max(worst, (req.rows() - ref).abs().max().item())
    assert worst <= 1e-5, worst
