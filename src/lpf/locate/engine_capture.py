"""The built-in engine's side of `lpf locate`: one request's activations out of the engine's steps.

Contract: `EngineCapture(model, request_id)` is the `capture` a `ForwardContext` carries
(`lpf.builtin.forward_context`): the engine's layers call `put(module, name, tensor, rows)` through
`probe` for what no module boundary shows (q / k after rotary, v, the attention output, a Mamba
layer's conv output, dt, scan output and its states; a Gated DeltaNet layer's gates g and beta and its
output gate), and `install()` adds forward hooks on the
engine's modules for what a boundary does show (`RULES`: norms, projections, MLP / MoE / router,
each layer's output, embeddings, final norm). Every tensor is a slice of the step's packed batch, of
one request's chunk or of the decode batch (`rows`, see `forward_context`); only the rows of
`request_id` are kept, as float64 vectors in an `ops.Activations` under the same op names the
reference side uses (`ops.NAMES`). The final norm's output of the current step is also kept as the
engine's own tensor (`hidden`: the request's rows; `step_hidden`: the whole batch), so the replay can
project them with the engine's LM head exactly as the runner does.
`install()` returns a handle whose `remove()` takes the hooks off again.
"""

from __future__ import annotations

import re

import torch

from lpf.builtin.forward_context import get_forward_context
from lpf.locate.ops import Activations, is_step_op, op_name

# module path inside layer i (fullmatch) -> op
RULES = [
    (r"input_layernorm", "norm"),
    (r"(post_attention_layernorm|pre_ff_layernorm)", "ffn_norm"),
    (r"(mamba\.in_proj|linear_attn\.in_proj_qkv)", "in_proj"),
    (r"(mamba|linear_attn)\.out_proj", "out_proj"),
    (r"mamba\.norm", "gate_norm"),
    (r"self_attn\.o_proj", "o_proj"),
    (r"(block_sparse_moe\.router\.layer|feed_forward\.router)", "router"),
    (r"(shared_mlp|feed_forward|block_sparse_moe)", "ffn"),
]
GLOBAL = {"model.embed_tokens": "embed", "model.norm": "final_norm", "model.final_layernorm": "final_norm"}


class _Hooks:
    def __init__(self, handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class EngineCapture:
    def __init__(self, model, request_id: str, dtype: str = "float32"):
        self.model = model
        self.request_id = request_id
        self.acts = Activations("engine", dtype)
        self.hidden: tuple[list[int], torch.Tensor] | None = None  # this step's final-norm rows of the request
        self.step_hidden: tuple[list, torch.Tensor] | None = None  # the whole batch's (its seqs, the rows)
        self.layer_of: dict[int, int] = {}  # id(module) -> its decoder layer
        for i, layer in enumerate(model.model.layers):
            for mod in layer.modules():
                self.layer_of.setdefault(id(mod), i)

    def install(self) -> _Hooks:
        handles = []
        for name, mod in self.model.named_modules():
            op = GLOBAL.get(name)
            if op is None and name.startswith("model.layers."):
                idx, _, rel = name[len("model.layers.") :].partition(".")
                if not rel:
                    op = "out"
                for pat, candidate in RULES:
                    if rel and re.fullmatch(pat, rel):
                        op = candidate
                        break
                if op == "ffn":
                    op = "moe" if type(mod).__name__.endswith("MoE") else "mlp"
            if op is not None:
                handles.append(mod.register_forward_hook(self._hook(op)))
        return _Hooks(handles)

    def _hook(self, name: str):
        def post(module, _args, output):
            self.put(module, name, output, get_forward_context().rows)

        return post

    # -- the capture protocol ---------------------------------------------------------------------
    def put(self, module, name: str, tensor, rows) -> None:
        if rows is None:
            rows = get_forward_context().seqs
        if name == "final_norm":
            self.step_hidden = (list(rows), tensor.detach())
        layer = self.layer_of.get(id(module)) if name not in ("embed", "final_norm") else None
        op = op_name(layer, name)
        if is_step_op(name):  # one row per request: the state before its first token or after its last
            for j, s in enumerate(rows):
                if s.request_id == self.request_id:
                    pos = s.num_computed if name.endswith("_in") else s.num_computed + s.num_tokens - 1
                    self.acts.put(op, pos, tensor[j].detach().to(torch.float64).cpu().numpy())
            return
        at = 0
        for s in rows:
            if s.request_id == self.request_id:
                part = tensor[at : at + s.num_tokens].detach()
                positions = list(range(s.num_computed, s.num_computed + s.num_tokens))
                vals = part.to(torch.float64).reshape(s.num_tokens, -1).cpu().numpy()
                for i, p in enumerate(positions):
                    self.acts.put(op, p, vals[i])
                if name == "final_norm":
                    self.hidden = (positions, part.reshape(s.num_tokens, -1))
            at += s.num_tokens
