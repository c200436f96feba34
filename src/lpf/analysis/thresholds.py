"""Verdict thresholds: defaults, overrides from the command line, and what they mean.

Per token d = engine_logprob - ref_logprob. A request is `clean` when every |d| <= clean_abs_diff,
`noise` when some |d| exceeds it but none reaches divergent_abs_diff and no greedy flip occurred
(a flip needs the reference's argmax to beat the engine's token by more than tie_margin),
`divergent` otherwise, and `corrupt` when it tells confident gibberish: from its first divergence
on, over the informative tokens (not both sides >= settled_logprob sure: those are dictated by
context), its mean lie strength (the gibberish score) is at least gibberish_min_score and at least
gibberish_min_tokens of those tokens are lie tokens (fewer only when an overwhelming lie, d >= 2 x
gibberish_log_ratio, is the last informative token: an engine that confidently ends a request early cannot lie
for longer). A token's lie
strength is 1 when the engine was sure of it while the reference finds it improbable (engine
logprob >= confident_logprob, reference logprob <= improbable_logprob), and otherwise, for the
engine's own top choice that the reference ranks lower, d / gibberish_log_ratio clipped to [0, 1],
so an untrained model that is never confident in absolute terms still shows it; a lie token has
strength >= 0.5. The defaults suit float32-vs-float32; `lpf.analysis.calibration` raises clean, divergent
and tie thresholds to the run's own noise floor; every run prints the values it used. Names set
with `--threshold` are pinned: calibration never moves them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from lpf.core.errors import LpfError, did_you_mean


@dataclass(frozen=True)
class Thresholds:
    clean_abs_diff: float = 1e-3
    divergent_abs_diff: float = 0.5
    tie_margin: float = 1e-3  # a greedy flip needs the reference's argmax to win by more than this
    confident_logprob: float = math.log(0.5)
    improbable_logprob: float = math.log(0.05)
    gibberish_log_ratio: float = math.log(20.0)
    gibberish_min_tokens: int = 2
    gibberish_min_score: float = 0.3
    settled_logprob: float = math.log(0.9)  # both sides at least this sure: the token proves nothing
    pinned: frozenset = field(default=frozenset(), compare=False)  # names the user set: calibration keeps them

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("pinned")
        return d

    def with_overrides(self, pairs: list[str]) -> "Thresholds":
        """Apply NAME=VALUE strings (from `--threshold`). Raises LpfError on unknown names or values."""
        known = {f.name: f for f in fields(self) if f.name != "pinned"}
        changes = {}
        for pair in pairs:
            name, sep, text = pair.partition("=")
            name = name.strip().replace("-", "_")
            if not sep:
                raise LpfError(f"--threshold expects NAME=VALUE, got {pair!r}")
            if name not in known:
                raise LpfError(f"unknown threshold {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}")
            try:
                changes[name] = int(text) if name == "gibberish_min_tokens" else float(text)
            except ValueError:
                raise LpfError(f"--threshold {name}: not a number: {text!r}") from None
            if not math.isfinite(changes[name]):
                raise LpfError(f"--threshold {name}: must be finite, got {text!r}")
        return replace(self, **changes, pinned=self.pinned | frozenset(changes))
