"""Which response metadata goes with the implicated responses: contingency tests, ranked, in words.

Pure numpy. For every metadata column of the responses table (state slot range, rollout index,
prompt id, and any other scalar column a dump carries; not response length or finish reason, which
the failure itself changes), the best feature of that
column is found: for numbers the split `col >= X` (or `col <= X`), for text/bools the single value,
that most enriches implicated responses, scored by the run analysis's one-sided Fisher exact test
(`stats.hypergeom_tail`, every split of a column in one call). The best split is searched, so its p-value is optimistic:
it ranks explanations, it does not prove one. A slot split with a known state slot stride also names
the power of two the offset `slot * stride` crosses there, the signature of an offset overflow.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from lpf.analysis.stats import hypergeom_tail

_PREFER = {"state_slot_max": 0, "state_slot_min": 1}
# bookkeeping, and outcomes of the generation (a corrupted state makes responses end early and score
# badly: their length, truncation, status and reward are symptoms, not mechanisms)
_SKIP = {
    "row",
    "step",
    "request_id",
    "n_scored",
    "state_slot_stride",
    "n_tokens",
    "finish_reason",
    "schema_version",
    "truncated",
    "status",
    "score",
    "reward",
}
_MAX_SPLITS = 512


def _best_numeric(name: str, x: np.ndarray, flag: np.ndarray) -> dict | None:
    ok = np.isfinite(x)
    if ok.sum() < 2:
        return None
    vals = np.unique(x[ok])
    if vals.size < 2:
        return None
    if vals.size > _MAX_SPLITS:
        vals = np.unique(np.quantile(x[ok], np.linspace(0, 1, _MAX_SPLITS)))
    n, f = int(ok.sum()), int(flag[ok].sum())
    splits = [(thr, op) for thr in vals[1:] for op in (">=", "<")]

    def select(thr, op):
        return ok & ((x >= thr) if op == ">=" else (x < thr))

    counts = np.array([(int(s.sum()), int((s & flag).sum())) for s in (select(*sp) for sp in splits)])
    ps = hypergeom_tail(counts[:, 1], n, counts[:, 0], f)
    i = int(np.argmin(ps))  # the first of the smallest, in the splits' order
    thr, op = splits[i]
    return {"column": name, "op": op, "value": float(thr), "sel": select(thr, op), "p_value": float(ps[i])}


def _best_categorical(name: str, values: list, flag: np.ndarray) -> dict | None:
    ok = np.array([v is not None for v in values])
    arr = np.array([str(v) for v in values], dtype=object)
    cats = list(set(arr[ok & flag]))
    if len(set(arr[ok])) < 2 or not cats:
        return None
    n, f = int(ok.sum()), int(flag[ok].sum())
    counts = np.array([(int(s.sum()), int((s & flag).sum())) for s in (ok & (arr == c) for c in cats)])
    ps = hypergeom_tail(counts[:, 1], n, counts[:, 0], f)
    i = int(np.argmin(ps))  # the first of the smallest
    return {"column": name, "op": "==", "value": cats[i], "sel": ok & (arr == cats[i]), "p_value": float(ps[i])}


def rank(responses: pa.Table, implicated: np.ndarray, stride: int | None = None, top: int = 8) -> list[dict]:
    """Hypotheses (contract shape: rank, feature, sentence, flagged_with/total, clean_with/total,
    p_value, score), best first. Empty when nothing is implicated or nothing varies."""
    flag = np.asarray(implicated, dtype=bool)
    if not flag.any() or flag.all():
        return []
    cands = []
    for name in responses.column_names:
        if name in _SKIP:
            continue
        col = responses.column(name)
        t = col.type
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            x = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
            best = _best_numeric(name, x, flag)
        elif pa.types.is_string(t) or pa.types.is_boolean(t):
            best = _best_categorical(name, col.to_pylist(), flag)
        else:
            continue
        if best is not None:
            cands.append(best)
    out, seen = [], []
    # equal evidence: the slot the request ran in last beats the one it started in, then column order
    for c in sorted(cands, key=lambda c: (c["p_value"], _PREFER.get(c["column"], 9))):
        sel = c.pop("sel")
        if any(np.array_equal(sel, s) for s in seen):  # the same responses under another name
            continue
        seen.append(sel)
        fw, ft = int((sel & flag).sum()), int(flag.sum())
        cw, ct = int((sel & ~flag).sum()), int((~flag).sum())
        if fw == 0:
            continue
        x = responses.column(c["column"]).to_pylist()
        out.append(
            {
                "feature": _feature(c),
                "sentence": _sentence(c, fw, ft, cw, ct, x, sel & flag, stride),
                "flagged_with": fw,
                "flagged_total": ft,
                "clean_with": cw,
                "clean_total": ct,
                "p_value": c["p_value"],
                "score": float(-math.log10(max(c["p_value"], 1e-300))),
            }
        )
    for i, h in enumerate(out[:top], 1):
        h["rank"] = i
    return [{"rank": h["rank"], **{k: v for k, v in h.items() if k != "rank"}} for h in out[:top]]


def _fmt(v) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _feature(c: dict) -> str:
    return f"{c['column']} {c['op']} {_fmt(c['value'])}"


_LABEL = {
    "state_slot_max": "ran in state slots",
    "state_slot_min": "started in state slots",
    "rollout": "had rollout index",
    "n_tokens": "had response length",
    "prompt_id": "came from prompt",
}


def _sentence(c: dict, fw: int, ft: int, cw: int, ct: int, x: list, sel_flag: np.ndarray, stride: int | None) -> str:
    name = c["column"]
    if c["op"] == "==":
        what = f"{_LABEL.get(name, name + ' =')} {c['value']}"
    else:
        vals = [v for v, s in zip(x, sel_flag) if s and v is not None]
        lo, hi = _fmt(float(min(vals))), _fmt(float(max(vals)))
        rng = lo if lo == hi else f"{lo}..{hi}"
        what = f"{_LABEL.get(name, name)} {rng} ({name} {c['op']} {_fmt(c['value'])})"
    s = f"{fw}/{ft} implicated responses {what}; {cw}/{ct} other responses did"
    if name.startswith("state_slot") and c["op"] == ">=" and stride:
        slot = int(c["value"])
        k = int(math.floor(math.log2(slot * stride))) if slot > 0 else 0
        if slot > 0 and (slot - 1) * stride < 2**k <= slot * stride:
            s += (
                f"; slot {slot} is the first whose offset slot*stride ({slot} x {stride}) reaches 2^{k}: "
                f"consistent with a {k}-bit state offset overflow"
            )
    return s + "."
