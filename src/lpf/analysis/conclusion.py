"""The steps after the run-level test, shared by the in-memory analysis (`lpf.analysis.findings`) and the
streamed one (`lpf.analysis.stream`): what turns scored requests into findings.json's conclusions.

Contract: `conclude_run(run, summary, test, metrics, n_scored, inputs, ...)` -> (summary, findings) runs, in
`steps.STEPS` order, the speculative decision test (raising the requests it flags), the server's penalty fit
(lowering the requests whose only flips it explains: `penalties.lower_explained`), the findings' body
(`findings_dict`), the tempered signature, the logprob-temperature fit, crossed wires,
then `conclude`: the run-level verdict, the failure's shape, the ranked hypotheses and each flagged request's
mechanism (`_hypotheses`), the evidence beyond the tokens and the prefix cache's block. `Run` is what these
steps read of the run besides its tokens; `Inputs` is what each execution hands them from the tokens (the
in-memory one its whole tables, the streamed one the rows it gathered). Pure: tables and plain data in and
out; no step here reads a whole token table itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis.evidence import evidence
from lpf.analysis.features import Feature, request_features
from lpf.analysis.floors import KAPPA
from lpf.analysis.hypotheses import rank_hypotheses
from lpf.analysis.levels import REQUEST_VERDICTS, SEVERITY
from lpf.analysis.mechanisms import attribute, run_level
from lpf.analysis.onset_features import onset_features
from lpf.analysis.penalties import configured_penalties, lower_explained, phrase as penalty_phrase
from lpf.analysis.prefix_cache import prefix_cache_summary
from lpf.analysis.shape import failure_shape
from lpf.analysis.speculative_decisions import decision_signature, decision_slack, raise_decisions
from lpf.analysis.speculative_features import spec_divergence
from lpf.analysis.steps import Ran, record
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.timing import timing_features
from lpf.run.schema import SCHEMA_VERSION


def wants_tempered(temperature: float, reference_columns) -> bool:
    """Whether the run gets the `tempered_logprobs` signature (sampled at a temperature other than 1)."""
    return bool(temperature) and temperature != 1.0 and "ref_topk_logprobs" in reference_columns


@dataclass(frozen=True)
class Run:
    """What the steps after scoring read of the run besides the tokens (both executions alike)."""

    requests: pa.Table
    trace: pa.Table | None
    engine_info: dict | None
    th: Thresholds
    calib: dict
    greedy: bool
    temperature: float
    sampling: dict
    expected: dict | None
    reference_columns: tuple | list
    greedy_ids: list[str] | None = None  # a run of mixed per-request settings: those sent at temperature 0

    @property
    def mixed(self) -> bool:
        """Per-request settings of several kinds (`request_sampling`): `greedy` is then per row."""
        return np.ndim(self.greedy) > 0


class Inputs(Protocol):
    """What the token-reading steps after scoring get from an execution: the in-memory one reads its
    whole tables (`_InMemory`), the streamed one the rows it gathered as the chunks went by."""

    def decisions(self, run: Run, slack: float) -> tuple[dict, dict] | None: ...
    def tempered(self, temperature: float) -> pa.Array: ...
    def penalty(self, tie: float, greedy_ids: list[str] | None, configured: list[dict]) -> dict | None: ...
    def logprob_temperature(self) -> dict | None: ...
    def crossed(self, run: Run) -> pa.Array | None: ...
    def prefix_cache(self, run: Run) -> dict | None: ...
    def outputs(self, run: Run, keep: np.ndarray) -> pa.Table: ...


def conclude_run(
    run: Run,
    summary: pa.Table,
    test: dict | None,
    metrics,
    n_scored: int,
    inputs: Inputs,
    on_summary=None,
    ran=None,
    answer_blocks: dict | None = None,
) -> tuple[pa.Table, dict]:
    """The steps after the run-level test, in `steps.STEPS` order, for both executions: the
    speculative decision test (raising the requests it flags), the findings' body, the tempered
    signature, the logprob temperature, crossed wires, then `conclude`.
    `metrics()`: the metric summary (asked last: the streamed one is made on another thread);
    `on_summary(summary)`: called once the summary is final, before the conclusions; `answer_blocks`:
    `answer_checks.apply`'s findings blocks (the step ran before the run-level test)."""
    th, temperature = run.th, run.temperature
    record(ran, "spec_decisions")
    decisions = inputs.decisions(run, decision_slack(th.divergent_abs_diff, run.expected))
    if decisions is not None:
        summary = raise_decisions(summary, decisions[0])
    record(ran, "penalty")
    greedy = run.greedy_ids is not None or (not run.mixed and bool(run.greedy))  # the greedy requests' choices
    # the penalties the server says it applies (its documented defaults), tested as stated beside the fit
    configured = configured_penalties((run.engine_info or {}).get("configuration"))
    penalty = inputs.penalty(_penalty_tie(th, test), run.greedy_ids, configured) if greedy else None
    # flips the server's own penalty explains are its configured sampling, not divergences
    summary, lowered = lower_explained(summary, penalty, th.clean_abs_diff)
    if penalty is not None:  # the ids are the summary's `server_processing` column now
        penalty.pop("explained_requests", None)
        penalty["lowered"] = lowered
    if on_summary is not None:
        on_summary(summary)
    record(ran, "metrics")
    findings = findings_dict(summary, th, None, n_scored)
    findings["thresholds"].update(run.calib, pinned=sorted(th.pinned))
    findings.update(answer_blocks or {})
    if decisions is not None:
        findings["spec_decisions"] = decisions[1]
    record(ran, "tempered")
    wanted = not run.mixed and wants_tempered(temperature, run.reference_columns)
    tempered = inputs.tempered(temperature) if wanted else None
    record(ran, "logprob_temperature")
    server = {
        "penalty": penalty,
        "logprob_temperature": (inputs.logprob_temperature() if "ref_topk_logprobs" in run.reference_columns else None),
    }
    fitted = server["logprob_temperature"]
    if fitted is not None and abs(fitted["value"] - temperature) <= 0.02:
        server["logprob_temperature"] = None  # the run's own temperature: `tempered_logprobs` says that
    elif fitted is not None:  # a temperature of the server's own: the signature at it
        tempered = inputs.tempered(fitted["value"])
    record(ran, "crossed_wires")
    crossed = inputs.crossed(run)
    findings = conclude(
        findings,
        summary,
        run.requests,
        run.trace,
        run.engine_info,
        temperature,
        test,
        tempered,
        crossed,
        server,
        ran,
        prefix=lambda: inputs.prefix_cache(run),
        outputs=lambda keep: inputs.outputs(run, keep),
    )
    findings["metrics"] = metrics()  # at its place in the body (findings_dict put the key there)
    return summary, findings


