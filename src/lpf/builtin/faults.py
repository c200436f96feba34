"""Fault drills: opt-in bugs that re-create real mechanisms, plus their ground truth.

Each drill changes how the engine works, never its outputs directly. Every drill is declared once in
`drill_catalog` (name, argument, preconditions, ground truth, the features that name it); `FaultSet` is
built from it (a field per drill: `Drill.field`), so this module holds only the mechanisms: the seed
drills (stale-state, offset-wrap, batch-variant, swap-outputs, processed-logprobs, kv-double-free in the
scheduler, lost-chunk-state), stale-conv-on-reuse, the recurrent drills' phase-level hooks
(chunk-state-transposed, padding-updates-state's ground truth; state-fp16 is the state cache's part
dtype, set by the runner), and the substitutions (their arithmetic in
`numeric_drills`). Prefix-caching drills live in `prefix_drills`, speculative ones in `speculative_decode`.
`Drills` is the runner's one handle on all of them: the weights at load, the phase rule, whether a
new slot is zeroed, how K/V are stored, the LM head, the sampling temperature, the delivery of
samples, and the ground-truth bookkeeping, each the honest behaviour when no
drill is on, so the model runner reads like a runner.
Ground truth (which request, which step, what happened) is recorded per event and written to
`faults/*.parquet`, which analysis never reads; only tests and drill scoring do. `role` says how
the event reached the request: `corrupted` (its outputs were sampled from the faulty state or
delivery), `discarded` (stale-state: preempted before sampling, recompute threw the state away),
`wrapped` (offset-wrap: its prefill's state write landed elsewhere; `corrupted` follows when it
then decodes), `overwritten` (offset-wrap: another request's wrapped write hit its slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass

from lpf.builtin.drill_catalog import CATALOG, GROUP_SIZE, Drill
from lpf.core.errors import LpfError, did_you_mean

PERTURB_SEED = 1234  # perturb-weights draws the same "fine-tune" on every run

DRILLS = tuple(CATALOG)


def _field(drill: Drill):
    """A drill's FaultSet field: a flag, or its argument's value (None: off)."""
    return (drill.field, bool, False) if drill.arg is None else (drill.field, drill.arg.kind | None, None)


def _parse(cls, specs: list[str] | str | None) -> "FaultSet":
    """`"offset-wrap:18,stale-state"` (or a list of such) -> the FaultSet; unknown names and bad arguments
    are one-line LpfErrors."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    kw: dict = {}
    for spec in specs or []:
        name, _, arg = spec.strip().partition(":")
        drill = CATALOG.get(name)
        if drill is None:
            raise LpfError(f"unknown fault {name!r}{did_you_mean(name, DRILLS)}; drills: {', '.join(DRILLS)}")
        if drill.arg is not None:
            a = drill.arg
            try:
                value = a.kind(arg) if arg else a.default
            except ValueError:
                word = "an integer" if a.kind is int else "a number"
                raise LpfError(f"fault {name}: argument must be {word}, got {arg!r}") from None
            if not (a.lo <= value <= a.hi):
                raise LpfError(f"fault {name}: argument must be in {a.lo:g}..{a.hi:g}, got {value:g}")
            kw[drill.field] = value
        elif arg:
            raise LpfError(f"fault {name} takes no argument")
        else:
            kw[drill.field] = True
    return cls(**kw)


def _in_force(self) -> list[Drill]:
    return [d for d in CATALOG.values() if getattr(self, d.field) not in (None, False)]


def _names(self) -> list[str]:
    """The drills in force as `--inject` spells them ("offset-wrap:18"), in catalog order."""
    return [f"{d.name}:{getattr(self, d.field):g}" if d.arg else d.name for d in _in_force(self)]


def _refusals(self, options) -> list[str]:
    """Why the engine's options cannot run the drills in force (one line each, `Drill.needs`)."""
    return [why for d in _in_force(self) for why in d.refusals(options)]


