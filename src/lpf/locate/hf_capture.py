"""The reference's side of `lpf locate`: a transformers model's activations for one token sequence.

Contract: `HFCapture(model)` observes a loaded `AutoModelForCausalLM` (batch of one) without copying
any of its code:
- module hooks (`RULES`: a module's path inside a decoder layer -> the op it yields; the layer's own
  output is `out`), with a pre-hook on every decoder layer so that whatever fires inside it is
  attributed to that layer, and on a shared block (Zamba2's `shared_transformer`) to `shared.`;
- the modeling module's own kernel functions wrapped while a pass runs (`WRAPPED`: the causal conv,
  the Mamba2 chunk scan and its one-token update, the Mamba1 selective scan and its update, the
  gated delta rule's chunked and recurrent forms (Qwen3.5, Qwen3-Next: its gates g and beta and its
  output), the eager attention function; plain functions, or the nn.Modules transformers >= 5.25 makes of them
  with the `kernels` package, their arguments named by the module's `forward`) and the attention
  function the model's implementation dispatches to
  (`ALL_ATTENTION_FUNCTIONS[impl]`, sdpa), each calling the original and recording what it was
  given and returned: q, k and v exactly as attention reads them (after any q/k norm, adapter and
  rotary; k and v of the current tokens), its output, and each attention layer's geometry (heads,
  kv heads, head size, the scale it was called with). Where an op is not a tensor the function returns, it is recomputed from the function's
  own arguments by the function's own contract: the step size `dt` is `softplus(dt + dt_bias)` (when
  the call says softplus) clamped to the call's `dt_limit` (the Mamba2 chunk scan; the one-token
  updates take no limit, so their dt is not clamped: exactly what each path computes). A Mamba2
  kernel's output is `ssm_out` only when it was called without a gate `z` (FalconH1's decode step
  gates inside the kernel, its prefill after it); Mamba1's kernels are always called with z;
- Mamba and Gated DeltaNet states read from the model's own cache (`cache.get_conv_state` / `get_recurrent_state`,
  the conv state cut to its last d_conv - 1 columns, the engines' layout).
Drivers: `teacher_forced(ids)` (one pass, no cache: every per-token op at positions 0..N-1),
`states(ids, after)` (for each position b in `after`, a pass over ids[:b+1] with a cache: the state
after b, recorded as `state_out` at b and `state_in` at b + 1; `state_in` at 0 is zero), and
`decode_path(ids, prompt_len)` (the prompt in one pass with a cache, then one token at a time with
it, as `generate` runs: per-token ops of every position, and each decode step's states before and
after). Each returns an `ops.Activations`. `geometry` gives each attention layer's heads, kv heads,
head size and scale (for the derived attention scores). Hooks and patches are removed when a
driver returns, whatever happens.
"""

from __future__ import annotations

import inspect
import re
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from lpf.locate.ops import Activations, op_name

