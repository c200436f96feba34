"""Resolve a model spec to a local Hugging Face directory; build the embedded tiny models.

Specs: a directory with `config.json`; `zoo:NAME` (a trained checkpoint shipped in the package);
`tiny:hybrid` / `tiny:llama` / `tiny:jamba` / `tiny:qwen35` / `tiny:kimi-linear` and the drill variants `tiny:jamba-longmem` /
`tiny:hybrid-longmem` / `tiny:qwen35-longmem` (random models built deterministically from a config on first use and cached
under `$LPF_CACHE`, default `~/.cache/lpf`). Nothing is ever downloaded. Resolution never imports
torch unless a tiny model has to be built.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from lpf.core.errors import LpfError, did_you_mean

DEFAULT_MODEL = "zoo:hybrid"

# Init range 0.25 (not the usual 0.02) so a random model's next-token distributions are peaked
# rather than flat: flat distributions hide confident gibberish.
_TINY_INIT_RANGE = 0.25


def _tiny_configs(vocab_size: int, special: dict) -> dict[str, dict]:
    common = dict(
        vocab_size=vocab_size,
        initializer_range=_TINY_INIT_RANGE,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **special,
    )
    return {
        # The zoo's hybrid shape: mamba/attention/mamba/mamba/attention, attention head_dim 32
        # (vLLM's CPU attention needs >= 32), Mamba2 8 heads x 32.
        "hybrid": dict(
            model_type="granitemoehybrid",
            hidden_size=128,
            num_hidden_layers=5,
            layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=256,
            shared_intermediate_size=256,
            num_local_experts=0,
            num_experts_per_tok=0,
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
            **common,
        ),
        "llama": dict(
            model_type="llama",
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=256,
            **common,
        ),
        # Qwen3.5's shape: Gated DeltaNet : gated full attention 3:1 (linear, linear, linear, full),
        # 2 key heads serving 4 value heads (GQA-style value heads), head dims 32, partial RoPE (1/4).
        "qwen35": dict(
            model_type="qwen3_5_text",
            hidden_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            **common,
        ),
        # Kimi Linear's KDA layer under audit: every layer Kimi Delta Attention (per-channel decay) with a
        # dense MLP (the built-in engine has no MLA or MoE for it), 4 heads of 32.
        "kimi-linear": dict(
            model_type="kimi_linear",
            hidden_size=128,
            num_hidden_layers=3,
            layer_types=["linear_attention"] * 3,
            mlp_layer_types=["dense"] * 3,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=256,
            linear_attn_config={"head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4},
            **common,
        ),
        # The seed's architecture: Mamba1 + attention + MoE (attention and experts on odd layers).
        "jamba": dict(
            model_type="jamba",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            use_mamba_kernels=False,
            **common,
        ),
    }


# Variants: a base config plus an edit of the random weights, for the drills where a mechanism has
# to bite. `jamba-longmem` is tiny:jamba with slow SSM decay (every Mamba layer's A = -0.002: the
# state keeps ~93% of itself over a 50-token prompt, where tiny:jamba's A = -1..-16 forgets a stale
# state within a few tokens) and a 4x LM head (a random model's next-token distributions are
# flat-ish; confident gibberish needs a confident engine). The seed's stale-state and offset bugs
# showed where the state carries long memory; this is the smallest model where they do.
# `hybrid-longmem` is the same edit of tiny:hybrid (Mamba2 + attention, head_dim 32): the Mamba2
# counterpart that vLLM's CPU build runs (it has no Mamba1 path), for the drills on real vLLM.
# `qwen35-longmem` is the same edit of tiny:qwen35's Gated DeltaNet layers (g = -A softplus(a + dt_bias)
# with A = 0.002: the delta-rule memory barely decays), for the recurrent-state drills on GDN.
_LONGMEM_A = 0.002
_LONGMEM_HEAD_SCALE = 4.0
TINY_VARIANTS = {"jamba-longmem": "jamba", "hybrid-longmem": "hybrid", "qwen35-longmem": "qwen35"}
TINY_MODELS = ("hybrid", "llama", "jamba", "qwen35", "kimi-linear", *TINY_VARIANTS)


def _edit_variant(name: str, model) -> None:
    import math

    import torch

    with torch.no_grad():
        if name in ("jamba-longmem", "hybrid-longmem", "qwen35-longmem"):  # the decay: mamba.A_log, linear_attn.A_log
            for pname, param in model.named_parameters():
                if pname.endswith(("mamba.A_log", "linear_attn.A_log")):
                    param.fill_(math.log(_LONGMEM_A))
                elif pname == "lm_head.weight":
                    param.mul_(_LONGMEM_HEAD_SCALE)


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: what the user typed and the directory it names."""

    spec: str
    path: Path

    def describe(self) -> dict:
        return {"spec": self.spec, "path": str(self.path), "weights_sha256": weights_sha256(self.path)}


def cache_root() -> Path:
    return Path(os.environ.get("LPF_CACHE", Path.home() / ".cache" / "lpf"))


def resolve_model(spec: str) -> ModelRef:
    """Map a spec to a local HF directory, building a tiny model if needed. Raises LpfError."""
    if spec.startswith("zoo:"):
        from lpf.zoo import registry

        return ModelRef(spec, registry.model_dir(spec[4:]))
    if spec.startswith("tiny:"):
        return ModelRef(spec, _build_tiny(spec[5:]))
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        hint = " (zoo models are named zoo:NAME; see `lpf zoo list`)" if "/" not in spec and not path.exists() else ""
        raise LpfError(f"model {spec!r} is not a directory with a config.json{hint}")
    return ModelRef(spec, path.resolve())


def weights_sha256(path: Path) -> str | None:
    """sha256 over the weight files in name order, so a changed checkpoint cannot pass as the same run."""
    files = sorted(list(path.glob("*.safetensors")) + list(path.glob("*.bin")))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def load_tokenizer(model: ModelRef):
    """The model directory's HF tokenizer, offline. Raises LpfError when there is none."""
    from transformers import AutoTokenizer

    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(model.path)
    except (OSError, ValueError) as e:
        raise LpfError(f"model {model.spec}: no usable tokenizer ({str(e).splitlines()[0]})") from None


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map (added tokens included): equal iff ids mean the same strings."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _build_tiny(name: str) -> Path:
    if name not in TINY_MODELS:
        raise LpfError(
            f"unknown tiny model {name!r}{did_you_mean(name, TINY_MODELS)}; choose from {', '.join(TINY_MODELS)}"
        )
    from lpf.zoo.registry import tokenizer_dir

    tok_dir = tokenizer_dir()
    tok_hash = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()[:12]
    tok = load_tokenizer(ModelRef(f"tiny:{name}", tok_dir))
    special = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    base = TINY_VARIANTS.get(name, name)
    cfg = _tiny_configs(len(tok), special)[base]
    # a variant's name joins the key (a base model's key, and so its cache dir, stays as it was)
    key = hashlib.sha256(
        json.dumps([cfg, tok_hash] + ([name] if base != name else []), sort_keys=True).encode()
    ).hexdigest()[:12]
    out = cache_root() / "tiny" / f"{name}-{key}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    cfg = dict(cfg)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if base != name:
        _edit_variant(name, model)
    return save_model_dir(model, tok, special, out)


def save_model_dir(model, tok, special: dict, out: Path) -> Path:
    """Write model, tokenizer and a generation config with `special`'s ids to `out`, built in a temp
    dir and renamed so a concurrent or killed build never leaves half a model."""
    from transformers import GenerationConfig

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    GenerationConfig(**special).save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process won the race: theirs is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
