"""Shared by the reproducers: a tiny random checkpoint of one architecture, built with the transformers
installed beside vLLM (no hub, no tokenizer: the reproducers pass token ids). Run with vLLM's Python."""

import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default reserves most of the memory


def build(model_type: str, **fields) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tempfile.mkdtemp(prefix=f"repro-{model_type}-")
    config = AutoConfig.for_model(
        model_type, vocab_size=512, initializer_range=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def prompt(n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def versions() -> str:
    import transformers
    import vllm

    return f"vllm {vllm.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}"