def conclude(
    findings: dict,
    summary: pa.Table,
    requests: pa.Table,
    trace: pa.Table | None,
    engine_info: dict | None,
    temperature: float,
    test: dict | None,
    tempered: pa.Array | None,
    crossed: pa.Array | None,
    server: dict | None = None,
    ran: Ran | None = None,
    prefix=None,
    outputs=None,
) -> dict:
    """The request-level steps after scoring, shared by the in-memory and the streamed analysis
    (`lpf.analysis.stream`): the run-level test's verdict (`test`, or None), the failure's shape,
    the ranked hypotheses (with the two token signatures' request ids, None when not computed), the
    evidence beyond the tokens and the prefix cache's block (`prefix_cache`: on, hits, inert; None
    when the run has no prefix cache), and what the server did on its own (`server`: {"penalty":
    `penalties.fit_penalty`'s, "logprob_temperature": `signatures.fit_logprob_temperature`'s}, None
    each when not found) as `server_processing` with the found ones (absent when none). Reads no
    token table. `prefix()`: the prefix cache's block, when the caller makes it (from the prompts' ids)."""
    record(ran, "run_verdict", "shape", "hypotheses", "evidence", "prefix_cache")
    if test is not None:
        findings["run_test"] = test
        if (
            test["result"] == "different"
            and findings["verdict"] in SEVERITY
            and SEVERITY[findings["verdict"]] < SEVERITY["systematic"]
        ):
            findings["verdict"] = "systematic"
    shape = failure_shape(summary, requests, trace)
    steps = shape.pop("_divergence_steps")
    for f in findings["flagged"]:
        f["divergence_step"] = steps.get(f["request_id"])
    findings["shape"] = shape
    found = {k: v for k, v in (server or {}).items() if v is not None}
    if found:  # only when fitted: findings of runs without one stay as they were
        findings["server_processing"] = found
    if "logprob_temperature" in found:
        temperature = found["logprob_temperature"]["value"]  # the tempered signature's, in its words
    findings["hypotheses"], findings["mechanisms"] = _hypotheses(
        summary,
        requests,
        trace,
        engine_info,
        temperature,
        tempered,
        crossed,
        findings["flagged"],
        found.get("penalty"),
        test,
        shape,
        outputs,
    )
    findings["evidence"] = evidence(requests, summary)
    findings["prefix_cache"] = prefix() if prefix is not None else prefix_cache_summary(requests, trace, engine_info)
    return findings


