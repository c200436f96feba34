"""`lpf inspect DIR REQUEST_ID`: one request token by token, and its trace step by step.

Contract: `inspect_request(path, request_id)` returns a plain dict (what `--json` prints):
`request` (its row from requests/, plus its summary row when `lpf analyze` has run), `tokens` (per
output position: token id and text, engine vs reference logprob, |d|, reference rank, both sides'
top-k decoded; reference fields are null when the run is not rescored) and `trace` (per step: phase,
num_computed_tokens, num_scheduled_tokens, state_slot, batch_size, batch_tokens, preempted; null
when the engine writes no trace; with the engine's write log, `stray_writes` too: the state writes of
that step that landed outside the request's slot) and `mechanism` (its entry of findings.json's
`flagged`: the mechanism that explains it, `lpf.analysis.mechanisms`; null when it is not flagged or
the run is not analysed) and `overwritten_by` (the write log's entries that landed in memory it held:
step, writer, memory "state" or "kv", slot or KV block; null without a write log). Reads the parts with DuckDB and findings.json; never writes. An unknown request id
is an `LpfError` with a did-you-mean; token text falls back to ids when the run's tokenizer cannot
be loaded (the `tokenizer` key says why).
"""

from __future__ import annotations

import json
from pathlib import Path

from lpf.core.errors import LpfError, did_you_mean
from lpf.core.jsonsafe import finite
from lpf.run.schema import TRACE_STEP_COLUMNS
from lpf.run.store import RunDir


def _rows(con, sql: str, params: list) -> list[dict]:
    cur = con.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def _views(con) -> set[str]:
    return {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}


def _decoder(run: RunDir):
    """(decode(id) -> text, note): token text from the run's own tokenizer, or ids when unavailable."""
    from lpf.core.model_specs import load_tokenizer, resolve_model

    spec = run.manifest.get("model", {}).get("spec")
    try:
        tok = load_tokenizer(resolve_model(spec))
    except (LpfError, OSError, ValueError) as e:
        return (lambda i: f"<{i}>"), f"token text unavailable ({str(e).splitlines()[0]})"
    cache: dict[int, str] = {}

    def decode(i: int) -> str:
        if i not in cache:
            cache[i] = tok.decode([i])
        return cache[i]

    return decode, None


def inspect_request(path: Path | str, request_id: str) -> dict:
    from lpf.views.query import connect

    run = RunDir.open(path)
    con = connect(run)
    views = _views(con)
    if "requests" not in views:
        raise LpfError(f"{run.path} has no completed requests yet")
    req = _rows(con, "SELECT * FROM requests WHERE request_id = ?", [request_id])
    if not req:
        ids = [r[0] for r in con.execute("SELECT request_id FROM requests").fetchall()]
        raise LpfError(
            f"no request {request_id!r} in {run.path}{did_you_mean(request_id, ids)} "
            f'({len(ids)} requests; list them with lpf query {run.path} "SELECT request_id FROM requests")'
        )
    request = req[0]
    if "summary" in views:
        summ = _rows(con, "SELECT * FROM summary WHERE request_id = ?", [request_id])
        if summ:
            request["summary"] = {k: v for k, v in summ[0].items() if k not in request}
    decode, note = _decoder(run)
    has_ref = "reference" in views
    ref_cols = (
        "r.ref_logprob, r.ref_rank, r.ref_entropy, r.ref_top1_id, r.ref_topk_ids, r.ref_topk_logprobs"
        if has_ref
        else "NULL AS ref_logprob, NULL AS ref_rank, NULL AS ref_entropy, NULL AS ref_top1_id, "
        "NULL AS ref_topk_ids, NULL AS ref_topk_logprobs"
    )
    join = "LEFT JOIN reference r ON r.request_id = t.request_id AND r.position = t.position" if has_ref else ""
    tokens = _rows(
        con,
        f"""SELECT t.position, t.token_id, t.engine_logprob, t.engine_topk_ids, t.engine_topk_logprobs,
                                   {ref_cols}
                            FROM tokens t {join} WHERE t.request_id = ? ORDER BY t.position""",
        [request_id],
    )
    for t in tokens:
        t["token"] = decode(t["token_id"])
        e, r = t["engine_logprob"], t["ref_logprob"]
        t["abs_diff"] = abs(e - r) if e is not None and r is not None else None
        t["engine_topk"] = [
            {"id": i, "token": decode(i), "logprob": lp}
            for i, lp in zip(t.pop("engine_topk_ids") or [], t.pop("engine_topk_logprobs") or [])
        ]
        t["ref_topk"] = [
            {"id": i, "token": decode(i), "logprob": lp}
            for i, lp in zip(t.pop("ref_topk_ids") or [], t.pop("ref_topk_logprobs") or [])
        ]
    trace = overwritten = None
    if "trace" in views:
        have = {r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE trace)").fetchall()}
        cols = [*TRACE_STEP_COLUMNS, *(["stray_writes"] if "stray_writes" in have else [])]
        trace = _rows(
            con,
            f"SELECT {', '.join(cols)} FROM trace WHERE request_id = ? ORDER BY step, preempted",
            [request_id],
        )
        if "stray_writes" in have:  # the victim's side of the write log: who wrote into its slot
            overwritten = [
                {"step": w["step"], "writer": w["request_id"], "memory": e.get("memory"), "slot": e["slot"]}
                for w in _rows(
                    con,
                    # rows that wrote astray are few: their entries are matched here
                    "SELECT step, request_id, stray_writes FROM trace WHERE len(stray_writes) > 0 ORDER BY step",
                    [],
                )
                for e in w["stray_writes"]
                if e["owner"] == request_id
            ]
    request["prompt_text"] = "".join(decode(i) for i in request.get("prompt_token_ids") or []) if note is None else None
    return finite(
        {
            "run": str(run.path),
            "request": request,
            "tokens": tokens,
            "trace": trace,
            "rescored": has_ref,
            "tokenizer": note,
            "mechanism": _mechanism(run.path / "findings.json", request_id),
            "overwritten_by": overwritten,
        }
    )


def _mechanism(findings: Path, request_id: str) -> dict | None:
    """The request's per-request mechanism from findings.json, when it is flagged there."""
    try:
        flagged = json.loads(findings.read_text()).get("flagged") or []
    except (OSError, ValueError):  # not analysed yet, or a findings.json being rewritten
        return None
    return next((f.get("mechanism") for f in flagged if f.get("request_id") == request_id), None)
