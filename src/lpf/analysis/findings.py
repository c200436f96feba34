"""Assemble `findings.json` from the per-token metrics and per-request summary.

The run's verdict is its worst request verdict. `flagged` lists divergent and corrupt requests,
worst first. `hypotheses` stays empty until mechanism ranking lands (DESIGN.md "Failure shape").
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lpf.analysis import metrics as m
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.verdicts import SEVERITY, VERDICTS, summarize_requests
from lpf.run.schema import SCHEMA_VERSION

METRIC_COLUMNS = ("abs_logprob_diff", "prob_diff", "k3_kl", "token_mult_prob_error")


def analyze(requests: pa.Table, tokens: pa.Table, reference: pa.Table, th: Thresholds,
            greedy: bool) -> tuple[pa.Table, dict]:
    """(per-request summary, findings dict). Pure: tables in, tables and plain data out."""
    tok = m.token_metrics(m.join_scored(tokens, reference), greedy, th)
    summary = summarize_requests(tok, requests, th)
    return summary, build_findings(tok, summary, th)


def build_findings(tok: pa.Table, summary: pa.Table, th: Thresholds) -> dict:
    verdicts = summary.column("verdict").to_pylist()
    counts = {v: verdicts.count(v) for v in VERDICTS}
    worst = max((v for v in verdicts if v in SEVERITY), key=SEVERITY.get, default="clean")
    metrics = {name: m.percentiles(tok.column(name).to_numpy()) for name in METRIC_COLUMNS}
    if tok.num_rows:
        flip = tok.column("greedy_flip").to_numpy(zero_copy_only=False)
        metrics["greedy_flip_rate"] = float(flip.mean())
        metrics["same_top1_pct"] = float(100.0 * np.mean(
            tok.column("token_id").to_numpy() == tok.column("ref_top1_id").to_numpy()))
    oracle = summary.column("oracle_ok").to_pylist()
    judged = [o for o in oracle if o is not None]
    rows = summary.to_pylist()
    flagged = sorted((r for r in rows if r["verdict"] in ("divergent", "corrupt")),
                     key=lambda r: (-SEVERITY[r["verdict"]], -r["max_abs_logprob_diff"], r["seq"]))
    return {
        "schema_version": SCHEMA_VERSION,
        "verdict": worst,
        "n_requests": len(rows),
        "n_tokens": int(sum(r["n_output_tokens"] for r in rows)),
        "n_scored_tokens": int(tok.num_rows),
        "counts": counts,
        "errors": verdicts.count("error"),
        "unscored": verdicts.count("unscored"),
        "thresholds": th.to_dict(),
        "metrics": metrics,
        "oracle": {"n": len(judged), "correct": sum(judged),
                   "accuracy": (sum(judged) / len(judged)) if judged else None},
        "flagged": [{"request_id": r["request_id"], "seq": r["seq"], "verdict": r["verdict"],
                     "first_divergence": r["first_divergence"],
                     "max_abs_logprob_diff": r["max_abs_logprob_diff"],
                     "gibberish_tokens": r["gibberish_tokens"]} for r in flagged],
        "hypotheses": [],
    }
