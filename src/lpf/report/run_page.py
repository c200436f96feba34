"""Everything the report page of one run directory shows, gathered into one JSON-ready dict.

`load(path)` reads the run (manifest, findings.json, summary.parquet, tokens/reference/trace parts)
and the run's tokenizer, then hands arrays to the pure builders in `charts` and `drilldown`. Only
the columns a chart needs are read for the whole run (for the token histogram of a run over
HISTOGRAM_TOKENS scored tokens, for every k-th request only); top-k lists are read for the drilled-down
requests alone, so a 100k-request run stays fast. Keys the analysis may not write yet (shape,
calibrated thresholds, hypotheses, the run-level test) pass through as found; the page shows what
is there (the run-level test with its floor chart, observed against expected, when findings have one;
how many flagged requests each mechanism explains, and each drilled-down request's own mechanism).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lpf.core.errors import LpfError
from lpf.report import charts, drilldown
from lpf.report.decode import decoder
from lpf.report.scan import rows_of, scan
from lpf.run.schema import TRACE_STEP_COLUMNS
from lpf.run.store import RunDir

WORST_N = 20
# above this many scored tokens the token histogram is drawn from every k-th request (arrival order),
# so the report of a 100M-token run reads a sample of its parts' rows, not all of them
HISTOGRAM_TOKENS = 2_000_000
TRACE_COLUMNS = ["step", "request_id", "batch_size", "batch_tokens", "preempted"]


def load(path: Path, worst_n: int = WORST_N, max_points: int = charts.MAX_SCATTER_POINTS) -> dict:
    run = RunDir.open(path)
    findings = _read_json(path / "findings.json")
    if not (path / "summary.parquet").is_file():
        raise LpfError(f"{path} has findings.json but no summary.parquet: run `lpf analyze {path}` again")
    summary = pq.read_table(path / "summary.parquet")
    m = run.manifest
    th = findings.get("thresholds") or {}
    clean_th, div_th = _num(th.get("clean_abs_diff")), _num(th.get("divergent_abs_diff"))

    verdict = np.asarray(summary.column("verdict").to_pylist(), dtype=object)
    flagged_mask = np.isin(verdict, ["divergent", "corrupt"])
    scatter, shown = charts.request_scatter(
        summary.column("seq").to_numpy(zero_copy_only=False),
        summary.column("max_abs_logprob_diff").to_numpy(zero_copy_only=False),
        verdict,
        np.asarray(summary.column("request_id").to_pylist(), dtype=object),
        clean_th,
        div_th,
        max_points,
    )
    fd = summary.column("first_divergence")
    has_fd = flagged_mask & ~pc.is_null(fd).to_numpy(zero_copy_only=False)
    fd_values = fd.fill_null(-1).to_numpy(zero_copy_only=False)
    flagged_ids = summary.filter(pa.array(flagged_mask)).column("request_id").combine_chunks()

    # the drill-down's requests are chosen first, so the bulk scans can note which parts hold them
    rows = drilldown.select_worst(summary, worst_n)
    picks = summary.take(pa.array(rows, pa.int64())).to_pylist() if rows else []
    wanted = pa.array(sorted(p["request_id"] for p in picks), pa.string())
    n_scored = int(pc.sum(summary.column("n_scored_tokens")).as_py() or 0) if summary.num_rows else 0
    every = max(1, -(-n_scored // HISTOGRAM_TOKENS))
    ids = summary.column("request_id").combine_chunks()
    keep = None if every == 1 else ids.take(pa.array(np.arange(0, len(ids), every)))
    tok, tok_files = scan(run.parts("tokens"), ["request_id", "position", "engine_logprob"], wanted, keep)
    ref, ref_files = scan(run.parts("reference"), ["request_id", "position", "ref_logprob"], wanted, keep)
    trace, trace_files = scan(run.parts("trace"), TRACE_COLUMNS, wanted)
    page = {
        "kind": "run",
        "findings": {k: v for k, v in findings.items() if k != "flagged"},
        "n_flagged": int(flagged_mask.sum()),
        "manifest": _manifest_info(m),
        "charts": {
            "histogram": charts.diff_histogram(_token_abs_diff(tok, ref, ids), clean_th, div_th),
            "scatter": scatter,
            "first_divergence": charts.first_divergence_chart(fd_values[has_fd], verdict[has_fd]),
            "steps": _step_chart(trace, flagged_ids, findings),
            "run_test": charts.floor_chart(findings["run_test"]) if findings.get("run_test") else None,
        },
        "notes": {"scatter_shown": shown, "n_requests": summary.num_rows, "histogram_every": every},
        "drill": _drill(run, picks, tok_files, ref_files, trace_files),
        # the drilled-down requests' per-request mechanisms (findings' `flagged` stays out of the page)
        "mechanism_of": {
            f["request_id"]: f["mechanism"]
            for f in findings.get("flagged") or []
            if isinstance(f, dict) and f.get("mechanism") and f.get("request_id") in set(wanted.to_pylist())
        },
    }
    return page


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise LpfError(f"{path.parent} has no {path.name}: run `lpf analyze {path.parent}` first")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LpfError(f"{path}: unreadable JSON ({e.msg})") from None


def _num(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _manifest_info(m: dict) -> dict:
    eng, model, ref = m.get("engine") or {}, m.get("model") or {}, m.get("reference") or {}
    return {
        "run_id": m.get("run_id"),
        "created": m.get("created"),
        "status": m.get("status"),
        "lpf_version": m.get("lpf_version"),
        "engine": {
            "name": eng.get("name"),
            "version": eng.get("version"),
            "options": eng.get("options") or {},
            "cache": eng.get("cache"),
        },
        "model": {
            "spec": model.get("spec"),
            "architecture": model.get("architecture"),
            "weights_sha256": (model.get("weights_sha256") or "")[:12] or None,
        },
        "reference": {"spec": ref.get("spec"), "dtype": ref.get("dtype"), "implementation": ref.get("implementation")},
        "workload": m.get("workload") or {},
        "sampling": m.get("sampling") or {},
        "host": m.get("host") or {},
    }


def _token_abs_diff(tok: pa.Table | None, ref: pa.Table | None, request_ids: pa.Array) -> np.ndarray:
    """Per-token |engine - reference| for every scored token. Rows are matched on an int64 key
    (request index << 32 | position) with one sort, several times faster than a hash join on the
    string id."""
    if tok is None or ref is None:
        return np.array([])

    def keys(t: pa.Table) -> np.ndarray:
        code = pc.fill_null(pc.index_in(t.column("request_id"), value_set=request_ids), -1)
        code = code.to_numpy(zero_copy_only=False).astype(np.int64)
        pos = t.column("position").to_numpy(zero_copy_only=False).astype(np.int64)
        return np.where(code < 0, -1, (code << 32) | pos)

    tk, rk = keys(tok), keys(ref)
    order = np.argsort(rk, kind="stable")
    rk = rk[order]
    at = np.minimum(np.searchsorted(rk, tk), max(len(rk) - 1, 0))
    hit = (tk >= 0) & (rk[at] == tk) if len(rk) else np.zeros(len(tk), bool)
    e = tok.column("engine_logprob").to_numpy(zero_copy_only=False).astype(float)[hit]
    r = ref.column("ref_logprob").to_numpy(zero_copy_only=False).astype(float)[order][at[hit]]
    with np.errstate(invalid="ignore"):
        return np.abs(e - r)


def _step_chart(trace: pa.Table | None, flagged_ids: pa.Array, findings: dict) -> dict | None:
    if trace is None or trace.num_rows == 0 or not {"step", "batch_size", "batch_tokens"} <= set(trace.column_names):
        return None
    if "preempted" not in trace.column_names:
        trace = trace.append_column("preempted", pa.array([False] * trace.num_rows))
    live = trace.filter(pc.invert(pc.fill_null(trace.column("preempted"), False)))
    flagged = pc.is_in(live.column("request_id"), value_set=flagged_ids)
    live = live.append_column("flagged", pc.cast(flagged, pa.int64()))
    per = live.group_by("step").aggregate([("batch_size", "max"), ("batch_tokens", "max"), ("flagged", "sum")])
    per = per.sort_by("step")
    steps = per.column("step").to_numpy()
    # Where the analysis located each flagged request's divergence in steps, mark that step; else
    # mark the step each flagged request was first scheduled.
    div = [f.get("divergence_step") for f in findings.get("flagged") or [] if isinstance(f, dict)]
    div = np.array([d for d in div if isinstance(d, int) and not isinstance(d, bool)], dtype=np.int64)
    if div.size:
        marks, label = div, "flagged requests first diverging here"
    else:
        marks = live.filter(flagged).group_by("request_id").aggregate([("step", "min")]).column("step_min").to_numpy()
        label = "flagged requests scheduled first here"
    started = np.zeros(len(steps))
    marks = marks[np.isin(marks, steps)]
    if marks.size:
        np.add.at(started, np.searchsorted(steps, marks), 1)
    onset = ((findings.get("shape") or {}).get("onset") or {}).get("step")
    return charts.step_series(
        steps,
        per.column("batch_size_max").to_numpy(zero_copy_only=False),
        per.column("batch_tokens_max").to_numpy(zero_copy_only=False),
        per.column("flagged_sum").to_numpy(zero_copy_only=False),
        started,
        label,
        onset if isinstance(onset, int) else None,
    )


def _drill(run: RunDir, picks: list[dict], tok_files: list[str], ref_files: list[str], trace_files: list[str]) -> dict:
    ids = [p["request_id"] for p in picks]
    # a tokens part and its requests part share a name (the store commits them as a pair)
    req_files = [
        str(run.path / "requests" / Path(f).name) for f in tok_files if (run.path / "requests" / Path(f).name).is_file()
    ]
    req = rows_of(
        req_files,
        ["request_id", "prompt_token_ids", "output_text", "finish_reason", "oracle_expected", "oracle_ok"],
        ids,
    )
    requests = {r["request_id"]: r for r in req.to_pylist()} if req is not None else {}
    tokens = rows_of(
        tok_files,
        ["request_id", "position", "token_id", "engine_logprob", "engine_topk_ids", "engine_topk_logprobs"],
        ids,
    )
    reference = rows_of(
        ref_files, ["request_id", "position", "ref_logprob", "ref_rank", "ref_topk_ids", "ref_topk_logprobs"], ids
    )
    trace = rows_of(trace_files, ["request_id", *TRACE_STEP_COLUMNS], ids)
    decode, decode_text, note = decoder(run.manifest)
    out = drilldown.build(picks, requests, tokens, reference, trace, decode, decode_text)
    out["tokenizer_note"] = note
    return out
