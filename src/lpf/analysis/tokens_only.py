"""Findings for a run whose engine returned tokens but no logprobs (`returned.tokens_only`).

Contract: `analyze_tokens_only(requests, tokens, reference, th, greedy, ..., seeded=None)` takes the
arguments of `findings.analyze` and returns the same (summary, findings) shapes. Per request, the same
verdict rule as a run with logprobs (`verdicts.reduce_requests`), fed what tokens alone can show: a
token that is not the reference's argmax (past the tie margin) is a lie when the reference finds it improbable (`improbable_logprob`; greedy also, graded, the
engine's argmax that the reference ranks lower, by how much the reference prefers its own; sampled, see
`token_columns`); greedy flips past the expected tie margin make a request divergent, lies sustained
past the gibberish rule make it corrupt; there is no logprob error, so no `noise`, and the summary's
logprob-error columns are null. At temperatures above 1 no token is called a lie without a seeded replay. The
run-level test is `token_test` against the expected floor (`floors`); `metrics` holds what tokens
show: the greedy flip rate, the same-top-1 share and the reference's surprisal (-logprob) of the returned
tokens.
Pure: Arrow tables in, tables and plain data out.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lpf.analysis import absent
from lpf.analysis import metrics as m
from lpf.analysis import token_test
from lpf.analysis.calibration import calibrate_to_floor
from lpf.analysis.evidence import apply_inconsistency
from lpf.analysis.conclusion import conclude, findings_dict
from lpf.analysis.floors import run_floor
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.token_evidence import evidence_columns
from lpf.analysis.verdicts import reduce_requests, summarize_requests


def token_columns(
    joined: pa.Table, greedy: bool, th: Thresholds, temperature: float, draws: dict | None = None, allow: float = 0.0
) -> dict[str, np.ndarray]:
    """The columns `verdicts.reduce_requests` reads, from the reference alone. The engine's logprob is
    set to the reference's plus the margin its token lost by (greedy: how much the reference prefers
    its argmax), so `d` is that margin and a token both find certain is settled as before. Sampled,
    with the seeded replay's `draws` (in `joined`'s order): a lie is a token the reference would not
    have drawn with the same seed (by more than `allow`); without: a token the reference finds
    improbable where it was confident of its own top-1 (an honest sampler lands there at most the
    improbable share of the time)."""
    ref = joined.column("ref_logprob").to_numpy()
    top1 = joined.column("ref_top1_logprob").to_numpy()
    tok, top1_id = joined.column("token_id").to_numpy(), joined.column("ref_top1_id").to_numpy()
    # the per-token rule (`absent.judge`), which a run with logprobs also applies to a token that came without one
    margin, flip, strength = absent.judge(ref, top1, tok, top1_id, greedy, th, temperature)
    if not greedy and draws is not None:
        strength = ((tok != draws["token"]) & (draws["margin"] > allow)).astype(np.float64)
    return {
        "position": joined.column("position").to_numpy(),
        "abs_logprob_diff": np.zeros(len(ref)),
        "engine_logprob": ref + margin,
        "ref_logprob": ref,
        "greedy_flip": flip,
        "lie_strength": strength,
        "gibberish": strength >= 0.5,
    }


def analyze_tokens_only(
    requests: pa.Table,
    tokens: pa.Table,
    reference: pa.Table,
    th: Thresholds,
    greedy: bool,
    trace: pa.Table | None = None,
    engine_info: dict | None = None,
    temperature: float = 0.0,
    floor_table: dict | None = None,
    run_info: dict | None = None,
    seeded: pa.Table | None = None,
    **_ignored,
) -> tuple[pa.Table, dict]:
    """`seeded`: the run's seeded replay (`schema.SEEDED`), when the rescore stage made one."""
    info = run_info or {}
    joined, starts = m.join_grouped(tokens, reference)
    floor = run_floor(floor_table, info) if floor_table is not None else None
    th, calib = calibrate_to_floor(th, floor) if floor else (th, {"source": "defaults"})
    draws = token_test.seeded_columns(seeded, joined, np.arange(joined.num_rows)) if temperature else None
    allow = token_test.seeded_allow(floor, temperature) if floor and draws is not None else 0.0
    cols = token_columns(joined, greedy, th, temperature, draws, allow)
    per = reduce_requests(cols, th, starts)
    for name in ("max_abs_logprob_diff", "mean_abs_logprob_diff", "seq_log_ratio"):
        per[name] = np.full(len(starts), np.nan)  # not judged: no engine logprob came back
    per["n_no_logprob"] = per["n_scored_tokens"]  # every token judged from the token alone
    ids = (
        joined.column("request_id").take(pa.array(starts)).combine_chunks()
        if joined.num_rows
        else pa.array([], pa.string())
    )
    summary = apply_inconsistency(summarize_requests(joined, requests, th, starts, per=(ids, per)), requests)
    n = joined.num_rows
    ref = cols["ref_logprob"]
    same = int(np.count_nonzero(joined.column("token_id").to_numpy() == joined.column("ref_top1_id").to_numpy()))
    # the reference's surprisal (-logprob) of the returned tokens: what a lie raises
    metrics = {
        "ref_surprisal": m.percentiles(-ref) if n else m.percentiles(np.zeros(0)),
        "improbable_token_rate": float(np.mean(ref <= th.improbable_logprob)) if n else None,
    }
    if n:
        metrics["greedy_flip_rate"] = float(per["n_greedy_flips"].sum() / n)
        metrics["same_top1_pct"] = 100.0 * same / n
    findings = findings_dict(summary, th, metrics, n)
    findings["thresholds"].update(calib, pinned=sorted(th.pinned))
    test = None
    if floor and n:
        ev_cols = evidence_columns(joined, tokens, reference, requests)
        sampling = info.get("sampling") or {"temperature": temperature}
        draws = token_test.seeded_columns(seeded, joined, ev_cols["order"])
        test = token_test.run_test(token_test.token_evidence(ev_cols, floor, sampling, draws), floor)
    findings = conclude(findings, summary, requests, trace, engine_info, temperature, test, None, None)
    return summary, findings