# One frozen field per catalogued drill, so the runner reads `faults.stale_state`, `faults.offset_wrap_bits`.
FaultSet = make_dataclass(
    "FaultSet",
    [_field(d) for d in CATALOG.values()],
    frozen=True,
    namespace={
        "__doc__": "The drills in force: one field per `drill_catalog` entry (a flag, or the argument's value).",
        "parse": classmethod(_parse),
        "in_force": _in_force,
        "names": _names,
        "refusals": _refusals,
    },
)
FaultSet.__module__ = __name__


@dataclass
class GroundTruth:
    """Fault events as they happen; drained into `faults/*.parquet` parts."""

    rows: list[dict] = field(default_factory=list)
    _once: set = field(default_factory=set)

    def record(
        self, request_id: str, step: int, fault: str, detail: str, other: str | None = None, role: str = "corrupted"
    ) -> None:
        self.rows.append({"request_id": request_id, "step": step, "fault": fault, "role": role, "detail": detail})
        if other is not None:
            self.rows.append({"request_id": other, "step": step, "fault": fault, "role": role, "detail": detail})

    def record_once(self, request_id: str, step: int, fault: str, detail: str) -> None:
        if (request_id, fault) not in self._once:
            self._once.add((request_id, fault))
            self.record(request_id, step, fault, detail)

    def drain(self):
        """The events since the last drain as a `faults` table (None when there are none)."""
        if not self.rows:
            return None
        import pyarrow as pa

        from lpf.run.schema import FAULTS

        table = pa.Table.from_pylist(self.rows, schema=FAULTS)
        self.rows = []
        return table


def classify(num_computed_tokens: int, num_scheduled_tokens: int, stale_state: bool) -> str:
    """The phase a scheduled request runs in. The fix from the seed bug: a request that has computed
    nothing yet is a prefill, whatever its token count. Under `stale-state` the pre-fix rule (only
    the number of scheduled tokens was looked at) is used instead."""
    if stale_state:
        return "decode" if num_scheduled_tokens == 1 else ("prefill" if num_computed_tokens == 0 else "extend")
    if num_computed_tokens == 0:
        return "prefill"
    return "decode" if num_scheduled_tokens == 1 else "extend"


