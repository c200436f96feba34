"""vLLM's module names mapped to `lpf locate`'s ops, for every architecture the conformance matrix runs.

Contract: `capture_spec(request_id, upto, out_dir) -> dict` is the spec lpf-vllm-trace's capture reads
(`plugins/vllm-trace/lpf_vllm_trace/capture.py` documents it): the decoder-layer pattern and, per
module path inside a layer, the op it yields, named as the reference side names it
(`hf_capture.RULES`, `ops.NAMES`). Paths are vLLM 0.32's (`vllm/model_executor/models/*.py`):
- the decoder layers are `model.layers.{i}` (`backbone.layers.{i}` for Mamba2ForCausalLM); a layer
  returns (hidden, residual) whose sum is the residual stream HF's layer returns (`sum`), except
  where `LAYER_OUT` says the first element already is the stream;
- norms: `input_layernorm` / `operator_norm` (Lfm2), `post_attention_layernorm` / `pre_ff_layernorm` /
  `ffn_norm`; a fused norm returns (normed, residual): its first element;
- Mamba2 (`MambaMixer2`: FalconH1, GraniteMoeHybrid, Mamba2, Zamba2): `in_proj`, `norm` (gated),
  `out_proj`, and the kernels the plugin wraps (conv, dt, scan output, states); FalconH1 nests it as
  `mamba.mamba`, Zamba2's hybrid layers as `mamba_decoder.mamba`; Lfm2's `short_conv`: in/out projections;
- attention: the `Attention` module (`self_attn.attn`; Zamba2's `shared_transformer.self_attn.dpa_list.{k}`)
  takes q, k, v after every norm and rotary, so its inputs are q / k / v and its output `attn_out`;
  `o_proj` (`out_proj` in Lfm2);
- feed-forward: `feed_forward` / `mlp` / `shared_mlp` / `block_sparse_moe` (an MoE when it has a
  `gate` or `experts`: `moe`, else `mlp`), the router `gate`;
- Zamba2's shared transformer block is prefixed `shared.` (it runs inside layer i like HF's), its
  per-layer adapter `linear`; embeddings and the final norm (`norm`, `final_layernorm`, Lfm2's
  `embedding_norm`, `backbone.norm_f`) are global.
An op a side does not have is simply not aligned; a module this table misses shows as a missing op,
never as a departure.
"""

from __future__ import annotations

LAYER = r"(?:model|backbone)\.layers\.(\d+)"
IN_LAYER = r"(?:model|backbone)\.layers\.\d+\."
# (path inside a layer or its sub-block, op, what); "ffn": moe or mlp, decided by the module's children
INNER = [
    (r"(?:input_layernorm|operator_norm|norm)", "norm", "out"),
    (r"(?:post_attention_layernorm|pre_ff_layernorm|ffn_norm)", "ffn_norm", "out"),
    (r"(?:mamba\.)?(?:mamba|mixer|short_conv)\.in_proj", "in_proj", "out"),
    (r"(?:mamba\.)?(?:mamba|mixer|short_conv)\.out_proj", "out_proj", "out"),
    (r"(?:mamba\.)?(?:mamba|mixer)\.norm", "gate_norm", "out"),
    (r"self_attn\.(?:attn|dpa_list\.\d+)", "", "attn"),
    (r"self_attn\.(?:o_proj|out_proj)", "o_proj", "out"),
    (r"(?:block_sparse_moe|feed_forward|mlp)\.(?:gate|router)", "router", "out"),
    (r"(?:shared_mlp|mlp|feed_forward|block_sparse_moe)", "ffn", "out"),
    (r"linear", "linear", "out"),
]
SUB_BLOCKS = (("", ""), ("shared_transformer\\.", "shared."), ("mamba_decoder\\.", ""))
GLOBAL = [
    (r"(?:model\.(?:embed_tokens|embeddings)|backbone\.embeddings)", "!embed", "out"),
    (r"(?:model\.(?:norm|final_layernorm|embedding_norm)|backbone\.norm_f)", "!final_norm", "out"),
]


def module_rules() -> list[list[str]]:
    """[regex over a full module path, op, what], first match wins."""
    rules = [list(g) for g in GLOBAL]
    for sub_re, sub_op in SUB_BLOCKS:
        for path, op, what in INNER:
            rules.append([IN_LAYER + sub_re + path, sub_op + op, what])
    return rules


# what a decoder layer returns: (hidden, residual) to be added (the default), or the stream first
LAYER_OUT = {"GraniteMoeHybridForCausalLM": "out"}  # vllm/model_executor/models/granitemoehybrid.py: returns
# (residual + mlp * multiplier, residual)


def capture_spec(request_id: str, upto: int, out_dir: str, architecture: str | None = None) -> dict:
    """The capture spec for one request, its positions up to `upto`."""
    return {
        "out": str(out_dir),
        "requests": [request_id],
        "upto": {request_id: int(upto)},
        "layer": LAYER,
        "layer_out": LAYER_OUT.get(architecture or "", "sum"),
        "modules": module_rules(),
        "kernels": True,
    }
