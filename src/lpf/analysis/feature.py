"""`Feature`: one candidate mechanism's value per request, and the words its hypothesis sentence uses.

A boolean says what a request with it did ("started with a decode step"); a numeric names its
quantity ("state slot id") and `hypotheses` splits it at the best threshold. Values are aligned to the
requests sorted by `seq`. A feature about what another request did to this one (its state overwritten)
names that request per request in `writer` (None where it does not hold), which the per-request
mechanism (`mechanisms`) reports. `descriptive` marks what a request *is* (its prompt length, rollout
index, arrival index) rather than what the engine did to it: `mechanisms` lets such a feature explain
requests only as a last resort.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Feature:
    name: str
    kind: str  # "bool" | "numeric"
    values: np.ndarray  # bool, or float (NaN = unknown)
    phrase: str  # bool: what a request with it did; numeric: the quantity's name
    stride: int | None = None  # numeric slot features: elements per slot, to state splits as offsets
    template: str | None = None  # numeric: the split's words, "{op}" and "{cut}" filled in ("arrived while ...")
    writer: np.ndarray | None = None  # object: per request, the request whose write it suffered, or None
    descriptive: bool = False  # what the request is, not what happened to it (`mechanisms`)
