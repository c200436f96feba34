"""Verdict thresholds: defaults, overrides from the command line, and what they mean.

Per token d = engine_logprob - ref_logprob. A request is `clean` when every |d| <= clean_abs_diff,
`noise` when some |d| exceeds it but none reaches divergent_abs_diff and no greedy flip occurred,
`divergent` otherwise, and `corrupt` when the engine was confident (logprob >= confident_logprob) on at
least gibberish_min_tokens tokens the reference finds improbable (logprob <= improbable_logprob):
confident gibberish. The defaults suit float32-vs-float32; every run prints the values it used.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from lpf.errors import LpfError, did_you_mean


@dataclass(frozen=True)
class Thresholds:
    clean_abs_diff: float = 1e-3
    divergent_abs_diff: float = 0.5
    tie_margin: float = 1e-3  # a greedy flip needs the reference's argmax to win by more than this
    confident_logprob: float = math.log(0.5)
    improbable_logprob: float = math.log(0.05)
    gibberish_min_tokens: int = 2

    def to_dict(self) -> dict:
        return asdict(self)

    def with_overrides(self, pairs: list[str]) -> "Thresholds":
        """Apply NAME=VALUE strings (from `--threshold`). Raises LpfError on unknown names or values."""
        known = {f.name: f for f in fields(self)}
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
        return replace(self, **changes)
