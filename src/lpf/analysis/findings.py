"""Assemble `findings.json` from the per-token metrics and per-request summary.

`analyze(requests, tokens, reference, th, greedy, trace=None, engine_info=None, temperature=0)`
-> (summary table, findings dict). Steps: join engine tokens with reference scores, calibrate the
thresholds to the run's noise floor (`calibration`), per-token metrics, per-request verdicts, the
failure's shape (`shape`) and the ranked mechanisms (`features` + `hypotheses`). Pure: tables and
plain data in and out; `trace` and `engine_info` (the manifest's engine section) are optional, and
without them the hypotheses use request metadata only.

The run's verdict is its worst request verdict. `flagged` lists divergent and corrupt requests,
worst first (with the engine step of their first divergence when there is a trace).
Two signatures join the trace features as candidate mechanisms, both computed from the tokens:
`crossed_wires` (at the step a request first diverged, another request sampled the token this one's
reference expected and vice versa: outputs delivered to the wrong request) and, for runs sampled at
a temperature other than 1, `tempered_logprobs` (the reported logprobs fit the reference's
temperature-scaled distribution better than its raw one: processed logprobs reported as raw).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import metrics as m
from lpf.analysis.calibration import calibrate
from lpf.analysis.features import Feature, request_features
from lpf.analysis.hypotheses import rank_hypotheses
from lpf.analysis.shape import failure_shape
from lpf.analysis.signatures import crossed_wires, tempered_logprobs
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.verdicts import SEVERITY, VERDICTS, segment_starts, summarize_requests
from lpf.run.schema import SCHEMA_VERSION

METRIC_COLUMNS = ("abs_logprob_diff", "prob_diff", "k3_kl", "token_mult_prob_error")


def analyze(requests: pa.Table, tokens: pa.Table, reference: pa.Table, th: Thresholds, greedy: bool,
            trace: pa.Table | None = None, engine_info: dict | None = None,
            temperature: float = 0.0) -> tuple[pa.Table, dict]:
    """(per-request summary, findings dict). Pure: tables in, tables and plain data out."""
    joined = m.join_scored(tokens, reference)
    with np.errstate(invalid="ignore"):
        ad = np.abs(joined.column("engine_logprob").to_numpy() - joined.column("ref_logprob").to_numpy())
    starts = segment_starts(joined.column("request_id"))
    th, calib = calibrate(ad, starts, th)
    tok = m.token_metrics(joined, greedy, th)
    summary = summarize_requests(tok, requests, th, starts)
    findings = build_findings(tok, summary, th)
    findings["thresholds"].update(calib, pinned=sorted(th.pinned))
    shape = failure_shape(summary, requests, trace)
    steps = shape.pop("_divergence_steps")
    for f in findings["flagged"]:
        f["divergence_step"] = steps.get(f["request_id"])
    findings["shape"] = shape
    findings["hypotheses"] = _hypotheses(summary, requests, tok, reference, trace, engine_info, temperature, th)
    return summary, findings


def _hypotheses(summary, requests, tok, reference, trace, engine_info, temperature, th) -> list[dict]:
    verdict = np.asarray(summary.column("verdict").to_pylist(), dtype=object)
    flagged = np.isin(verdict, ("divergent", "corrupt"))
    scored = np.isin(verdict, VERDICTS)
    feats = request_features(requests, trace, engine_info)
    ids = summary.column("request_id")
    sigs = []
    if temperature and temperature != 1.0 and "ref_topk_logprobs" in reference.column_names:
        fit = tempered_logprobs(tok, reference, temperature, th)
        sigs.append(Feature("tempered_logprobs", "bool", pc.is_in(ids, value_set=fit).to_numpy(zero_copy_only=False),
                            f"reported logprobs that fit the reference's temperature-{temperature:g} "
                            f"distribution better than its raw one (processed logprobs reported as raw)"))
    crossed = crossed_wires(tok, requests, trace)
    if crossed is not None:
        sigs.append(Feature("crossed_wires", "bool", pc.is_in(ids, value_set=crossed).to_numpy(zero_copy_only=False),
                            "got, at a step where they diverged, the token another request's reference "
                            "expected while that request got theirs (crossed wires)"))
    kinds = set(verdict[flagged])
    label = kinds.pop() if len(kinds) == 1 else "flagged"
    other = "clean" if not np.any(verdict[scored & ~flagged] == "noise") else "unflagged"
    return rank_hypotheses(feats, flagged, scored, label, other, signatures=sigs)


def build_findings(tok: pa.Table, summary: pa.Table, th: Thresholds) -> dict:
    verdicts = summary.column("verdict").to_pylist()
    counts = {v: verdicts.count(v) for v in VERDICTS}
    worst = max((v for v in verdicts if v in SEVERITY), key=SEVERITY.get, default="clean")
    metrics = {name: m.percentiles(tok.column(name).to_numpy()) for name in METRIC_COLUMNS[:3]}
    # exp(|d|) is increasing in |d|: its percentiles come from |d|'s (one sort fewer over all tokens)
    mult = tok.column("token_mult_prob_error").to_numpy()
    mult = mult[np.isfinite(mult)]
    metrics["token_mult_prob_error"] = {**m.monotone_percentiles(metrics["abs_logprob_diff"], np.exp),
                                        "mean": float(mult.mean()) if mult.size else None}
    if tok.num_rows:
        flip = tok.column("greedy_flip").to_numpy(zero_copy_only=False)
        metrics["greedy_flip_rate"] = float(flip.mean())
        metrics["same_top1_pct"] = float(100.0 * np.mean(
            tok.column("token_id").to_numpy() == tok.column("ref_top1_id").to_numpy()))
    oracle = summary.column("oracle_ok").to_pylist()
    judged = [o for o in oracle if o is not None]
    flagged_tab = summary.filter(pc.is_in(summary.column("verdict"), value_set=pa.array(["divergent", "corrupt"])))
    rows = flagged_tab.to_pylist()
    flagged = sorted(rows, key=lambda r: (-SEVERITY[r["verdict"]], -r["max_abs_logprob_diff"], r["seq"]))
    n_tokens = pc.sum(summary.column("n_output_tokens")).as_py() or 0
    return {
        "schema_version": SCHEMA_VERSION,
        "verdict": worst,
        "n_requests": summary.num_rows,
        "n_tokens": int(n_tokens),
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
                     "gibberish_tokens": r["gibberish_tokens"],
                     "gibberish_score": r["gibberish_score"]} for r in flagged],
        "hypotheses": [],
    }
