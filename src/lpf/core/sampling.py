"""Sampling parameters of a run, validated once; the per-request seed derivation.

One `SamplingParams` holds for the whole run (a workload item may lower `max_tokens` for itself).
`logprobs` is the number of top-k alternatives recorded per position, as in vLLM's SamplingParams;
`prompt_logprobs` asks the engine for the logprob of every prompt token as well (`--prompt-logprobs`:
positions 1..P-1, with the same top-k), so the prefill path is audited beside the sampled tokens.
The penalties are what servers apply on their own (vLLM's semantics): `repetition_penalty` divides a
positive logit (multiplies a negative one) of every token already in the prompt or the output,
`presence_penalty` / `frequency_penalty` subtract a constant / a constant per occurrence from the
logits of tokens already in the output. They change which token is chosen, never the reported
(raw) logprobs; `to_dict` leaves them out at their neutral values, so a run without them records
what it always did.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields

from lpf.core.errors import LpfError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 32
    seed: int = 0
    ignore_eos: bool = False
    logprobs: int = 5
    prompt_logprobs: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise LpfError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise LpfError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise LpfError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise LpfError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.logprobs <= 20:
            raise LpfError(f"logprobs (top-k recorded per token) must be in 0..20, got {self.logprobs}")
        if not 0 < self.repetition_penalty <= 10:
            raise LpfError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise LpfError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        d = asdict(self)
        for name, neutral in _NEUTRAL.items():
            if d[name] == neutral:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def request_seed(run_seed: int, seq: int) -> int:
    """A per-request seed that depends only on the run seed and arrival index (stable under resume)."""
    digest = hashlib.blake2b(f"{run_seed}:{seq}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
