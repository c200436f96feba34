"""Aligning two sides' activations op by op: relative errors, each op's dtype floor, the first departure.

Pure numpy over `ops.Activations` (no torch, no I/O). Contract:
- `rel_errors(a, b)`: per op both sides have, per position both have, ||a - b|| / max(||a||, ||b||,
  tau) (tau: a millionth of the op's median norm on side b, so rows that are zero on both sides
  compare as equal and a zero row against a non-zero one as 1.0); rows of different sizes are
  reported in `mismatched` instead.
- `add_scores(acts, geometry)`: the attention weights of each query over its context (softmax of
  q . k * scale per head, GQA heads sharing their kv head), derived the same way on every side from
  its captured q and k, as op `...scores`.
- `floors(growth, dtype)`: an op's floor at a dtype is `SAFETY * max(1, growth) * eps(dtype)`, where
  its growth is how many float32 epsilons the float32 reference itself is off the float64 gold there
  (`growth(ref_vs_gold)`): rounding accumulates through the forward pass, and this is how much of it
  an honest implementation of the same op carries.
- `first_departure(errors, floors, order)`: the earliest position at which any op departs beyond its
  floor, and there the first op in execution order (`order`); None when nothing departs. Earliest
  position first: a departure at position p can only reach later positions (through the state and
  the KV cache) and later ops, so this one has no departing cause before it.
- `summary(errors, floors, order)`: per op (in order) its largest error, where it is, the floor and
  the first departing position: the chart of the departure along the forward pass.
"""

from __future__ import annotations

import numpy as np

from lpf.locate.ops import Activations, split_op

EPS = {
    "float64": float(np.finfo(np.float64).eps),
    "float32": float(np.finfo(np.float32).eps),
    "bfloat16": 2.0**-7,
    "float16": float(np.finfo(np.float16).eps),
}
SAFETY = 64.0  # honest float32 implementations measured within ~8x of the reference's own error (docs)
GOLD_TOLERANCE = 1024  # float32 epsilons: the most a float32 forward of these depths rounds off the gold


def rel_errors(a: Activations, b: Activations, ops: list[str] | None = None):
    errors: dict[str, dict[int, float]] = {}
    mismatched: dict[str, str] = {}
    for op in ops if ops is not None else list(a.data):
        da, db = a.get(op), b.get(op)
        common = sorted(set(da) & set(db))
        if not common:
            continue
        norms_b = [float(np.linalg.norm(db[p])) for p in common]
        tau = max(1e-6 * float(np.median(norms_b)), 1e-300)
        out = {}
        for p in common:
            x, y = da[p], db[p]
            if x.shape != y.shape:
                mismatched[op] = f"{a.side} has {x.size} values per position, {b.side} {y.size}"
                out = {}
                break
            d = float(np.linalg.norm(x - y))
            out[p] = 0.0 if d == 0.0 else d / max(float(np.linalg.norm(x)), float(np.linalg.norm(y)), tau)
        if out:
            errors[op] = out
    return errors, mismatched


def norms(acts: Activations, op: str, position: int) -> float | None:
    v = acts.get(op).get(position)
    return None if v is None else float(np.linalg.norm(v))


def add_scores(acts: Activations, geometry: dict[int, tuple[int, int, int, float]]) -> None:
    for op in [o for o in acts.order if o.rpartition(".")[2] == "q"]:
        layer, _ = split_op(op)
        kop = op[:-1] + "k"
        if layer not in geometry or kop not in acts:
            continue
        heads, kv_heads, hd, scale = geometry[layer]
        qs, ks = acts.get(op), acts.get(kop)
        if not ks or min(ks) != 0:
            continue
        top = max(ks)
        if set(range(top + 1)) - set(ks):
            continue
        K = np.stack([ks[p] for p in range(top + 1)])
        if K.shape[1] != kv_heads * hd:
            continue
        K = K.reshape(top + 1, kv_heads, hd)
        group = max(1, heads // max(kv_heads, 1))
        for p in sorted(qs):
            if p > top or qs[p].size != heads * hd:
                continue
            q = qs[p].reshape(heads, hd)
            s = np.einsum("hd,thd->ht", q, np.repeat(K[: p + 1], group, axis=1)) * scale
            s = np.exp(s - s.max(axis=1, keepdims=True))
            acts.put(op[:-1] + "scores", p, s / s.sum(axis=1, keepdims=True))
        vop = op[:-1] + "v"
        acts.place_after(op[:-1] + "scores", vop if vop in acts else kop)


def growth(ref_vs_gold: dict[str, dict[int, float]]) -> dict[str, float]:
    return {op: max(errs.values()) / EPS["float32"] for op, errs in ref_vs_gold.items() if errs}


def floors(growths: dict[str, float], dtype: str, ops) -> dict[str, float]:
    eps = EPS.get(dtype, EPS["float32"])
    return {op: SAFETY * max(1.0, growths.get(op, 1.0)) * eps for op in ops}


def first_departure(errors, floor_of, order: list[str]) -> dict | None:
    rank = {op: i for i, op in enumerate(order)}
    best = None
    for op, errs in errors.items():
        f = floor_of.get(op)
        if f is None:
            continue
        for p in sorted(errs):
            if errs[p] > f:
                key = (p, rank.get(op, len(rank)))
                if best is None or key < best[0]:
                    best = (key, op, p, errs[p], f)
                break
    if best is None:
        return None
    _, op, p, err, f = best
    return {"op": op, "position": p, "rel_error": err, "floor": f, "ratio": err / f}


def summary(errors, floor_of, order: list[str]) -> list[dict]:
    out = []
    for op in order:
        errs = errors.get(op)
        if not errs:
            continue
        worst = max(errs, key=errs.get)
        f = floor_of.get(op)
        first = next((p for p in sorted(errs) if f is not None and errs[p] > f), None)
        out.append(
            {
                "op": op,
                "max_rel_error": errs[worst],
                "at": worst,
                "floor": f,
                "ratio": None if not f else errs[worst] / f,
                "first_departure": first,
                "positions": len(errs),
            }
        )
    return out
