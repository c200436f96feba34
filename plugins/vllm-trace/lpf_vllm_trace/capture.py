"""Activation capture for `lpf locate`: one request's rows out of vLLM's forward pass, op by op.

Off unless `LPF_VLLM_CAPTURE=SPEC.json` is set (with the trace on). The spec (written by lpf, which
owns the mapping of vLLM's module names to its op names) is
  {"out": DIR, "requests": [ids], "upto": {id: last position}, "layer": REGEX, "layer_out": WHAT,
   "modules": [[REGEX, OP, WHAT], ...], "kernels": true}
`layer` matches a decoder layer's module path (group 1: its index); whatever runs inside it is that
layer's (`L{i}.`), a shared block included; its output is op `out`, read as `layer_out` says. Each `modules` rule hooks the first module path it
fullmatches: WHAT is `out` (the output, or its first element), `sum` (a decoder layer's (hidden,
residual) pair added: the residual stream), `attn` (an Attention module: its q, k, v inputs and its
output). An OP starting with `!` is global (no layer); an OP ending in `ffn` becomes `moe` when the
module has a gate, router or experts, else `mlp`. With `kernels`, vLLM's Mamba2 kernels as the
mixer calls them (`mamba_mixer2`'s `causal_conv1d_fn` / `_update`, `mamba_chunk_scan_combined_varlen`,
`selective_state_update`) are wrapped: the conv output, dt as the kernel takes it
(`softplus(dt + dt_bias)` when it says softplus, clamped to its `dt_limit`; the one-token update
has no limit), the scan output, and the SSM state before and after (`state_in` at a step's first
position, `state_out` at its last).

Rows: at each step, after the batch is reordered and its metadata built, `begin_step` reads the
runner's batch (order, scheduled and computed tokens, the Mamba split: decodes first); a hook then
keeps, of a packed tensor, the rows of the asked requests (a runner id matches an asked id exactly
or with vLLM's `-XXXXXXXX` suffix), as float64, at their absolute positions (<= `upto`). `write()`
saves everything so far to DIR/capture-<pid>.npz and its index DIR/capture-<pid>.json (atomically),
at each flush and at exit. A hook that fails stops the capture with its reason (`why`), never the
engine. It never imports lpf.
"""

from __future__ import annotations

import inspect
import json
import os
import re

KERNELS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba_chunk_scan_combined_varlen", "selective_state_update")
_ACTIVE: dict = {"capture": None}  # the capture the kernel wrappers feed (they are installed once per process)


