"""The failure's shape: how many requests lie, from when, where in the output, how regularly.

Contract: `failure_shape(summary, requests, trace) -> dict` with the `shape` keys of findings.json:
rate (flagged / scored requests), n_flagged, onset {seq, step}, first_divergence {positions,
median, at_zero_fraction}, periodicity {period, confidence, over, ...} and clusters [{by, sentence,
...}]. `divergence_steps(trace, requests, ids, positions)` maps each (request, output position) to
the engine step that sampled it. Pure: Arrow tables in, plain data out.

The step of output position p is the earliest non-preempted trace row of the request whose
num_computed_tokens + num_scheduled_tokens - prompt_length == p (the row that completed the
tokens before p, i.e. the one that sampled it; recompute rows after a preemption come later).
Periodicity is estimated over engine steps (flagged first divergences per step) when there is a
trace, else over arrival index (flagged or not, per request).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.periodicity import estimate_period
from lpf.analysis.verdicts import by_arrival

FLAGGED = ("divergent", "corrupt")


def divergence_steps(trace: pa.Table, requests: pa.Table, ids: list[str], positions: list[int]) -> list[int | None]:
    if trace is None or not trace.num_rows or not ids:
        return [None] * len(ids)
    plen = pa.table(
        {"request_id": requests.column("request_id"), "plen": pc.list_value_length(requests.column("prompt_token_ids"))}
    )
    t = trace.filter(pc.invert(trace.column("preempted").fill_null(False)))
    t = t.filter(pc.is_in(t.column("request_id"), value_set=pa.array(ids, pa.string())))
    t = t.select(["request_id", "step", "num_computed_tokens", "num_scheduled_tokens"]).join(plen, "request_id")
    e = pc.subtract(
        pc.add(t.column("num_computed_tokens").cast(pa.int64()), t.column("num_scheduled_tokens").cast(pa.int64())),
        t.column("plen").cast(pa.int64()),
    )
    t = pa.table({"request_id": t.column("request_id"), "pos": e, "step": t.column("step")})
    first = t.group_by(["request_id", "pos"]).aggregate([("step", "min")])
    want = pa.table(
        {
            "request_id": pa.array(ids, pa.string()),
            "pos": pa.array(positions, pa.int64()),
            "i": pa.array(np.arange(len(ids))),
        }
    )
    got = want.join(first, ["request_id", "pos"]).to_pydict()
    out: list[int | None] = [None] * len(ids)
    for i, s in zip(got["i"], got["step_min"]):
        if s is not None:  # a request the trace does not cover (the join keeps it, without a step)
            out[i] = int(s)
    return out


def _clusters(rows: dict, flagged: np.ndarray, scored: np.ndarray, plen: np.ndarray) -> list[dict]:
    """`rows`: `prompt_id` (an Arrow column) and `rollout` (numpy), aligned to the masks."""
    out = []
    n_f = int(flagged.sum())
    if n_f == 0:
        return out
    # by prompt: prompts whose rollouts are all flagged (named as str() names them, a missing id
    # "None"; ties ranked by name). One hash pass over the scored requests' prompts
    scored_prompts = rows["prompt_id"].cast(pa.string()).fill_null("None").filter(pa.array(scored))
    enc = pc.dictionary_encode(scored_prompts).combine_chunks()
    code = enc.indices.to_numpy(zero_copy_only=False)
    n_all = np.bincount(code, minlength=len(enc.dictionary))
    n_hit = np.bincount(code, weights=flagged[scored].astype(np.float64), minlength=len(enc.dictionary))
    hit = np.flatnonzero(n_hit > 0)
    names = enc.dictionary.take(pa.array(hit)).to_numpy(zero_copy_only=False).astype(str)
    full = (n_hit[hit] == n_all[hit]) & (n_all[hit] > 1)
    by_name = np.argsort(np.argsort(names, kind="stable"), kind="stable")
    top = np.lexsort((by_name, -n_hit[hit]))[:5]
    out.append(
        {
            "by": "prompt",
            "n_prompts": int(hit.size),
            "all_rollouts_flagged": int(full.sum()),
            "top": [str(names[i]) for i in top],
            "sentence": f"{n_f} flagged requests come from {int(hit.size)} of {len(enc.dictionary)} prompts"
            + (f"; {int(full.sum())} prompts have every rollout flagged" if full.any() else "")
            + ".",
        }
    )
    # by rollout index
    roll = np.asarray(rows["rollout"], dtype=np.int64)
    rates = {}
    for r in np.unique(roll[scored]):
        m = scored & (roll == r)
        rates[int(r)] = float(flagged[m].sum() / max(m.sum(), 1))
    if len(rates) > 1:
        worst = max(rates, key=rates.get)
        out.append(
            {
                "by": "rollout",
                "rates": {str(k): v for k, v in rates.items()},
                "sentence": f"flagged rate by rollout index ranges {min(rates.values()):.1%}..{max(rates.values()):.1%} "
                f"(highest at rollout {worst}).",
            }
        )
    # by prompt length: quartiles of the scored requests
    pl = plen[scored]
    if pl.size >= 8 and np.unique(pl).size > 1:
        edges = np.unique(np.quantile(pl, [0, 0.25, 0.5, 0.75, 1.0]))
        bins = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            m = scored & (plen >= lo) & ((plen <= hi) if hi == edges[-1] else (plen < hi))
            bins.append(
                {"lo": float(lo), "hi": float(hi), "n": int(m.sum()), "rate": float(flagged[m].sum() / max(m.sum(), 1))}
            )
        top = max(bins, key=lambda b: b["rate"])
        out.append(
            {
                "by": "length",
                "bins": bins,
                "sentence": f"flagged rate is highest ({top['rate']:.1%}) for prompts of "
                f"{_fmt(top['lo'])}..{_fmt(top['hi'])} tokens.",
            }
        )
    return out


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3g}"


def failure_shape(summary: pa.Table, requests: pa.Table, trace: pa.Table | None) -> dict:
    verdict = summary.column("verdict")
    flagged = pc.is_in(verdict, value_set=pa.array(FLAGGED)).to_numpy(zero_copy_only=False)
    scored = pc.is_in(verdict, value_set=pa.array(["clean", "noise", "divergent", "corrupt"])).to_numpy(
        zero_copy_only=False
    )
    n_scored, n_f = int(scored.sum()), int(flagged.sum())
    req = by_arrival(requests)
    plen = pc.list_value_length(req.column("prompt_token_ids")).to_numpy(zero_copy_only=False).astype(np.float64)
    seq = summary.column("seq").to_numpy().astype(np.int64)
    at = pa.array(np.flatnonzero(flagged))  # Python objects for the flagged requests only
    fd = summary.column("first_divergence").take(at).to_pylist()
    ids = summary.column("request_id").take(at).to_pylist()
    steps = divergence_steps(trace, req, ids, [p if p is not None else 0 for p in fd])
    known = [s for s in steps if s is not None]
    fd_known = np.array([p for p in fd if p is not None], dtype=np.int64)
    positions: dict[str, int] = {}
    for p in fd_known.tolist():
        positions[str(p)] = positions.get(str(p), 0) + 1
    if trace is not None and trace.num_rows and known:
        series = np.bincount(np.asarray(known, dtype=np.int64), minlength=int(pc.max(trace.column("step")).as_py()) + 1)
        period = {**estimate_period(series[1:].astype(np.float64)), "over": "step"}
    elif n_scored:
        order = np.argsort(seq[scored])
        period = {**estimate_period(flagged[scored][order].astype(np.float64)), "over": "seq"}
    else:
        period = {"period": None, "confidence": 0.0, "over": "seq"}
    return {
        "rate": (n_f / n_scored) if n_scored else 0.0,
        "n_flagged": n_f,
        "n_scored": n_scored,
        "onset": {"seq": int(seq[flagged].min()) if n_f else None, "step": int(min(known)) if known else None},
        "first_divergence": {
            "positions": dict(sorted(positions.items(), key=lambda kv: int(kv[0]))),
            "median": float(np.median(fd_known)) if fd_known.size else None,
            "at_zero_fraction": float(np.mean(fd_known == 0)) if fd_known.size else None,
        },
        "periodicity": period,
        "clusters": _clusters(
            {
                "prompt_id": summary.column("prompt_id"),
                "rollout": summary.column("rollout").to_numpy(zero_copy_only=False),
            },
            flagged,
            scored,
            plen,
        ),
        "_divergence_steps": dict(zip(ids, steps)),
    }
