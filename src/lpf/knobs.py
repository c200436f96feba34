"""Engine knobs from the command line: `-E KEY=VALUE` pairs plus the named knob flags, as one dict.

Contract: `engine_options(pairs, **knobs)` returns {key: value} with every `-E` pair (values stay
strings: the engine's `Options.parse` converts and validates them) and every named knob the user gave
(None = not given, left out). `inject` is a list of drills, joined with commas as the engine expects.
Raises LpfError for a pair without `=`. Shared by `audit`/`run`, `repeat` and `serve`.
"""

from __future__ import annotations

from lpf.errors import LpfError


def engine_options(pairs, inject=(), **knobs) -> dict:
    options = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep:
            raise LpfError(f"--engine-option expects KEY=VALUE, got {kv!r}")
        options[key.strip()] = value.strip()
    knobs["inject"] = ",".join(inject) if inject else None
    options.update({k: v for k, v in knobs.items() if v is not None})
    return options