class Capture:
    def __init__(self, spec: dict):
        self.out = spec["out"]
        self.asked = set(spec.get("requests") or [])
        self.upto = {k: int(v) for k, v in (spec.get("upto") or {}).items()}
        self.layer_re = re.compile(spec.get("layer") or r"(?:model|backbone)\.layers\.(\d+)")
        self.rules = [(re.compile(r), op, what) for r, op, what in spec.get("modules") or []]
        self.kernels = bool(spec.get("kernels", True))
        self.layer_out = spec.get("layer_out") or "sum"
        self.data: dict[str, dict[str, dict[int, object]]] = {}
        self.order: dict[str, list[str]] = {}
        self.layer: int | None = None
        self.rows: list[dict] = []  # this step's asked requests: id, start, n, first position, kernel index
        self.installed = False
        self.why: str | None = None
        self.handles: list = []  # the hooks on the model, removed when the capture is replaced

    # -- setup -------------------------------------------------------------------------------------
    def install(self, model) -> None:
        self.installed = True
        seen = set()
        for name, mod in model.named_modules(remove_duplicate=False):
            m = self.layer_re.fullmatch(name)
            if m:
                idx = int(m.group(1))
                self.handles.append(mod.register_forward_pre_hook(lambda *_a, i=idx: setattr(self, "layer", i)))
                self.handles.append(mod.register_forward_hook(self._hook("out", self.layer_out)))
                continue
            if id(mod) in seen:
                continue
            for rx, op, what in self.rules:
                if rx.fullmatch(name):
                    seen.add(id(mod))
                    if op.endswith("ffn"):  # a feed-forward block: an MoE when it routes
                        kids = {n for n, _ in mod.named_children()}
                        op = op[:-3] + ("moe" if kids & {"gate", "router", "experts"} else "mlp")
                    if what == "attn":
                        self.handles.append(mod.register_forward_pre_hook(self._attn_inputs(op), with_kwargs=True))
                        self.handles.append(mod.register_forward_hook(self._hook(op + "attn_out", "out")))
                    else:
                        self.handles.append(mod.register_forward_hook(self._hook(op, what)))
                    break
        _ACTIVE["capture"] = self if self.kernels else None
        if self.kernels:
            _wrap_kernels()

    def remove(self) -> None:
        """Take this capture's hooks off the model (a kept worker's next capture installs its own)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        if _ACTIVE.get("capture") is self:
            _ACTIVE["capture"] = None

    # -- per step ----------------------------------------------------------------------------------
    def begin_step(self, runner, scheduler_output, attn_metadata) -> None:
        self.rows = []
        if self.why is not None:
            return
        ib = runner.input_batch
        n = ib.num_reqs
        req_ids = list(ib.req_ids[:n])
        computed = ib.num_computed_tokens_cpu[:n].tolist()
        sched = [int(scheduler_output.num_scheduled_tokens[r]) for r in req_ids]
        num_decodes = _num_decodes(attn_metadata)
        decode_tokens = sum(sched[:num_decodes])
        start = 0
        for i, rid in enumerate(req_ids):
            ours = self._ours(rid)
            if ours is not None:
                kind, index = ("decode", i) if i < num_decodes else ("prefill", i - num_decodes)
                self.rows.append(
                    {
                        "id": ours,
                        "start": start,
                        "n": sched[i],
                        "pos": int(computed[i]),
                        "kind": kind,
                        "index": index,
                        "kstart": start if kind == "decode" else start - decode_tokens,
                    }
                )
            start += sched[i]

    def end_step(self) -> None:
        self.rows = []
        self.layer = None

    def _ours(self, rid: str) -> str | None:
        if rid in self.asked:
            return rid
        base = rid.rsplit("-", 1)[0]
        return base if base in self.asked and len(rid) - len(base) == 9 else None

    # -- recording ---------------------------------------------------------------------------------
    def _op(self, name: str) -> str:
        if name.startswith("!"):
            return name[1:]
        return name if self.layer is None else f"L{self.layer}.{name}"

    def _put(self, rid: str, name: str, position: int, tensor) -> None:
        if position > self.upto.get(rid, 1 << 62):
            return
        op = self._op(name)
        per = self.data.setdefault(rid, {})
        if op not in per:
            per[op] = {}
            self.order.setdefault(rid, []).append(op)
        per[op][int(position)] = tensor.detach().double().cpu().reshape(-1).numpy()

    def _put_rows(self, name: str, tensor, kernel_part: str | None = None) -> None:
        """Token rows of every asked request in a packed tensor (or in the decode / prefill part a
        kernel sees: `kernel_part`)."""
        for r in self.rows:
            if kernel_part is not None and r["kind"] != kernel_part:
                continue
            at = r["kstart"] if kernel_part is not None else r["start"]
            for j in range(r["n"]):
                self._put(r["id"], name, r["pos"] + j, tensor[at + j])

    def _guard(self, fn):
        def run(*args, **kwargs):
            if not self.rows or self.why is not None:
                return
            try:
                fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a capture bug costs the capture, never the engine
                self.why = f"capture stopped ({type(e).__name__}: {e})"

        return run

    def _hook(self, name: str, what: str):
        @self._guard
        def post(_mod, _args, output):
            if isinstance(output, (tuple, list)):
                two = (
                    len(output) == 2 and all(hasattr(o, "shape") for o in output) and output[0].shape == output[1].shape
                )
                output = output[0] + output[1] if what == "sum" and two else output[0]
            self._put_rows(name, output)

        return lambda mod, args, output: post(mod, args, output)

    def _attn_inputs(self, prefix: str):
        @self._guard
        def pre(_mod, args, kwargs):
            names = ("query", "key", "value")
            vals = list(args[:3]) + [kwargs.get(k) for k in names[len(args[:3]) :]]
            for op, t in zip(("q", "k", "v"), vals):
                if t is not None:
                    self._put_rows(prefix + op, t.reshape(t.shape[0], -1))

        return lambda mod, args, kwargs: pre(mod, args, kwargs)

    def _observe(self, name: str, a: dict, out, before) -> None:
        import torch.nn.functional as F

        if name == "causal_conv1d_fn":
            self._put_rows("conv", out.transpose(0, 1), "prefill")
        elif name == "causal_conv1d_update":
            self._put_rows("conv", out, "decode")
        elif name == "mamba_chunk_scan_combined_varlen":
            dt = a["dt"] + a["dt_bias"] if a.get("dt_bias") is not None else a["dt"]
            dt = F.softplus(dt) if a.get("dt_softplus") else dt
            lo, hi = a.get("dt_limit", (0.0, float("inf")))
            self._put_rows("dt", dt.clamp(min=lo, max=hi), "prefill")
            self._put_rows("ssm_out", a["out"].reshape(a["out"].shape[0], -1), "prefill")
            init = a.get("initial_states")
            for r in self.rows:
                if r["kind"] != "prefill":
                    continue
                state0 = init[r["index"]] if init is not None else None
                if state0 is not None:
                    self._put(r["id"], "state_in", r["pos"], state0)
                if not a.get("return_intermediate_states"):
                    self._put(r["id"], "state_out", r["pos"] + r["n"] - 1, out[r["index"]])
        elif name == "selective_state_update":
            dt = a["dt"] + a["dt_bias"] if a.get("dt_bias") is not None else a["dt"]
            dt = F.softplus(dt) if a.get("dt_softplus") else dt
            for r in self.rows:
                if r["kind"] != "decode":
                    continue
                i = r["index"]
                self._put(r["id"], "dt", r["pos"], dt[i][..., 0] if dt.dim() == 3 else dt[i])
                self._put(r["id"], "ssm_out", r["pos"], a["out"][i])
                self._put(r["id"], "state_in", r["pos"], before[r["id"]])
                self._put(r["id"], "state_out", r["pos"], a["state"][_slot(a, i)])

    # -- output --------------------------------------------------------------------------------------
    def write(self) -> None:
        import numpy as np

        os.makedirs(self.out, exist_ok=True)
        arrays, index = {}, {"why": self.why, "installed": self.installed, "requests": {}}
        for rid, ops in self.data.items():
            entries = []
            for op in self.order.get(rid, []):
                for pos, arr in sorted(ops[op].items()):
                    key = f"a{len(arrays)}"
                    arrays[key] = arr
                    entries.append([op, pos, key])
            index["requests"][rid] = {"order": self.order.get(rid, []), "entries": entries}
        stem = os.path.join(self.out, f"capture-{os.getpid()}")
        with open(stem + ".tmp.npz", "wb") as f:
            np.savez(f, **arrays)
        os.replace(stem + ".tmp.npz", stem + ".npz")
        with open(stem + ".tmp.json", "w") as f:
            json.dump(index, f)
        os.replace(stem + ".tmp.json", stem + ".json")


def _wrap_kernels() -> None:
    """Wrap vLLM's Mamba2 kernels where the mixer looks them up, once per process: each call is seen
    by the capture active then (`_ACTIVE`), if any."""
    try:
        from vllm.model_executor.layers.mamba import mamba_mixer2 as mm
    except Exception:  # noqa: BLE001 - no Mamba2 layers in this build: nothing to wrap
        return
    for name in KERNELS:
        fn = getattr(mm, name, None)
        if fn is not None and not getattr(fn, "_lpf_capture", False):
            wrapped = _kernel(name, fn)
            wrapped._lpf_capture = True
            setattr(mm, name, wrapped)


def _kernel(name: str, fn):
    sig = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        cap = _ACTIVE["capture"]
        observe = cap is not None and bool(cap.rows) and cap.why is None
        a, before = {}, None
        if observe:
            try:
                a = sig.bind_partial(*args, **kwargs).arguments
                if name == "selective_state_update":
                    before = {
                        r["id"]: a["state"][_slot(a, r["index"])].clone() for r in cap.rows if r["kind"] == "decode"
                    }
            except Exception as e:  # noqa: BLE001
                cap.why, observe = f"capture stopped ({type(e).__name__}: {e})", False
        out = fn(*args, **kwargs)
        if observe:
            cap._guard(cap._observe)(name, a, out, before)
        return out

    return wrapper


def _slot(a: dict, i: int) -> int:
    idx = a.get("state_batch_indices")
    if idx is None:
        return i
    v = idx[i]
    return int(v.reshape(-1)[0]) if hasattr(v, "reshape") else int(v)


def _num_decodes(attn_metadata) -> int:
    """Decode rows the Mamba metadata put first (0 without Mamba layers)."""
    if not isinstance(attn_metadata, dict):
        return 0
    for m in attn_metadata.values():
        if hasattr(m, "num_decodes") and hasattr(m, "state_indices_tensor_d"):
            return int(m.num_decodes)
    return 0


def load_spec(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
