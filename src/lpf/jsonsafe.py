"""JSON has no inf/NaN: `finite(obj)` returns a copy of nested dicts/lists with them as null."""

from __future__ import annotations

import math


def finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
