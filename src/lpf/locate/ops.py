"""The operations `lpf locate` aligns, named the same on every side, and one side's captured values.

Contract: an op is `L{i}.{name}` for decoder layer i (the index of the reference's `layers` list), a
`shared.`-prefixed name for a block shared across layers and applied inside layer i (Zamba2's shared
transformer), or one of the global ops `embed`, `final_norm`, `logits`. `NAMES` lists the names and
what each holds; a side that cannot observe an op simply has none of it (the op is then not aligned).
Per-token ops hold one row per token position (the token at that position went through the op);
step-level ops (`STEP_OPS`: a Mamba layer's states) hold a row at a step's first position
(`state_in`: the state the layer started the step from) or last position (`state_out`: the state
it ended the step with), so they are compared only where the engine's steps begin and end.

`Activations` (numpy only, no torch): `put(op, position, values)` keeps one float64 vector per (op,
position), the last write winning (a recompute after preemption is what the engine's outputs came
from); `order` is the order ops were first seen, which for a forward pass is execution order.
`merged_order(primary, other)` interleaves two sides' orders (ops only one side has go after their
predecessor on that side).
"""

from __future__ import annotations

import numpy as np

NAMES = {
    "embed": "token embeddings",
    "norm": "the layer's input norm (what the mixer reads)",
    "in_proj": "the Mamba / short-conv input projection (Gated DeltaNet: its q/k/v projection)",
    "conv": "the causal conv's output (activated where the architecture activates it)",
    "conv_state_in": "the conv state a step started from (the last d_conv - 1 conv inputs)",
    "state_in": "the SSM state a step started from (zero for a request's first token; Gated DeltaNet: the "
    "delta-rule memory [heads, d_k, d_v])",
    "dt": "the SSM step size as the scan used it (softplus(dt + dt_bias), clamped where the path clamps)",
    "g": "Gated DeltaNet's decay gate, g = -exp(A_log) softplus(a + dt_bias) (the state decays by exp(g))",
    "beta": "Gated DeltaNet's write strength, sigmoid(b) (how much of the delta the state takes in)",
    "ssm_out": "the scan's output (Mamba2: y + D x before the gated norm; Mamba1: gated by z; Gated DeltaNet: "
    "the delta rule's q^T S before its output gate)",
    "conv_state_out": "the conv state a step ended with",
    "state_out": "the SSM state a step ended with (what it writes for the next step)",
    "gate_norm": "Mamba2's gated RMS norm output (Gated DeltaNet: its output gate, RMS norm times SiLU(z))",
    "out_proj": "the Mamba / short-conv output projection",
    "q": "attention queries as attention reads them (after any q norm and rotary)",
    "k": "attention keys as attention reads them (after any k norm and rotary)",
    "v": "attention values",
    "scores": "attention weights of this query over its context (derived from q and k, both sides alike)",
    "attn_out": "attention output before the output projection",
    "o_proj": "the attention output projection",
    "ffn_norm": "the norm before the feed-forward block",
    "router": "MoE router logits",
    "moe": "the sparse MoE block's output",
    "mlp": "the dense (or shared) MLP's output",
    "out": "the layer's output (the residual stream after it)",
    "final_norm": "the final norm (the LM head's input)",
    "logits": "the LM head's logits",
}
# the same, short enough for a sentence
SHORT = {
    "embed": "the embeddings",
    "norm": "the input norm",
    "in_proj": "the input projection",
    "conv": "the conv output",
    "conv_state_in": "the conv state in",
    "state_in": "the SSM state in",
    "dt": "the SSM step size dt",
    "g": "the decay gate g",
    "beta": "the write strength beta",
    "ssm_out": "the scan output",
    "conv_state_out": "the conv state out",
    "state_out": "the SSM state out",
    "gate_norm": "the gated norm",
    "out_proj": "the output projection",
    "q": "q after rotary",
    "k": "k after rotary",
    "v": "v",
    "scores": "the attention weights",
    "attn_out": "the attention output",
    "o_proj": "the attention output projection",
    "ffn_norm": "the FFN norm",
    "router": "the MoE router logits",
    "moe": "the MoE output",
    "mlp": "the MLP output",
    "out": "the layer output",
    "final_norm": "the final norm",
    "logits": "the logits",
    "linear": "the shared block's adapter",
}
STEP_OPS = ("conv_state_in", "state_in", "conv_state_out", "state_out")
GLOBAL_OPS = ("embed", "final_norm", "logits")


def op_name(layer: int | None, name: str, prefix: str = "") -> str:
    return name if layer is None else f"L{layer}.{prefix}{name}"


def split_op(op: str) -> tuple[int | None, str]:
    """(layer, name without the layer) of an op: `L3.shared.q` -> (3, "shared.q")."""
    if op.startswith("L") and "." in op:
        head, _, rest = op.partition(".")
        if head[1:].isdigit():
            return int(head[1:]), rest
    return None, op


def base_name(op: str) -> str:
    """The op's name in `NAMES`: `L3.shared.q` -> "q"."""
    return split_op(op)[1].rpartition(".")[2]


def is_step_op(op: str) -> bool:
    return base_name(op) in STEP_OPS


class Activations:
    """One side's captured values: op -> {position: float64 vector}."""

    def __init__(self, side: str, dtype: str):
        self.side = side
        self.dtype = dtype
        self.data: dict[str, dict[int, np.ndarray]] = {}
        self.order: list[str] = []

    def put(self, op: str, position: int, values) -> None:
        if op not in self.data:
            self.data[op] = {}
            self.order.append(op)
        self.data[op][int(position)] = np.asarray(values, dtype=np.float64).ravel()

    def place_after(self, op: str, after: str) -> None:
        """Move `op` right after `after` in `order` (a derived op belongs where its inputs are)."""
        if op in self.order and after in self.order:
            self.order.remove(op)
            self.order.insert(self.order.index(after) + 1, op)

    def get(self, op: str) -> dict[int, np.ndarray]:
        return self.data.get(op, {})

    def positions(self, op: str) -> list[int]:
        return sorted(self.data.get(op, {}))

    def __contains__(self, op: str) -> bool:
        return op in self.data


def merged_order(primary: list[str], other: list[str]) -> list[str]:
    """`primary` with the ops only `other` has inserted right after their predecessor in `other`."""
    out = list(primary)
    seen = set(out)
    for i, op in enumerate(other):
        if op in seen:
            continue
        at = len(out)
        for prev in reversed(other[:i]):
            if prev in seen:
                at = out.index(prev) + 1
                break
        else:
            at = 0
        out.insert(at, op)
        seen.add(op)
    return out
