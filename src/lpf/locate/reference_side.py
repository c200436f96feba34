"""The reference, and the reference on trial, over one request's tokens (transformers on the CPU).

Contract: `reference_side(path, ids, prompt_len, state_after, trials=True) -> ReferenceSide` runs
`hf_capture.HFCapture` over the token ids `ids` (prompt + outputs up to the located row) of the HF
directory `path`:
- `tf`: the float32 teacher-forced pass (the reference the run was scored against), plus the
  model's own Mamba states after each position in `state_after` (where the engine's steps start and
  end), from prefix passes;
- `gold`: the same in float64 (the gold: float32 rounding is measured against it);
- `decode`: the float32 decode path: the prompt in one pass with the cache, then one token at a time
  (what `generate` computes), states before and after each decode step;
- `eager`: the float32 teacher-forced pass with the eager attention implementation, when the model
  has attention and its default is another one (sdpa): attention implementations against each other.
The trials (`gold` is always run: it sets the floors; `decode`, `eager` only with `trials`) cost a
few passes of a tiny model. `geometry` is each attention layer's (heads, kv heads, head size, scale).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ReferenceSide:
    tf: object
    gold: object
    decode: object | None = None
    eager: object | None = None
    geometry: dict = field(default_factory=dict)
    description: dict = field(default_factory=dict)
    seconds: float = 0.0


def _load(path, dtype, attn: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    kwargs = {"dtype": getattr(torch, dtype)}
    if attn:
        kwargs["attn_implementation"] = attn
    if dtype == "float64":  # the grouped-matmul MoE kernels take no float64: the plain loop over experts
        try:
            return AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kwargs).eval()
        except (TypeError, ValueError):
            pass
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def reference_side(
    path, ids: list[int], prompt_len: int, state_after: list[int], trials: bool = True, on_stage=None
) -> ReferenceSide:
    import transformers

    from lpf.locate.hf_capture import HFCapture

    t0 = time.monotonic()
    stage = on_stage or (lambda _name: None)
    stage("reference: teacher-forced (float32)")
    ref = _load(path, "float32")
    cap = HFCapture(ref, "reference", "float32")
    tf = cap.teacher_forced(ids)
    cap.states(ids, state_after, into=tf)
    impl = getattr(ref.config, "_attn_implementation", None)
    stage("reference: float64 gold")
    gold_cap = HFCapture(_load(path, "float64"), "gold", "float64")
    gold = gold_cap.teacher_forced(ids)
    gold_cap.states(ids, state_after, into=gold)
    side = ReferenceSide(
        tf,
        gold,
        geometry=dict(cap.geometry),
        description={
            "path": str(path),
            "implementation": f"transformers {transformers.__version__}",
            "attention": impl,
            "architecture": type(ref).__name__,
        },
    )
    if trials:
        stage("reference: its decode path")
        side.decode = HFCapture(ref, "decode_path", "float32").decode_path(ids, min(prompt_len, len(ids)))
        if cap.geometry and impl not in (None, "eager"):
            stage("reference: eager attention")
            side.eager = HFCapture(_load(path, "float32", "eager"), "eager_attention", "float32").teacher_forced(ids)
            side.description["attention_trial"] = f"{impl} against eager"
    side.seconds = time.monotonic() - t0
    return side
