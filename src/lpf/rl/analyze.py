"""`lpf rl analyze`: a validated dump in, the per-step series and the RL findings out.

`analyze(dump, ...)` is pure (arrays and tables in, a table and a dict out). `write_outputs` writes
the RL directory of the contract: rl_steps.parquet (one row per step: n_responses, n_tokens, the
STEP_METRICS, max_abs_logprob_diff, max_response_z, robust_z, spike, and with a third opinion the
per-step curves of `lpf.rl.attribution.step_series`) and rl_findings.json (kind "rl", counts,
bad_rows, skipped_rows, ignored_files, spikes with the implicated requests and their first off
positions, period, hypotheses, noise_floor; with a third opinion each spike's `side`, `sides` and
`request_sides`, and a `reference` block); `add_causes` adds the mismatch's causes (`lpf.rl.explain`:
rl_findings.json `causes`, rl_steps.parquet cause_<name> shares and abs_logprob_diff_sum); the
command line then draws report.html from them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lpf.core.errors import LpfError
from lpf.core.jsonsafe import finite
from lpf.rl import attribution, hypotheses, spikes
from lpf.rl.dump import Dump
from lpf.rl.metrics import STEP_METRICS, first_over, response_max_abs, series, token_terms

MAX_REQUESTS_LISTED = 200  # per spike; the counts stay exact


def detect(
    dump: Dump,
    metric: str = "k3_kl",
    z_threshold: float = spikes.Z_THRESHOLD,
    min_scale: float = spikes.MIN_SCALE,
    abs_min: float = spikes.ABS_MIN,
) -> dict:
    """The spikes, before anything is said about them: per step (`steps`, `spike`, `z`, ...), per response
    (`implicated`, `outlier`, ...) and per token (`off`, `quiet`). `lpf.rl.explain` judges the causes on
    the same spikes, so a spike this reports is never floor there."""
    if metric not in STEP_METRICS:
        raise LpfError(f"unknown metric {metric!r}; choose from {', '.join(STEP_METRICS)}")
    resp = dump.responses
    resp_step = resp.column("step").to_numpy()
    steps, resp_code = np.unique(resp_step, return_inverse=True)
    tok_code = resp_code[dump.tok_resp]
    terms = token_terms(dump.tok_rollout, dump.tok_trainer)
    per_step = series(tok_code, resp_code, dump.tok_resp, dump.resp_group, steps.size, terms)
    n_resp_step = np.bincount(resp_code, minlength=steps.size)

    n = resp.num_rows
    resp_max = response_max_abs(dump.tok_resp, terms["abs_d"], n)
    # responses against the responses' own floor: when every step carries a few lying responses
    # (many rollouts per step), no step stands out among steps, but those responses still do
    own = np.arange(n)
    per_resp = series(dump.tok_resp, own, dump.tok_resp, own, n, terms)[metric]
    rz, rfloor = spikes.robust_z(spikes.log_badness(metric, per_resp), min_scale)
    outlier = (np.nan_to_num(rz, nan=-np.inf) >= z_threshold) & (resp_max > abs_min)
    max_rz = np.full(steps.size, -np.inf)
    np.maximum.at(max_rz, resp_code, np.nan_to_num(rz, nan=-np.inf))

    z, floor = spikes.robust_z(spikes.log_badness(metric, per_step[metric]), min_scale)
    step_max = np.zeros(steps.size)
    np.maximum.at(step_max, tok_code, terms["abs_d"])
    by_step = np.nan_to_num(z, nan=-np.inf) >= z_threshold
    by_resp = np.bincount(resp_code, weights=outlier, minlength=steps.size) > 0
    # a spike is an outlier (the step among steps, or a response of it among responses) AND material:
    # some token off by more than rounding
    spike = (by_step | by_resp) & (step_max > abs_min)

    quiet = ~outlier[dump.tok_resp] & ~spike[tok_code]
    thr = spikes.token_threshold(terms["abs_d"], quiet if quiet.any() else ~outlier[dump.tok_resp], abs_min)
    off = terms["abs_d"] > thr
    # a step that spiked as a whole (no single outlier response) implicates its responses with off tokens
    implicated = outlier | ((resp_max > thr) & (spike & ~by_resp)[resp_code])
    return dict(
        steps=steps,
        resp_code=resp_code,
        tok_code=tok_code,
        terms=terms,
        per_step=per_step,
        n_resp_step=n_resp_step,
        n=n,
        resp_max=resp_max,
        rz=rz,
        rfloor=rfloor,
        outlier=outlier,
        max_rz=max_rz,
        z=z,
        floor=floor,
        step_max=step_max,
        by_step=by_step,
        by_resp=by_resp,
        spike=spike,
        quiet=quiet,
        thr=thr,
        off=off,
        implicated=implicated,
    )


def analyze(
    dump: Dump,
    metric: str = "k3_kl",
    z_threshold: float = spikes.Z_THRESHOLD,
    min_scale: float = spikes.MIN_SCALE,
    abs_min: float = spikes.ABS_MIN,
    detected: dict | None = None,
) -> tuple[pa.Table, dict]:
    det = detected or detect(dump, metric, z_threshold, min_scale, abs_min)
    resp = dump.responses
    steps, resp_code, tok_code, terms, per_step = (
        det[k] for k in ("steps", "resp_code", "tok_code", "terms", "per_step")
    )
    n_resp_step, n, rfloor = det["n_resp_step"], det["n"], det["rfloor"]
    outlier, max_rz, z, floor, step_max = (det[k] for k in ("outlier", "max_rz", "z", "floor", "step_max"))
    by_step, by_resp, spike, quiet, thr, off = (det[k] for k in ("by_step", "by_resp", "spike", "quiet", "thr", "off"))
    implicated = det["implicated"]
    first = first_over(dump.tok_resp, dump.tok_pos, off, n)

    ids = resp.column("request_id").to_pylist()
    third = dump.tok_reference is not None
    if third:
        sides, noise = attribution.attribute(
            dump.tok_resp, n, dump.tok_rollout, dump.tok_trainer, dump.tok_reference, quiet, abs_min
        )
    spike_list = []
    for si in np.flatnonzero(spike):
        members = np.flatnonzero((resp_code == si) & implicated)
        pos = first[members]
        counts = {str(p): int(c) for p, c in zip(*np.unique(pos, return_counts=True))}
        entry = {
            "step": int(steps[si]),
            "robust_z": float(z[si]),
            "max_response_z": float(max_rz[si]),
            "by": "step" if by_step[si] and not by_resp[si] else "responses" if not by_step[si] else "both",
            "value": float(per_step[metric][si]),
            "n_responses": int(n_resp_step[si]),
            "n_implicated": int(members.size),
            "requests": [ids[i] for i in members[:MAX_REQUESTS_LISTED]],
            "positions": counts,
        }
        if third:
            entry["side"], entry["sides"] = attribution.spike_side(sides[members])
            entry["request_sides"] = [attribution.SIDES[sides[i]] for i in members[:MAX_REQUESTS_LISTED]]
        spike_list.append(entry)

    extra = (
        attribution.step_series(tok_code, steps.size, dump.tok_rollout, dump.tok_trainer, dump.tok_reference)
        if third
        else {}
    )
    step_table = pa.table(
        {
            "step": pa.array(steps, pa.int64()),
            "n_responses": pa.array(n_resp_step, pa.int64()),
            "n_tokens": pa.array(per_step["n_tokens"], pa.int64()),
            **{k: pa.array(per_step[k], pa.float64()) for k in STEP_METRICS},
            **{k: pa.array(v, pa.float64()) for k, v in extra.items()},
            "max_abs_logprob_diff": pa.array(step_max, pa.float64()),
            "max_response_z": pa.array(np.where(np.isfinite(max_rz), max_rz, np.nan), pa.float64()),
            "robust_z": pa.array(z, pa.float64()),
            "spike": pa.array(spike),
        }
    )
    stride = _stride(dump)
    in_spikes = implicated & spike[resp_code]
    span = int(steps.max() - steps.min())
    empty = (
        np.setdiff1d(np.arange(int(steps.min()), int(steps.max()) + 1), steps)
        if span <= spikes.MAX_GRID
        else np.array([], dtype=np.int64)
    )
    findings = {
        "kind": "rl",
        "source": dump.source,
        "format": dump.fmt,
        "metric": metric,
        "verdict": "spikes" if spike.any() else "clean",
        "n_steps": int(steps.size),
        "n_responses": int(n),
        "n_tokens": int(terms["d"].size),
        "n_spikes": int(spike.sum()),
        "first_spike_step": int(steps[spike][0]) if spike.any() else None,
        "spike_steps": [int(s) for s in steps[spike]],
        "empty_steps": [int(s) for s in empty[:1000]],
        "n_empty_steps": int(empty.size) if span <= spikes.MAX_GRID else None,
        "bad_rows": dump.bad_rows,
        "skipped_rows": dump.skipped_rows,
        "ignored_files": dump.ignored_files,
        "spikes": spike_list,
        "period": spikes.period(steps, spike, np.bincount(resp_code, weights=implicated, minlength=steps.size)),
        "implicated": {
            "n": int(implicated.sum()),
            "in_spike_steps": int(in_spikes.sum()),
            "outside_spike_steps": int((implicated & ~spike[resp_code]).sum()),
            "first_divergence": _positions(first[implicated]),
        },
        "hypotheses": hypotheses.rank(resp, implicated, stride),
        "noise_floor": {
            "metric": metric,
            "scale": "log10",
            "median": floor["median"],
            "mad": floor["mad"],
            "scale_used": floor["scale"],
            "min_scale": min_scale,
            "z_threshold": z_threshold,
            "median_value": None if floor["median"] is None else 10 ** floor["median"],
            "responses": {"median": rfloor["median"], "mad": rfloor["mad"], "scale_used": rfloor["scale"]},
            "token_abs_diff_threshold": thr,
            "token_abs_min": abs_min,
        },
        "metrics": {k: _stats(per_step[k]) for k in STEP_METRICS},
        "reference": _reference(dump, spike_list, sides[implicated & spike[resp_code]], noise) if third else None,
        "simulation": dump.metadata or None,
    }
    findings["summary"] = _summary(findings)
    return step_table, finite(findings)


def _reference(dump: Dump, spike_list: list[dict], member_sides: np.ndarray, noise: dict) -> dict:
    desc = (dump.reference or {}).get("reference") or {}
    model = desc.get("spec") or desc.get("path") or "?"
    spike_sides = [s["side"] for s in spike_list]
    return {
        "model": model,
        "dtype": desc.get("dtype"),
        "file": (dump.reference or {}).get("file"),
        "spikes": {s: spike_sides.count(s) for s in attribution.SIDES},
        "responses": {s: int((member_sides == i).sum()) for i, s in enumerate(attribution.SIDES)},
        "noise": noise,
        "sentence": attribution.sentence(spike_sides, model),
    }


def _stride(dump: Dump) -> int | None:
    if "state_slot_stride" in dump.responses.column_names:
        vals = pc.unique(dump.responses.column("state_slot_stride").drop_null()).to_pylist()
        if len(vals) == 1 and isinstance(vals[0], (int, float)) and vals[0] > 0:
            return int(vals[0])
    return None


def _positions(first: np.ndarray) -> dict:
    if first.size == 0:
        return {"positions": {}, "median": None}
    p, c = np.unique(first, return_counts=True)
    return {"positions": {str(int(a)): int(b) for a, b in zip(p, c)}, "median": float(np.median(first))}


def _stats(v: np.ndarray) -> dict:
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"median": None, "max": None}
    return {"median": float(np.median(v)), "max": float(v.max())}


def _summary(f: dict) -> str:
    if not f["n_spikes"]:
        return (
            f"no spike: all {f['n_steps']} steps within the noise floor of {f['metric']} "
            f"(robust z < {f['noise_floor']['z_threshold']:g})"
        )
    shown = ", ".join(map(str, f["spike_steps"][:12])) + (", ..." if f["n_spikes"] > 12 else "")
    s = f"{f['n_spikes']}/{f['n_steps']} steps spike in {f['metric']} (steps {shown})"
    if f["n_spikes"] == f["n_steps"] > 1:
        s += "; every step, from the first"
    shapes = f["period"].get("shapes") or {}
    if len(shapes) > 1:
        s += f"; {len(shapes)} spike shapes, not one rhythm: " + ", ".join(
            f"{k.replace('_', ' ')} at steps {', '.join(map(str, v['steps'][:8]))}"
            + (f" (period {v['period']:.3g})" if v["period"] is not None else "")
            for k, v in shapes.items()
        )
    elif f["period"]["period"] is not None:
        s += f"; period {f['period']['period']:.3g} steps (confidence {f['period']['confidence']:.2f})"
    s += f"; {f['implicated']['in_spike_steps']} responses implicated"
    fd = f["implicated"]["first_divergence"]["median"]
    if fd is not None:
        s += f", median first off position {fd:g}"
    if f.get("reference"):
        s += f"; {f['reference']['sentence']}"
    return s


def add_causes(step_table: pa.Table, findings: dict, cause_steps: pa.Table, block: dict) -> pa.Table:
    """The causes section (`lpf.rl.explain`) into the findings and its per-step shares into the step
    table as cause_<name> columns (both tables hold the dump's steps in the same order). Each spike gets
    the causes named at its step; spikes of different causes are different shapes, and the period is
    then told per shape (two causes are not one rhythm)."""
    if cause_steps.column("step").to_pylist() != step_table.column("step").to_pylist():
        raise ValueError("cause steps do not line up with the step table")
    for name in cause_steps.column_names:
        if name.startswith("share_"):
            step_table = step_table.append_column("cause_" + name[len("share_") :], cause_steps.column(name))
    step_table = step_table.append_column("abs_logprob_diff_sum", cause_steps.column("mass"))
    findings["causes"] = block
    at = {e["step"]: e for e in block.get("steps", [])}
    for sp in findings["spikes"]:
        e = at.get(sp["step"]) or {}
        sp["causes"] = e.get("named", [])
        sp["shape"] = "+".join(sp["causes"]) or "unexplained"
    _shapes(findings, step_table)
    findings["summary"] = _summary(findings) + f"; causes: {block['summary']}"
    return step_table


def _shapes(findings: dict, step_table: pa.Table) -> None:
    """findings["period"]["shapes"]: per spike shape (the causes named at the step), its steps and its own
    period; with more than one shape the pooled period is not reported as the spikes' rhythm."""
    shapes: dict = {}
    for sp in findings["spikes"]:
        shapes.setdefault(sp["shape"], []).append(sp["step"])
    per = findings["period"]
    per["shapes"] = {}
    steps = step_table.column("step").to_numpy()
    for shape, at in shapes.items():
        spike = np.isin(steps, at)
        p = spikes.period(steps, spike, spike.astype(np.float64))
        per["shapes"][shape] = {"steps": at, "period": p["period"], "confidence": p["confidence"]}
    if len(shapes) > 1:
        per["pooled_period"], per["period"], per["confidence"] = per["period"], None, 0.0
        per["note"] = f"{len(shapes)} spike shapes (different causes): no single rhythm"


def write_outputs(out: Path, step_table: pa.Table, findings: dict) -> None:
    """Write the RL directory's data (`rl_steps.parquet`, `rl_findings.json`, atomically): the
    findings are on disk before anyone draws a report from them."""
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(step_table, out / "rl_steps.parquet")
    tmp = out / "rl_findings.json.tmp"
    tmp.write_text(json.dumps(findings, indent=2))
    tmp.replace(out / "rl_findings.json")