def _penalty_tie(th: Thresholds, test: dict | None) -> float:
    """How far the engine may move a near tie before a penalty must explain its flip: the tie margin its
    dtype's floor expects, but at most what its own logprobs show (a margin moves by two logits' errors,
    each within KAPPA x the run's observed 99th percentile): a server of unknown dtype gets bfloat16's
    margin (1.57 nats), inside which its float32 choices would hide a repetition penalty of 1.1, while an
    honest bfloat16 engine's own error (0.54 nats on prose) keeps its near-tie flips excused. Never under
    the clean threshold."""
    seen = (((test or {}).get("floors") or {}).get("observed") or {}).get("token", {}).get("q99")
    tie = th.tie_margin if seen is None else min(th.tie_margin, 2 * KAPPA * float(seen))
    return max(th.clean_abs_diff, tie)


def _hypotheses(
    summary,
    requests,
    trace,
    engine_info,
    temperature,
    tempered,
    crossed,
    flagged_rows,
    penalty=None,
    test=None,
    shape=None,
    outputs=None,
) -> tuple:
    """(ranked hypotheses, findings' `mechanisms` block); each of `flagged_rows` (findings' `flagged`)
    gains its `mechanism` (`lpf.analysis.mechanisms`; `mechanisms.run_level` when the run-level `test` finds
    the whole run departs). `penalty`: a fitted server penalty, ranked as a signature (the requests with a
    flip it explains). The flagged requests' positional onset and collapse (`onset_features`) are signatures
    too; a positional onset found goes into `shape` as `absolute_onset`. `outputs(keep)`: `requests` with the output
    token ids of the requests at `keep` at least (the streamed execution's requests hold their lengths only)."""
    enc = pc.dictionary_encode(summary.column("verdict").combine_chunks())  # a few names, one code per request
    names, code = enc.dictionary.to_pylist(), enc.indices.to_numpy(zero_copy_only=False)

    def having(*verdicts):
        return np.isin(code, [i for i, v in enumerate(names) if v in verdicts])

    flagged = having("divergent", "corrupt")
    scored = having(*REQUEST_VERDICTS)
    if not flagged.any():
        # nothing lies outright, but some requests drift: what sets them apart is still worth
        # ranking (a stale state that shifts logprobs without changing answers shows only as noise)
        flagged = having("noise")
    feats = request_features(requests, trace, engine_info) + timing_features(requests)
    ids = summary.column("request_id")
    sigs = []
    if tempered is not None:
        sigs.append(
            Feature(
                "tempered_logprobs",
                "bool",
                pc.is_in(ids, value_set=tempered).to_numpy(zero_copy_only=False),
                f"reported logprobs that fit the reference's temperature-{temperature:g} "
                f"distribution better than its raw one (processed logprobs reported as raw)",
            )
        )
    if penalty is not None:
        sigs.append(
            Feature(
                penalty["mechanism"],
                "bool",
                pc.is_in(ids, value_set=pa.array(penalty["requests"], pa.string())).to_numpy(zero_copy_only=False),
                penalty_phrase(penalty),
            )
        )
    if flagged_rows:  # divergent or corrupt requests: where they departed and what they degenerated to
        with_ids = outputs(flagged) if outputs is not None else requests
        kv_sigs, onset = onset_features(summary, with_ids, flagged, engine_info)
        sigs = kv_sigs + sigs  # first: a property of the flagged tokens themselves, ahead of a fitted server setting
        if onset is not None and shape is not None:
            shape["absolute_onset"] = onset
    spec_first = spec_divergence(summary, requests, trace)
    if spec_first is not None:
        sigs.append(spec_first)
    crowded = next((f.values for f in feats if f.name == "sampled_spec_batch_over_2"), None)
    odds = decision_signature(summary, crowded)
    if odds is not None:
        sigs.append(odds)
    if crossed is not None:
        sigs.append(
            Feature(
                "crossed_wires",
                "bool",
                pc.is_in(ids, value_set=crossed).to_numpy(zero_copy_only=False),
                "got, at a step where they diverged, the token another request's reference "
                "expected while that request got theirs (crossed wires)",
            )
        )
    kinds = {names[i] for i in np.unique(code[flagged])}
    label = kinds.pop() if len(kinds) == 1 else "flagged"
    other = "clean" if not np.any(having("noise")[scored & ~flagged]) else "unflagged"
    ranked = rank_hypotheses(feats, flagged, scored, label, other, signatures=sigs)
    if not flagged_rows:  # nothing divergent or corrupt (the ranking above contrasts noise): nothing to explain
        return ranked, {"covered": [], "unexplained": 0, "n_flagged": 0}
    per, block = attribute(ranked, feats, flagged, scored, label, other, signatures=sigs)
    per, block = run_level(per, block, [*sigs, *feats], test)
    # the flagged rows' places among the run's ids, looked up among the flagged requests' (a dict or a hash
    # of every id costs 0.1 s at 300k requests), the whole run's only for a row outside them
    rows = np.flatnonzero(flagged)
    at = dict(zip(ids.take(pa.array(rows)).to_pylist(), rows.tolist()))
    missing = [row["request_id"] for row in flagged_rows if row["request_id"] not in at]
    if missing:
        at.update(zip(missing, pc.index_in(pa.array(missing, ids.type), value_set=ids).to_numpy().tolist()))
    for row in flagged_rows:
        row["mechanism"] = per[at[row["request_id"]]]
    return ranked, block


