"""Which request and which output position `lpf locate` looks at, and the tokens it replays.

Contract: `choose_target(run, request_id=None, position=None) -> dict` with `request_id`,
`output_position` (the output token whose logprob is judged), `row` (the absolute position of the row
that predicts it: prompt length + output position - 1; the replay and the reference run up to it),
`prompt_len`, `ids` (prompt + output tokens), `why` (how it was chosen), `verdict` and
`max_abs_logprob_diff` (from the analysis, None when the request was not flagged). Default: the
worst flagged request of findings.json (its list is worst first) at its first divergence; else the
request whose prompt departs first when only prompt positions are flagged (output position 0: the
row after the whole prompt); else (nothing flagged: noise, or a run-level `systematic` verdict) the
request with the largest |logprob diff| of summary.parquet, at that output position. A request given
alone: its first divergence, else its position of largest |logprob diff|. Errors (`LpfError`, one line): no findings yet, nothing
flagged and no request given, an unknown request, a position outside its outputs, a request that
failed (no tokens to replay).
"""

from __future__ import annotations

import json

import pyarrow.compute as pc

from lpf.core.errors import LpfError


def _findings(run) -> dict:
    try:
        return json.loads((run.path / "findings.json").read_text())
    except (OSError, ValueError):
        raise LpfError(f"{run.path} has no findings.json: run `lpf analyze {run.path}` first") from None


def choose_target(run, request_id: str | None = None, position: int | None = None) -> dict:
    findings = _findings(run) if request_id is None or position is None else {}
    flagged = {f["request_id"]: f for f in findings.get("flagged") or []}
    why = "given"
    if request_id is None:
        if findings.get("flagged"):
            first = findings["flagged"][0]
            request_id, why = first["request_id"], f"the worst flagged request ({first['verdict']})"
        else:
            prompt = (findings.get("prompt") or {}).get("flagged") or []
            if prompt:
                request_id, why = prompt[0]["request_id"], "the worst request whose prompt positions depart"
                position = 0 if position is None else position
            else:
                request_id, why = _largest_diff(run), "nothing is flagged: the request with the largest |logprob diff|"
    rows = run.read("requests", ["request_id", "prompt_token_ids", "output_token_ids", "error"])
    rows = rows.filter(pc.equal(rows.column("request_id"), request_id)).to_pylist()
    if not rows:
        raise LpfError(f"request {request_id!r} is not in {run.path}")
    r = rows[0]
    if r["error"] is not None or not r["output_token_ids"]:
        raise LpfError(f"request {request_id} has no output tokens to replay ({r['error'] or 'empty output'})")
    outputs = list(r["output_token_ids"])
    f = flagged.get(request_id)
    if position is None:
        if f is not None and f.get("first_divergence") is not None:
            position, why = int(f["first_divergence"]), why + ", its first divergence"
        else:
            position, why = _worst_position(run, request_id, len(outputs)), why + ", its largest |logprob diff|"
    if not 0 <= position < len(outputs):
        raise LpfError(f"--position {position}: request {request_id} has output positions 0..{len(outputs) - 1}")
    prompt = list(r["prompt_token_ids"])
    return {
        "request_id": request_id,
        "output_position": position,
        "row": len(prompt) + position - 1,
        "prompt_len": len(prompt),
        "ids": prompt + outputs,
        "why": why,
        "verdict": f.get("verdict") if f else None,
        "max_abs_logprob_diff": f.get("max_abs_logprob_diff") if f else None,
    }


def _largest_diff(run) -> str:
    path = run.path / "summary.parquet"
    if not path.is_file():
        raise LpfError(
            f"{run.path}: no request is flagged and no summary.parquet: nothing to locate (name one with --request)"
        )
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["request_id", "max_abs_logprob_diff"]).to_pylist()
    scored = [r for r in t if r["max_abs_logprob_diff"] is not None]
    if not scored:
        raise LpfError(f"{run.path}: no request has reference scores: nothing to locate")
    return max(scored, key=lambda r: (r["max_abs_logprob_diff"], r["request_id"]))["request_id"]


def _worst_position(run, request_id: str, n_outputs: int) -> int:
    """The output position of the request's largest |engine - reference| logprob (the last one when
    nothing was scored)."""
    if not run.has("reference"):
        return n_outputs - 1
    eng = run.read("tokens", ["request_id", "position", "engine_logprob"])
    ref = run.read("reference", ["request_id", "position", "ref_logprob"])
    e = {
        r["position"]: r["engine_logprob"]
        for r in eng.filter(pc.equal(eng.column("request_id"), request_id)).to_pylist()
    }
    diffs = [
        (abs(e[r["position"]] - r["ref_logprob"]), -r["position"])
        for r in ref.filter(pc.equal(ref.column("request_id"), request_id)).to_pylist()
        if e.get(r["position"]) is not None and r["ref_logprob"] is not None
    ]
    return -max(diffs)[1] if diffs else n_outputs - 1