class Drills:
    """The drills' hooks into one engine step, in the order the runner calls them.

    A stale read is recorded as `corrupted` once the request samples from it, or as `discarded` when a
    preemption throws it away first (recompute starts over from a zeroed prefill, so no output ever
    saw it). An offset-wrap prefill is recorded as `wrapped` when its state write lands elsewhere and
    as `corrupted` when the request then decodes from its own slot, which that write never reached (a
    request that finishes on its prefill's sample never reads the wrong state); the requests whose
    slots the wrapped write hit are `overwritten`.
    """

    def __init__(self, faults: FaultSet, truth: GroundTruth, state_cache):
        self.faults = faults
        self.truth = truth
        self.state_cache = state_cache  # offset arithmetic: where a wrapped prefill's write lands
        self._stale_reads: dict[str, tuple[int, str, str]] = {}  # (step, detail, fault) read, no sample yet
        self._wrapped: dict[str, tuple[int, str]] = {}  # wrapped prefill, not yet followed by a decode
        self._every_request = [d for d in faults.in_force() if d.every_request is not None]

    @property
    def processed_logprobs(self) -> bool:
        return self.faults.processed_logprobs

    @property
    def sampling_temperature(self) -> float | None:
        """The temperature every request is sampled at (and its logprobs taken from), or None: the client's."""
        return self.faults.sampling_temperature

    def edit_weights(self, model) -> None:
        """At load: the weights as a substituted checkpoint would have them (`quantize-weights`,
        `perturb-weights`; both: noise first, then rounding, as a quantized fine-tune would be)."""
        f = self.faults
        if f.quantize_weights_bits is None and f.perturb_weights_scale is None:
            return
        import torch

        from lpf.builtin import numeric_drills as nd

        gen = torch.Generator().manual_seed(PERTURB_SEED)
        with torch.no_grad():
            for _, w in nd.linear_weights(model):
                if f.perturb_weights_scale is not None:
                    w.copy_(nd.perturb(w, f.perturb_weights_scale, gen))
                if f.quantize_weights_bits is not None:
                    w.copy_(nd.rtn_groupwise(w, f.quantize_weights_bits, GROUP_SIZE))

    def kv_rounding(self):
        """How K/V are stored in the paged cache: None (as computed) or a rounding function (`kv-quant`)."""
        bits = self.faults.kv_quant_bits
        if bits is None:
            return None
        from lpf.builtin.numeric_drills import round_kv

        return lambda x: round_kv(x, bits)

    def phase(self, s) -> str:
        return classify(s.num_computed_tokens, s.num_scheduled_tokens, self.faults.stale_state)

    def has_initial_state(self, s, phase: str) -> bool:
        """Whether a prefill/extend chunk continues from its slot's state: an extend does, unless the
        lost-chunk-state drill says it has none."""
        return phase == "extend" and not self.faults.lost_chunk_state

    def zero_new_slot(self, s) -> bool:
        """Defence in depth: a newly allocated slot starts clean (not under stale-state or stale-conv-on-reuse)."""
        return s.slot_is_new and not (self.faults.stale_state or self.faults.stale_conv_on_reuse)

    def state_transposed(self, phase: str) -> bool:
        """chunk-state-transposed: an extend reads its SSM state with the last two axes swapped."""
        return self.faults.chunk_state_transposed and phase == "extend"

    def padded(self, so, request_ids) -> None:
        """padding-updates-state's ground truth: the chunks the Mamba layers padded to a longer one of the
        same batched scan (their final state decayed by the padding; every later step reads it)."""
        for rid in request_ids:
            self.truth.record(
                rid,
                so.step,
                "padding-updates-state",
                "its prefill chunk was right-padded to a longer chunk of the same batched scan, and the "
                "padding's gates decayed its final state",
            )

    def conv_reads_slot(self, phase: str) -> bool:
        """stale-conv-on-reuse: a prefill's conv takes its slot's content as its initial state."""
        return self.faults.stale_conv_on_reuse and phase == "prefill"

    def preempted(self, request_ids) -> None:
        for rid in request_ids:
            self._discard_stale_read(rid)
            self._wrapped.pop(rid, None)  # recompute prefills again (and records again if it wraps)

    def scheduled(self, so, s, phase: str) -> None:
        """Record what this step does to `s` under the drills in force."""
        f, t, step = self.faults, self.truth, so.step
        if f.stale_state and phase == "decode" and s.num_computed_tokens == 0 and s.slot_reused:
            self._stale_reads[s.request_id] = (
                step,
                f"first step ran as decode on slot {s.state_slot}, which held an earlier request's state",
                "stale-state",
            )
        if f.stale_conv_on_reuse and phase == "prefill" and s.slot_reused:
            self._stale_reads[s.request_id] = (
                step,
                f"prefill on slot {s.state_slot} took the conv state an earlier "
                f"request left there as its initial conv state (no "
                f"has_initial_state)",
                "stale-conv-on-reuse",
            )
        if s.will_sample and s.request_id in self._stale_reads:
            read_step, detail, fault = self._stale_reads.pop(s.request_id)
            t.record(s.request_id, read_step, fault, detail)
        if f.offset_wrap_bits is not None and phase in ("prefill", "extend") and self.state_cache.wraps(s.state_slot):
            self._record_wrap(so, s)
        if phase == "decode" and s.num_computed_tokens > 0 and s.request_id in self._wrapped:
            wrap_step, detail = self._wrapped.pop(s.request_id)
            t.record(
                s.request_id,
                wrap_step,
                "offset-wrap",
                detail + f"; step {step} decoded from slot {s.state_slot}, which its prefill never wrote",
            )
        if f.lost_chunk_state and phase == "extend":
            t.record(
                s.request_id,
                step,
                "lost-chunk-state",
                f"chunk at prompt position {s.num_computed_tokens} "
                f"started from a zero state (the state of positions < {s.num_computed_tokens} was lost)",
            )
        if f.chunk_state_transposed and phase == "extend":
            t.record(
                s.request_id,
                step,
                "chunk-state-transposed",
                f"chunk at prompt position {s.num_computed_tokens} read its SSM state in the transposed layout",
            )
        if f.processed_logprobs and s.will_sample and not s.sampling.greedy:
            t.record_once(
                s.request_id, step, "processed-logprobs", "reported logprobs are post-temperature/top-k/top-p"
            )
        for drill in self._every_request:  # drills that change every request: `Drill.every_request`
            t.record_once(s.request_id, step, drill.name, drill.every_request(getattr(f, drill.field)))

    def logits(self, model, rows, batch_size: int):
        """The LM head; under `batch-variant` a split-K head whose hidden dimension is cut into
        `splits` pieces, each partial logit rounded to float16 before summing, the split count
        following the batch size as a GEMM heuristic would pick it. The head is linear, so masking
        the input splits it exactly."""
        if not self.faults.batch_variant:
            return self._head_dtype(model.compute_logits(rows))
        import torch

        splits = 2 + batch_size % 3
        h = rows.shape[-1]
        edges = [round(i * h / splits) for i in range(splits + 1)]
        total = None
        for lo, hi in zip(edges, edges[1:]):
            masked = torch.zeros_like(rows)
            masked[:, lo:hi] = rows[:, lo:hi]
            part = model.compute_logits(masked).half().float()
            total = part if total is None else total + part
        return self._head_dtype(total)

    def _head_dtype(self, logits):
        """`lm-head-bf16`: the logits as a bfloat16 head gives them (sampling and logprobs read these)."""
        return logits.bfloat16().float() if self.faults.lm_head_bf16 else logits

    def deliver(self, so, decoding: list[str], samples: dict) -> dict:
        """The samples as delivered: under `swap-outputs`, every PERIOD steps two decoding requests
        receive each other's."""
        period = self.faults.swap_outputs_period
        if period and so.step % period == 0 and len(decoding) >= 2:
            a, b = decoding[:2]
            samples[a], samples[b] = samples[b], samples[a]
            self.truth.record(a, so.step, "swap-outputs", f"sample of {a} and {b} delivered to each other", other=b)
        return samples

    def _discard_stale_read(self, request_id: str) -> None:
        """Preempted before sampling: recompute restarts from a prefill, so the stale read never
        reached an output. Kept in the ground truth with its own role, never silently dropped."""
        if request_id in self._stale_reads:
            step, detail, fault = self._stale_reads.pop(request_id)
            self.truth.record(
                request_id,
                step,
                fault,
                detail + "; preempted before its first sample, so recompute discarded the stale state",
                role="discarded",
            )

    def _record_wrap(self, so, s) -> None:
        sc, t, step = self.state_cache, self.truth, so.step
        target = sc.base(s.state_slot, "prefill")
        detail = f"slot {s.state_slot}: state offset {s.state_slot * sc.slot_stride} wrapped to {target}"
        t.record(s.request_id, step, "offset-wrap", detail, role="wrapped")
        self._wrapped.setdefault(s.request_id, (step, detail))
        for victim_slot in sc.stray_write(s.state_slot, "prefill")[2]:
            owner = so.slot_owners.get(victim_slot)
            if owner is not None and owner != s.request_id:
                t.record(
                    owner,
                    step,
                    "offset-wrap",
                    f"slot {victim_slot} overwritten by {s.request_id}'s wrapped state write",
                    role="overwritten",
                )
