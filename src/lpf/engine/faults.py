"""Fault drills: opt-in bugs that re-create real mechanisms, plus their ground truth.

Each drill changes how the engine works, never its outputs directly:
  stale-state           requests are classified by scheduled-token count alone (a new request given
                        1 token of budget runs as a decode, reading its slot) and reused slots are not
                        zeroed: the seed's "imposter request".
  offset-wrap[:BITS]    the prefill path computes state offsets `slot * stride` modulo 2**BITS
                        (default 20): slots past 2**BITS / stride write their final state elsewhere;
                        the decode path keeps exact offsets: the seed's 32-bit offset overflow.
  batch-variant         the LM head is a split-K reduction whose split count depends on the batch
                        size, with float16 partial sums (numeric noise only).
  swap-outputs[:PERIOD] every PERIOD steps (default 25) the samples of two decoding requests are
                        delivered to each other: crossed wires.
  processed-logprobs    logprobs come from the post-temperature/top-k/top-p distribution while the
                        engine claims raw ones.
  kv-double-free        a finished request's last KV block is freed twice, so two live requests can
                        later share it and overwrite each other's keys and values.
Ground truth (which request, which step, what happened) is recorded per event and written to
`faults/*.parquet`, which analysis never reads; only tests and drill scoring do. `role` says how
the event reached the request: `corrupted` (its outputs were sampled from the faulty state or
delivery), `discarded` (stale-state: preempted before sampling, recompute threw the state away),
`wrapped` (offset-wrap: its prefill's state write landed elsewhere; `corrupted` follows when it
then decodes), `overwritten` (offset-wrap: another request's wrapped write hit its slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from lpf.errors import LpfError, did_you_mean

DRILLS = ("stale-state", "offset-wrap", "batch-variant", "swap-outputs", "processed-logprobs", "kv-double-free")

FAULTS_SCHEMA = pa.schema([("request_id", pa.string()), ("step", pa.int64()), ("fault", pa.string()),
                           ("role", pa.string()), ("detail", pa.string())])


@dataclass(frozen=True)
class FaultSet:
    stale_state: bool = False
    offset_wrap_bits: int | None = None
    batch_variant: bool = False
    swap_outputs_period: int | None = None
    processed_logprobs: bool = False
    kv_double_free: bool = False

    @classmethod
    def parse(cls, specs: list[str] | str | None) -> "FaultSet":
        if isinstance(specs, str):
            specs = [s for s in specs.split(",") if s.strip()]
        kw: dict = {}
        for spec in specs or []:
            name, _, arg = spec.strip().partition(":")
            if name not in DRILLS:
                raise LpfError(f"unknown fault {name!r}{did_you_mean(name, DRILLS)}; drills: {', '.join(DRILLS)}")
            if name in ("offset-wrap", "swap-outputs"):
                default = 20 if name == "offset-wrap" else 25
                try:
                    value = int(arg) if arg else default
                except ValueError:
                    raise LpfError(f"fault {name}: argument must be an integer, got {arg!r}") from None
                if not (1 <= value <= 62):
                    raise LpfError(f"fault {name}: argument must be in 1..62, got {value}")
                kw["offset_wrap_bits" if name == "offset-wrap" else "swap_outputs_period"] = value
            elif arg:
                raise LpfError(f"fault {name} takes no argument")
            else:
                kw[name.replace("-", "_")] = True
        return cls(**kw)

    def names(self) -> list[str]:
        out = []
        if self.stale_state:
            out.append("stale-state")
        if self.offset_wrap_bits is not None:
            out.append(f"offset-wrap:{self.offset_wrap_bits}")
        if self.batch_variant:
            out.append("batch-variant")
        if self.swap_outputs_period is not None:
            out.append(f"swap-outputs:{self.swap_outputs_period}")
        if self.processed_logprobs:
            out.append("processed-logprobs")
        if self.kv_double_free:
            out.append("kv-double-free")
        return out


@dataclass
class GroundTruth:
    """Fault events as they happen; drained into `faults/*.parquet` parts."""

    rows: list[dict] = field(default_factory=list)
    _once: set = field(default_factory=set)

    def record(self, request_id: str, step: int, fault: str, detail: str, other: str | None = None,
               role: str = "corrupted") -> None:
        self.rows.append({"request_id": request_id, "step": step, "fault": fault, "role": role, "detail": detail})
        if other is not None:
            self.rows.append({"request_id": other, "step": step, "fault": fault, "role": role, "detail": detail})

    def record_once(self, request_id: str, step: int, fault: str, detail: str) -> None:
        if (request_id, fault) not in self._once:
            self._once.add((request_id, fault))
            self.record(request_id, step, fault, detail)

    def drain(self) -> pa.Table | None:
        if not self.rows:
            return None
        table = pa.Table.from_pylist(self.rows, schema=FAULTS_SCHEMA)
        self.rows = []
        return table
