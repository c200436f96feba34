"""The report's drill-down: which requests get token-by-token detail, and that detail as compact JSON.

Pure functions over Arrow tables and plain data (the caller reads the parts and owns the tokenizer,
passed in as a `decode(ids) -> list[str]` function that maps each id to its own string). Only the
worst `n` requests are expanded, each to at most `max_tokens` positions, so the page stays small
however large the run is. Token strings are shared through one id -> string map (`vocab`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.report.chart_style import sig
from lpf.run.schema import TRACE_STEP_COLUMNS

RANK = {"corrupt": 4, "divergent": 3, "noise": 2, "clean": 1, "unscored": 0, "error": 0}
TRACE_ROWS = 160


def select_worst(summary: pa.Table, n: int) -> list[int]:
    """Row indices of the n requests to drill into: worst verdict first, then largest max |diff|,
    then arrival order. Requests with no scored token (errors, unscored) are never chosen."""
    if summary.num_rows == 0 or n <= 0:
        return []
    verdict = summary.column("verdict").to_numpy(zero_copy_only=False)
    sev = np.array([RANK.get(v, 0) for v in verdict])
    md = summary.column("max_abs_logprob_diff").to_numpy(zero_copy_only=False).astype(float)
    md = np.where(np.isnan(md), np.inf, md)  # a missing logprob is the worst kind of diff
    seq = summary.column("seq").to_numpy(zero_copy_only=False)
    scored = summary.column("n_scored_tokens").to_numpy(zero_copy_only=False) > 0
    cand = np.flatnonzero(scored)
    order = cand[np.lexsort((seq[cand], -md[cand], -sev[cand]))]
    return order[:n].tolist()


def window(n_tokens: int, first_divergence: int | None, max_tokens: int) -> tuple[int, int]:
    """Which output positions to show: all of them if they fit, else a window that starts a little
    before the first divergence (where the story is)."""
    if n_tokens <= max_tokens:
        return 0, n_tokens
    start = 0 if first_divergence is None else max(0, min(first_divergence - max_tokens // 4, n_tokens - max_tokens))
    return start, start + max_tokens


def _group(table: pa.Table, ids: list[str]) -> dict[str, dict[str, list]]:
    """Rows of `table` per request id, as column lists sorted by position."""
    if table is None or table.num_rows == 0:
        return {}
    table = table.sort_by([("request_id", "ascending"), ("position", "ascending")])
    rid = table.column("request_id").to_pylist()
    cols = {c: table.column(c).to_pylist() for c in table.column_names if c != "request_id"}
    out: dict[str, dict[str, list]] = {}
    start = 0
    for i in range(1, len(rid) + 1):
        if i == len(rid) or rid[i] != rid[start]:
            out[rid[start]] = {c: v[start:i] for c, v in cols.items()}
            start = i
    return out


def build(
    picks: list[dict],
    requests: dict[str, dict],
    tokens: pa.Table,
    reference: pa.Table,
    trace: pa.Table | None,
    decode: Callable[[list[int]], list[str]],
    decode_text: Callable[[list[int]], str],
    max_tokens: int = 384,
) -> dict:
    """{"vocab": {id: text}, "requests": [...]} for the picked requests (summary rows as dicts)."""
    ids = [p["request_id"] for p in picks]
    tok = _group(tokens, ids)
    ref = _group(reference, ids)
    trc = _trace_by_request(trace, ids)
    used: set[int] = set()
    out = []
    for p in picks:
        rid = p["request_id"]
        t = tok.get(rid, {})
        r = ref.get(rid, {})
        n = len(t.get("position", []))
        fd = p.get("first_divergence")
        lo, hi = window(n, fd, max_tokens)
        ref_at = {pos: i for i, pos in enumerate(r.get("position", []))}
        rows = []
        for i in range(lo, hi):
            pos = t["position"][i]
            j = ref_at.get(pos)
            etk = t.get("engine_topk_ids", [None] * n)[i] or []
            rtk = (r["ref_topk_ids"][j] or []) if j is not None else []
            used.add(t["token_id"][i])
            used.update(etk)
            used.update(rtk)
            e = t["engine_logprob"][i]
            rl = r["ref_logprob"][j] if j is not None else None
            rows.append(
                [
                    pos,
                    t["token_id"][i],
                    sig(e, 6),
                    sig(rl, 6),
                    None if j is None else r["ref_rank"][j],
                    [int(x) for x in etk],
                    [sig(x, 4) for x in (t.get("engine_topk_logprobs", [None] * n)[i] or [])],
                    [int(x) for x in rtk],
                    [sig(x, 4) for x in ((r["ref_topk_logprobs"][j] or []) if j is not None else [])],
                ]
            )
        req = requests.get(rid, {})
        prompt_ids = req.get("prompt_token_ids") or []
        out.append(
            {
                "request_id": rid,
                "seq": p.get("seq"),
                "prompt_id": p.get("prompt_id"),
                "rollout": p.get("rollout"),
                "verdict": p.get("verdict"),
                "first_divergence": fd,
                "max_abs_logprob_diff": sig(p.get("max_abs_logprob_diff")),
                "gibberish_tokens": p.get("gibberish_tokens"),
                "gibberish_score": sig(p.get("gibberish_score")),
                "n_output_tokens": p.get("n_output_tokens", n),
                "shown": [lo, hi],
                "prompt_text": _clip(decode_text(prompt_ids)),
                "n_prompt_tokens": len(prompt_ids),
                "output_text": _clip(req.get("output_text") or ""),
                "finish_reason": req.get("finish_reason"),
                "oracle_expected": req.get("oracle_expected"),
                "oracle_ok": req.get("oracle_ok"),
                "error": p.get("error"),
                "tokens": rows,
                "trace": trc.get(rid),
            }
        )
    vocab_ids = sorted(i for i in used if i is not None)
    return {
        "vocab": dict(zip(map(str, vocab_ids), decode(vocab_ids))),
        "requests": out,
        "columns": [
            "position",
            "token_id",
            "engine_logprob",
            "ref_logprob",
            "ref_rank",
            "engine_topk_ids",
            "engine_topk_logprobs",
            "ref_topk_ids",
            "ref_topk_logprobs",
        ],
    }


def _clip(text: str, limit: int = 4000) -> str:
    """Long texts keep their end: that is where the output continues from."""
    return text if len(text) <= limit else "…" + text[-limit:]


def _trace_by_request(trace: pa.Table | None, ids: list[str]) -> dict[str, dict]:
    if trace is None or trace.num_rows == 0:
        return {}
    t = trace.filter(pc.is_in(trace.column("request_id"), pa.array(ids, pa.string())))
    t = t.sort_by([("request_id", "ascending"), ("step", "ascending")])
    cols = [c for c in TRACE_STEP_COLUMNS if c in t.column_names]
    rows_by: dict[str, list] = {}
    rid = t.column("request_id").to_pylist()
    values = list(zip(*(t.column(c).to_pylist() for c in cols))) if cols else []
    for r, v in zip(rid, values):
        rows_by.setdefault(r, []).append(list(v))
    out = {}
    for r, rows in rows_by.items():
        rec = dict(zip(cols, zip(*rows)))
        live = [i for i, pre in enumerate(rec.get("preempted", [False] * len(rows))) if not pre]
        phases = [rec["phase"][i] for i in live] if "phase" in rec else []
        slots = (
            sorted({rec["state_slot"][i] for i in live if rec["state_slot"][i] is not None})
            if "state_slot" in rec
            else []
        )
        out[r] = {
            "columns": cols,
            "rows": rows[:TRACE_ROWS],
            "n_rows": len(rows),
            "first_step": rows[0][0],
            "last_step": rows[-1][0],
            "first_phase": phases[0] if phases else None,
            "phases": {ph: phases.count(ph) for ph in dict.fromkeys(phases)},
            "state_slots": slots[:16],
            "preemptions": len(rows) - len(live),
        }
    return out
