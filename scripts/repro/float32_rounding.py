"""Zamba (v1) and Inkling2Loop: the reference column's two consistent rows past 1e-3 (teacher-forced float32
4.0e-3 and 1.6e-3) are the models' own float32 rounding, not a path that departs. Three numbers on the first
workload prompt: the float32 forward against the float64 gold; the float64 forward of the same
weights each perturbed by relative N(0, 2^-24) noise (float32's rounding, applied once to the
weights) against the gold; and the gold against a float64 pass whose `.float()` casts (the slow
Mamba scan rounds B, x and A to float32 even in a float64 model) are kept float64. An
architecture whose paths sit near 1e-5 (Bamba) is printed beside them for scale.

Run with lpf's Python (transformers of the reference):
  PYTHONPATH=src python scripts/repro/float32_rounding.py [MODEL_TYPE ...]   (default: zamba inkling2_loop_text bamba)
"""

import sys

import torch
from transformers import AutoModelForCausalLM

from lpf.core.model_specs import ModelRef, load_tokenizer
from lpf.experiments.conformance.grid import write_workload
from lpf.experiments.conformance.tiny import build_tiny
from lpf.zoo.registry import tokenizer_dir

CAST = torch.Tensor.float


def logprobs(model, ids):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    return torch.log_softmax(out, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def first_prompt() -> list[int]:
    import json
    import tempfile
    from pathlib import Path

    tok = load_tokenizer(ModelRef("zoo tokenizer", tokenizer_dir()))
    path = write_workload(Path(tempfile.mkdtemp()) / "w.jsonl", 16, len(tok), bos=tok.bos_token_id)
    return json.loads(path.read_text().splitlines()[0])["prompt_token_ids"]


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    ids = first_prompt()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; {len(ids)} prompt tokens")
    for model_type in sys.argv[1:] or ["zamba", "inkling2_loop_text", "bamba"]:
        d = build_tiny(model_type)
        try:  # torch's grouped_mm (MoE experts) has no float64: run them eagerly, as the reference column does
            m64 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, experts_implementation="eager").eval()
        except Exception:  # noqa: BLE001 - a model without experts takes no such choice
            m64 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
        gold = logprobs(m64, ids)
        f32 = logprobs(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), ids)
        torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else CAST(t, *a, **k)
        try:
            pure = f"{(gold - logprobs(m64, ids)).abs().max():.2e}"
        except RuntimeError as e:  # a model that mixes dtypes needs its casts (Inkling2Loop's attention)
            pure = f"not measurable ({str(e)[:40]})"
        finally:
            torch.Tensor.float = CAST
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in m64.parameters():
                p.mul_(1 + torch.randn(p.shape, generator=gen, dtype=p.dtype) * 2**-24)
        noisy = logprobs(m64, ids)
        print(
            f"{model_type}: float32 vs gold {(f32 - gold).abs().max():.2e}; float64 with weights x (1 + 2^-24 noise) "
            f"vs gold {(noisy - gold).abs().max():.2e}; gold vs float64 without its .float() casts "
            f"{pure}"
        )
