"""Per-step metadata reachable from every layer, without threading it through `forward`.

The runner builds one `ForwardContext` per step and enters `set_forward_context(ctx)`; layers call
`get_forward_context()`, which fails loudly outside a step. The context is restored on exit (nesting
is allowed, as in vLLM). Tokens of all scheduled requests are packed into one flat batch; `SeqMeta`
says where each request's tokens are and how the runner classified them.

Activation capture (`lpf locate`): a context may carry a `capture`; layers hand it internal tensors
with `probe(module, name, tensor)` (a q after rotary, a Mamba input state, dt). With no capture set,
`probe` returns at once, so the engine computes exactly what it computes without it. `rows` says whose
tokens a layer is working on while it runs one request (a prefill chunk) or the decode batch: a
probed tensor's first dimension runs over the tokens of `rows` in order (one row per request for a
state), over the whole packed batch when `rows` is None.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

PHASES = ("prefill", "extend", "decode", "verify")


@dataclass
class SeqMeta:
    """One scheduled request within a step."""

    request_id: str
    start: int  # offset of its first scheduled token in the packed batch
    num_tokens: int  # tokens scheduled this step
    num_computed: int  # tokens already in the caches before this step (its first position)
    # prefill (no prior state) | extend (continues a chunked prefill) | decode (1 token) | verify
    # (speculative decoding: its last sampled token and its drafts, stepped by the decode kernel)
    phase: str
    state_slot: int
    block_table: list[int]
    # a prefill or extend chunk continues from the state in its slot (vLLM's has_initial_state);
    # None: the phase decides (extend does, prefill does not)
    has_initial_state: bool | None = None
    # prefix caching: where the initial state is read (a checkpoint slot: vLLM's initial_state_idx),
    # None = the request's own slot; the kernel reads every such state before it writes any
    initial_slot: int | None = None
    # where the chunk's final conv state is written (None = its own slot and its chunk-end checkpoint)
    conv_write_slot: int | None = None
    # (position, slot): the state after `position` tokens is also saved to `slot` (a Mamba checkpoint);
    # positions in (num_computed, num_computed + num_tokens], ascending
    checkpoints: tuple[tuple[int, int], ...] = ()
    # a prefill takes its slot's conv state as its initial conv state (no has_initial_state passed to
    # the conv kernel; the SSM still starts from zero): the stale-conv-on-reuse drill
    conv_reads_slot: bool = False
    # an extend reads its SSM state in the transposed layout (the last two axes swapped, read back in the
    # written shape): the chunk-state-transposed drill
    state_transposed: bool = False

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def reads_initial_state(self) -> bool:
        if self.has_initial_state is None:
            return self.phase == "extend" or (self.phase == "decode" and self.initial_slot is not None)
        return self.has_initial_state


@dataclass
class ForwardContext:
    step: int
    seqs: list[SeqMeta]
    kv_cache: Any  # lpf.builtin.kv_cache.KVCache
    state_cache: Any  # lpf.builtin.state_cache.StateCache
    capture: Any = None  # lpf.locate's capture: `put(module, name, tensor, rows)`; None: nothing captured
    rows: list[SeqMeta] | None = None  # while a layer runs part of the batch: whose tokens (see module doc)
    # what every layer of one kind derives alike from `seqs` (the decode groups' index tensors, the
    # decodes' slot list): built by the first layer that needs it, reused by the others this step
    memo: dict = field(default_factory=dict)
    # a batched prefill's padding is not masked out of the state update (its gates come from the padding's
    # zero projections): the padding-updates-state drill
    unmasked_padding: bool = False

    @property
    def decodes(self) -> list[SeqMeta]:
        if "decodes" not in self.memo:
            self.memo["decodes"] = [s for s in self.seqs if s.phase == "decode"]
        return self.memo["decodes"]

    @property
    def verifies(self) -> list[SeqMeta]:
        if "verifies" not in self.memo:
            self.memo["verifies"] = [s for s in self.seqs if s.phase == "verify"]
        return self.memo["verifies"]

    @property
    def attention_decodes(self) -> list[SeqMeta]:
        """What attention runs as single-token queries: the decodes, and every position of a verify (each
        a query at its own position over the keys up to it: causal, as one verify query block is)."""
        if "attention_decodes" not in self.memo:
            self.memo["attention_decodes"] = self.decodes + [
                replace(s, start=s.start + i, num_computed=s.num_computed + i, num_tokens=1, phase="decode")
                for s in self.verifies
                for i in range(s.num_tokens)
            ]
        return self.memo["attention_decodes"]

    @property
    def chunks(self) -> list[SeqMeta]:
        """Prefill and extend chunks (the Mamba layers' scan path; attention takes verifies with them)."""
        if "chunks" not in self.memo:
            self.memo["chunks"] = [s for s in self.seqs if s.phase in ("prefill", "extend")]
        return self.memo["chunks"]

    @property
    def non_decodes(self) -> list[SeqMeta]:
        if "non_decodes" not in self.memo:
            self.memo["non_decodes"] = [s for s in self.seqs if s.phase != "decode"]
        return self.memo["non_decodes"]


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext):
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def probe(module, name: str, tensor) -> None:
    """Hand `tensor` (computed by `module` for `ctx.rows`) to the step's capture, if there is one."""
    ctx = _current
    if ctx is not None and ctx.capture is not None:
        ctx.capture.put(module, name, tensor, ctx.rows)


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(
            "no forward context: model layers must run inside set_forward_context() "
            "(the model runner sets it for each step)"
        )
    return _current
