"""JSON has no inf/NaN: `finite(obj)` returns a copy of nested dicts/lists/tuples with them as null
and numpy scalars as plain Python numbers."""

from __future__ import annotations

import math


def finite(obj):
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # numpy scalar
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return obj