def findings_dict(summary: pa.Table, th: Thresholds, metrics: dict, n_scored: int) -> dict:
    """findings.json's body from the per-request summary and the token metrics' summary."""
    vc = pc.value_counts(summary.column("verdict")).to_pylist()
    tally = {c["values"]: c["counts"] for c in vc}
    counts = {v: tally.get(v, 0) for v in REQUEST_VERDICTS}
    # a run with nothing scored has no verdict to give: say why instead of calling it clean
    nothing = "error" if summary.num_rows and set(tally) == {"error"} else "unscored"
    worst = max((v for v in tally if v in SEVERITY), key=SEVERITY.get, default=nothing)
    oracle = summary.column("oracle_ok")
    n_judged = len(oracle) - oracle.null_count
    correct = int(pc.sum(oracle.cast(pa.int64())).as_py() or 0) if n_judged else 0
    flagged_tab = summary.filter(pc.is_in(summary.column("verdict"), value_set=pa.array(["divergent", "corrupt"])))
    rows = flagged_tab.to_pylist()
    flagged = sorted(rows, key=lambda r: (-SEVERITY[r["verdict"]], -r["max_abs_logprob_diff"], r["seq"]))
    n_tokens = pc.sum(summary.column("n_output_tokens")).as_py() or 0
    return {
        "schema_version": SCHEMA_VERSION,
        "verdict": worst,
        "n_requests": summary.num_rows,
        "n_tokens": int(n_tokens),
        "n_scored_tokens": int(n_scored),
        "counts": counts,
        "errors": tally.get("error", 0),
        "unscored": tally.get("unscored", 0),
        "thresholds": th.to_dict(),
        "metrics": metrics,
        "oracle": {"n": n_judged, "correct": correct, "accuracy": (correct / n_judged) if n_judged else None},
        "flagged": [
            {
                "request_id": r["request_id"],
                "seq": r["seq"],
                "verdict": r["verdict"],
                "first_divergence": r["first_divergence"],
                "max_abs_logprob_diff": r["max_abs_logprob_diff"],
                "gibberish_tokens": r["gibberish_tokens"],
                "gibberish_score": r["gibberish_score"],
                **({"spec_decision": r["spec_decision"]} if r.get("spec_decision") else {}),
                **({"self_contradiction": r["self_contradiction"]} if r.get("self_contradiction") else {}),
                **({"sure_token": r["sure_token"]} if r.get("sure_token") else {}),
            }
            for r in flagged
        ],
        "hypotheses": [],
    }