OUT, IN0 = "out", "in0"
# path inside a decoder layer (fullmatch) -> [(op, what)]; first match wins
RULES: list[tuple[str, list[tuple[str, str]]]] = [
    (r"(input_layernorm|operator_norm|norm)", [("norm", OUT)]),
    (r"(post_attention_layernorm|pre_ff_layernorm|ffn_norm)", [("ffn_norm", OUT)]),
    (r"(mamba|mixer|conv)\.in_proj|linear_attn\.in_proj_qkv", [("in_proj", OUT)]),
    (r"(mamba|mixer|conv|linear_attn)\.out_proj", [("out_proj", OUT)]),
    (r"(mamba|mixer|linear_attn)\.norm", [("gate_norm", OUT)]),  # Gated DeltaNet: its output gate
    (r"self_attn\.(o_proj|out_proj)", [("o_proj", OUT)]),
    (r"(feed_forward|block_sparse_moe)\.(router|gate)", [("router", OUT)]),
    (r"(shared_mlp|mlp|feed_forward|block_sparse_moe)", [("ffn", OUT)]),  # moe or mlp: decided by its children
    (r"linear", [("linear", OUT)]),  # Zamba2's per-layer adapter of the shared block's output
]
# sub-blocks whose ops get their own prefix inside a layer (their module names repeat the layer's)
SUB_BLOCKS = {"shared_transformer": "shared.", "mamba_decoder": ""}
GLOBAL_RULES = [
    (r"(model\.)?(embed_tokens|embeddings)|backbone\.embeddings", "embed"),
    (r"model\.(norm|final_layernorm|embedding_norm)|backbone\.norm_f", "final_norm"),
]
_HERE = object()  # "the decoder layer running now"
WRAPPED = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba2_chunk_scan",
    "mamba2_selective_state_update",
    "mamba_selective_scan",
    "mamba_selective_state_update",
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "eager_attention_forward",
)
GDN_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """(path prefix, the ModuleList of decoder layers): the longest list named `layers`."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.rpartition(".")[2] == "layers":
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError(f"{type(model).__name__}: no decoder layer list found")
    return best[0] + ".", best[1]


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """A [1, n, ...] or [n, ...] tensor as [n, features]."""
    if t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == n:
        t = t[0]
    return t.reshape(n, -1)


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class _Globals:
    """A module's namespace through its functions' globals, read and written as the module's attributes."""

    def __init__(self, ns: dict):
        object.__setattr__(self, "_ns", ns)

    def __getattr__(self, name):
        try:
            return self._ns[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self._ns[name] = value


def _namespace(cls):
    """Where the model's modeling code looks its kernels up: its module, or, when that module is no longer in
    sys.modules (a full suite run once lost transformers' modeling_jamba there, cause not found), the globals
    its forward runs with, which are that module's namespace all the same."""
    module = sys.modules.get(cls.__module__)
    return module if module is not None else _Globals(inspect.unwrap(cls.forward).__globals__)


class HFCapture:
    def __init__(self, model, side: str = "reference", dtype: str = "float32"):
        self.model = model
        self.side, self.dtype = side, dtype
        self.module = _namespace(type(model))
        self.prefix, self.layers = decoder_layers(model)
        self.acts: Activations | None = None
        self.layer: int | None = None
        self.sub = ""
        self.offset = 0  # absolute position of the current pass's first token
        self.length = 0  # tokens in the current pass
        self.per_token = True  # record per-token ops (off for the state-only passes)
        self.geometry: dict[int, tuple[int, int, int, float]] = {}
        self.mamba_layers = [i for i, layer in enumerate(self.layers) if self._mixer(layer) is not None]

    # -- what each module yields ---------------------------------------------------------------
    @staticmethod
    def _mixer(layer):
        for name in ("mamba", "mixer", "linear_attn"):
            m = getattr(layer, name, None)
            if m is not None:
                return m
        dec = getattr(layer, "mamba_decoder", None)
        return getattr(dec, "mamba", None) if dec is not None else None

    def _plan(self) -> list[tuple[torch.nn.Module, str, int | None, str, list[tuple[str, str]]]]:
        """(module, kind, layer, sub-block prefix, [(op, what)]) for every observed module: kind
        "layer" (a decoder layer: `out`, and whatever runs inside it is attributed to it), "inner"
        (attributed to the layer running it: a shared block runs inside several) or "global"."""
        plan, seen = [], set()
        for name, mod in self.model.named_modules(remove_duplicate=False):
            if not name.startswith(self.prefix):
                for pat, op in GLOBAL_RULES:
                    if re.fullmatch(pat, name):
                        plan.append((mod, "global", None, "", [(op, OUT)]))
                continue
            idx, _, rel = name[len(self.prefix) :].partition(".")
            if not idx.isdigit():
                continue
            if not rel:
                plan.append((mod, "layer", int(idx), "", [("out", OUT)]))
                continue
            if id(mod) in seen:  # a shared block's modules: hooked once, attributed where they run
                continue
            head, _, rest = rel.partition(".")
            sub = ""
            if head in SUB_BLOCKS and rest:
                sub, rel = SUB_BLOCKS[head], rest
            for pat, ops in RULES:
                if re.fullmatch(pat, rel):
                    if ops[0][0] == "ffn":
                        kids = {n for n, _ in mod.named_children()}
                        ops = [("moe" if kids & {"router", "gate", "experts"} else "mlp", OUT)]
                    plan.append((mod, "inner", None, sub, ops))
                    seen.add(id(mod))
                    break
        return plan

    # -- recording ---------------------------------------------------------------------------------
    def _put(self, name: str, rows: torch.Tensor, layer=_HERE, sub=None) -> None:
        """rows [n, ...] for the last n positions of the current pass; `layer` None: a global op,
        `_HERE`: the decoder layer running now."""
        if self.acts is None or not self.per_token:
            return
        layer = self.layer if layer is _HERE else layer
        sub = self.sub if sub is None else sub
        n = rows.shape[0]
        op = op_name(layer, name, sub if layer is not None else "")
        first = self.offset + self.length - n
        vals = rows.detach().to(torch.float64).cpu().reshape(n, -1).numpy()
        for i in range(n):
            self.acts.put(op, first + i, vals[i])

    def _hook(self, kind, layer, sub, ops):
        where = {"layer": layer, "inner": _HERE, "global": None}[kind]

        def pre(_mod, args, kwargs):
            if kind == "layer":  # a decoder layer starts: what runs inside it is its own
                self.layer, self.sub = layer, ""
            for op, what in ops:
                if what == IN0:
                    x = args[0] if args else next(iter(kwargs.values()))
                    self._put(op, _rows(x, self.length), where, sub)

        def post(_mod, _args, _kwargs, output):
            for op, what in ops:
                if what == OUT:
                    self._put(op, _rows(_first(output), self.length), where, sub)

        return pre, post

    @contextmanager
    def _installed(self):
        handles, patched = [], []
        try:
            for mod, kind, layer, sub, ops in self._plan():
                pre, post = self._hook(kind, layer, sub, ops)
                handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(mod.register_forward_hook(post, with_kwargs=True))
            shared = {id(m): m for m in (getattr(layer, "shared_transformer", None) for layer in self.layers) if m}
            for mod in shared.values():  # the kernels a shared block calls are its own, in the layer running it
                handles.append(mod.register_forward_pre_hook(lambda *_a: setattr(self, "sub", "shared.")))
                handles.append(mod.register_forward_hook(lambda *_a: setattr(self, "sub", "")))
            for name in WRAPPED:
                fn = getattr(self.module, name, None)
                if fn is not None:
                    setattr(self.module, name, self._wrap(name, fn))
                    patched.append((name, fn))
            registry, impl = self._attention_registry()
            if registry is not None:
                registry[impl] = self._wrap("eager_attention_forward", registry[impl])
            yield
        finally:
            for h in handles:
                h.remove()
            for name, fn in patched:
                setattr(self.module, name, fn)
            if registry is not None:
                del registry[impl]  # drops the local override: the shared mapping is what remains
            self.layer, self.sub = None, ""

    def _attention_registry(self):
        """(ALL_ATTENTION_FUNCTIONS, the implementation's key) when the model dispatches attention to a
        registered function (sdpa) rather than its module's eager one; else (None, None)."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        registry = getattr(self.module, "ALL_ATTENTION_FUNCTIONS", None)
        if registry is None or impl in (None, "eager") or impl not in registry:
            return None, None
        try:
            if impl in registry._local_mapping:  # already overridden by someone: leave it alone
                return None, None
        except AttributeError:
            return None, None
        return registry, impl

    def _wrap(self, name: str, fn):
        # transformers >= 5.25 with the `kernels` package turns these functions into nn.Modules whose
        # __call__ takes (*args, **kwargs): the arguments are named by the module's forward
        sig = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)

        def wrapper(*args, **kwargs):
            a = sig.bind_partial(*args, **kwargs).arguments
            state_before = None
            if name.endswith("state_update") and "state" in a:
                state_before = a["state"].detach().clone()
            out = fn(*args, **kwargs)
            try:
                self._observe(name, a, out, state_before)
            except Exception:  # noqa: BLE001 - an observation that does not fit is lost, never the pass
                pass
            return out

        return wrapper

    def _observe(self, name: str, a: dict, out, state_before) -> None:
        n = self.length
        if name == "causal_conv1d_fn":
            self._put("conv", out[0, :, -n:].t())
        elif name == "causal_conv1d_update":
            self._put("conv", out[0].t()[-1:])
        elif name == "eager_attention_forward":
            q, k, v = a["query"], a["key"], a["value"]  # [1, heads, tokens, head size]; k/v: past + current
            t = q.shape[2]
            self._put("q", q[0].transpose(0, 1).reshape(t, -1))
            self._put("k", k[0, :, -t:].transpose(0, 1).reshape(t, -1))
            self._put("v", v[0, :, -t:].transpose(0, 1).reshape(t, -1))
            self._put("attn_out", _first(out)[0].reshape(t, -1))
            scale = a.get("scaling")
            self.geometry[self.layer] = (
                q.shape[1],
                k.shape[1],
                q.shape[-1],
                float(scale if scale is not None else q.shape[-1] ** -0.5),
            )
        elif name == "mamba2_chunk_scan":
            dt = _softplus_dt(a["dt"], a.get("dt_bias"), a.get("dt_softplus", False))
            lo, hi = a.get("dt_limit", (0.0, float("inf")))
            self._put("dt", torch.clamp(dt, min=lo, max=hi)[0])
            y = _first(out)
            if a.get("z") is None:  # ssm_out is the scan's output before any gating by z
                self._put("ssm_out", y[0].reshape(y.shape[1], -1))
        elif name == "mamba2_selective_state_update":
            dt = _softplus_dt(a["dt"], a.get("dt_bias"), a.get("dt_softplus", False))
            self._put("dt", dt[..., 0].reshape(1, -1))
            if a.get("z") is None:  # FalconH1's decode step gates inside the kernel, its prefill after it
                self._put("ssm_out", out.reshape(1, -1))
        elif name in GDN_RULES:  # [1, tokens, heads(, d)]: the gates as the rule reads them, its output q^T S
            t = a["g"].shape[1]
            self._put("g", a["g"][0].reshape(t, -1))
            self._put("beta", a["beta"][0].reshape(t, -1))
            self._put("ssm_out", _first(out)[0].reshape(t, -1))
        elif name == "mamba_selective_scan":
            bias = a.get("delta_bias")
            dt = _softplus_dt(a["dt"], None if bias is None else bias[..., None], a.get("delta_softplus", False))
            self._put("dt", dt[0].t())
            self._put("ssm_out", _first(out)[0].t())
        elif name == "mamba_selective_state_update":
            dt = _softplus_dt(a["dt"], a.get("dt_bias"), a.get("dt_softplus", False))
            self._put("dt", dt.reshape(1, -1))
            self._put("ssm_out", out.reshape(1, -1))

    # -- states from the model's own cache ------------------------------------------------------
    def _cache_states(self, cache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for i in self.mamba_layers:
            try:
                conv, ssm = cache.get_conv_state(i, state_idx=0), cache.get_recurrent_state(i, state_idx=0)
            except (ValueError, IndexError, AttributeError):
                continue
            if conv is None or ssm is None:
                continue
            out[i] = (conv[0, :, 1:].detach().to(torch.float64).clone(), ssm[0].detach().to(torch.float64).clone())
        return out

    def _put_states(self, states: dict, when: str, position: int) -> None:
        for i, (conv, ssm) in states.items():
            self.acts.put(op_name(i, f"conv_state_{when}"), position, conv.cpu().numpy())
            self.acts.put(op_name(i, f"state_{when}"), position, ssm.cpu().numpy())

    # -- drivers -----------------------------------------------------------------------------------
    def _forward(self, ids: list[int], offset: int, cache=None, use_cache: bool = False):
        self.offset, self.length = offset, len(ids)
        kwargs = {"use_cache": use_cache}
        if cache is not None:
            kwargs["cache"] = cache
        out = self.model(input_ids=torch.tensor([ids], device=self.model.device), **kwargs)
        return out

    @torch.inference_mode()
    def teacher_forced(self, ids: list[int], logits: bool = True) -> Activations:
        self.acts = Activations(self.side, self.dtype)
        with self._installed():
            out = self._forward(ids, 0)
        if logits:
            lg = out.logits[0].detach().to(torch.float64).cpu().numpy()
            for p in range(len(ids)):
                self.acts.put("logits", p, lg[p])
        return self.acts

    @torch.inference_mode()
    def states(self, ids: list[int], after: list[int], into: Activations | None = None) -> Activations:
        """The model's own state after each position in `after` (prefix passes from scratch)."""
        self.acts = into if into is not None else Activations(self.side, self.dtype)
        self.per_token = False
        zero = None
        try:
            with self._installed():
                for b in sorted(set(after)):
                    if b < 0 or b >= len(ids):
                        continue
                    out = self._forward(ids[: b + 1], 0, use_cache=True)
                    st = self._cache_states(out.cache)
                    self._put_states(st, "out", b)
                    if b + 1 < len(ids):
                        self._put_states(st, "in", b + 1)
                    zero = zero or {i: (torch.zeros_like(c), torch.zeros_like(s)) for i, (c, s) in st.items()}
            if zero is not None:
                self._put_states(zero, "in", 0)
        finally:
            self.per_token = True
        return self.acts

    @torch.inference_mode()
    def decode_path(self, ids: list[int], prompt_len: int) -> Activations:
        """The prompt in one pass with a cache, then ids[prompt_len:] one token at a time with it."""
        self.acts = Activations(self.side, self.dtype)
        with self._installed():
            out = self._forward(ids[:prompt_len], 0, use_cache=True)
            cache = out.cache
            logits = list(out.logits[0])
            for t in range(prompt_len, len(ids)):
                self._put_states(self._cache_states(cache), "in", t)
                out = self._forward(ids[t : t + 1], t, cache=cache, use_cache=True)
                cache = out.cache
                self._put_states(self._cache_states(cache), "out", t)
                logits.append(out.logits[0, -1])
        lg = torch.stack(logits).to(torch.float64).cpu().numpy()
        for p in range(len(ids)):
            self.acts.put("logits", p, lg[p])
        return self.acts


def _softplus_dt(dt: torch.Tensor, bias, softplus: bool) -> torch.Tensor:
    if bias is not None:
        dt = dt + bias.to(dt.dtype)
    return F.softplus(dt) if softplus else dt
