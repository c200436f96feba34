"""Assemble `findings.json` from the per-token metrics and per-request summary.

`analyze(requests, tokens, reference, th, greedy, trace=None, engine_info=None, temperature=0,
calibration=None, calibration_info=None, floor_table=None, run_info=None, prompt_tokens=None,
prompt_reference=None, chunk_budget=None)` -> (summary table, findings dict). Steps: join engine
tokens with reference scores, calibrate the thresholds to the run's noise floor (`calibration`; or
to a calibration run's, when given), per-token metrics, per-request verdicts, the failure's shape
(`shape`), the ranked mechanisms (`features` and `timing` + `hypotheses`), the mechanism that
explains each flagged request (`mechanisms`: findings' `mechanisms` block, and `mechanism` on each
`flagged` entry) and what the answers say beyond their tokens (`evidence`: inconsistent answers, at
least `divergent` when scored and disagreeing; failed attempts; a dying server's suspects). Pure:
tables and plain data in and out; `trace` and `engine_info` (the manifest's engine section) are optional, and
without them the hypotheses use request metadata only.

The run's verdict is its worst request verdict, or `systematic` when the run-level test
(`run_test`, against the expected floor of `floors`) rejects and no request is `corrupt`; with an
expected floor the per-request thresholds and tie margin come from it too, not from the run.
Hypotheses contrast flagged (divergent, corrupt) requests with the rest, or noise requests with
clean ones when nothing is flagged. `flagged` lists divergent and corrupt requests, worst first (with the engine step of their first divergence when there is a trace).
Two signatures join the trace features as candidate mechanisms, both computed from the tokens:
`crossed_wires` (at a step where a request diverged, another request sampled the token this one's
reference expected and vice versa: outputs delivered to the wrong request) and, for runs sampled at
a temperature other than 1, `tempered_logprobs` (the reported logprobs fit the reference's
temperature-scaled distribution better than its raw one: processed logprobs reported as raw).
The flagged requests' own tokens add two more (`onset_features`, computed over the flagged requests only):
`positional_onset` (they depart from one absolute position whatever their prompt length: findings'
`shape.absolute_onset` names it and tests it against the block sizes the engine info knows) and
`collapsed_to_one_token` (their outputs degenerate to one repeated id), ranked first among the signatures.
A speculating run's trace adds `speculative_features.spec_divergence` (first diverged at a token of the
request's first decode step after its prefill, on the speculative decode path), ranked before them,
and `speculative_decisions.decision_signature` (requests the rejection-sampler decision test raised: a draft
kept or rejected against the target's odds given its own draft probability; `findings.spec_decisions`
holds the test's counts and threshold).
A greedy run also gets `penalties.fit_penalty` (a repetition / presence / frequency penalty fitted to
the engine's choices against the reference's raw logits, a choice counted as agreeing within the
expected tie margin, at most what the engine's own logprob errors move a margin by: `_penalty_tie`;
a near-tie flip the engine's arithmetic explains is no penalty's): when one explains the greedy flips, it is
`findings.server_processing.penalty` (value, scope, sentence; absent otherwise) and a signature
(named after the mechanism, e.g. `repetition_penalty`: the requests with a flip it explains) ranked
with the rest; a `divergent` request whose only flagged tokens are flips it explains is the server's
configured sampling, lowered to `noise`/`clean` with `server_processing` naming it (`penalties.lower_explained`;
`lowered` counts them), before the summary is final. Any run gets
`signatures.fit_logprob_temperature` (the temperature the reported logprobs fit, when neither 1 nor
the run's own): found, it is `findings.server_processing.logprob_temperature` and the
`tempered_logprobs` signature is computed at it.
The token pass is `lpf.analysis.scoring` (cache-sized chunks, sparse where the flags are; the metric
columns' percentiles and means without ever holding one); results do not depend on the chunking.
Prompt positions (`prompt_tokens` / `prompt_reference`, when the engine returned them) are judged
apart by `lpf.analysis.prompt` with the same thresholds: their own block `findings.prompt`, `prompt_`
columns in the summary, and the run verdict becomes the worst of the output and prompt verdicts.
The steps are `lpf.analysis.steps.STEPS`, which the streamed analysis (`lpf.analysis.stream`) runs
too: both share `scoring` (the token pass and the metric summary) and `conclusion.conclude_run` (every step after
the run-level test: the decision test, the findings' body (`findings_dict`), the tempered signature, the
penalty and logprob-temperature fits, crossed wires, then `conclude`: run-level verdict, shape,
hypotheses, evidence, prefix cache), handed the token-reading inputs through `Inputs` (here the whole
tables; streamed, the rows gathered as the chunks went by), and `with_prompt`. `ran` (a `steps.Ran`)
records the steps run. `token_metric_summary` is the same metric summary over whole-run columns (the
statement `scoring.metric_summary` is tested against).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import answer_checks
from lpf.analysis import metrics as m
from lpf.analysis import request_sampling
from lpf.analysis.calibration import calibrate, calibrate_from_run, calibrate_to_floor, with_expected_tie_margin
from lpf.analysis.conclusion import Run, conclude_run
from lpf.analysis.evidence import apply_inconsistency
from lpf.analysis.floors import infers_dtype, observed_logit_error, run_floor
from lpf.analysis.localized import raise_localized
from lpf.analysis.penalties import fit_penalty
from lpf.analysis.prefix_cache import prefix_cache_summary
from lpf.analysis.prompt import merge_summary, prompt_analysis, worst_verdict
from lpf.analysis.run_test import DEFAULT_ALPHA, run_level_test, token_evidence
from lpf.analysis.scoring import metric_summary, score_requests
from lpf.analysis.signatures import crossed_wires, fit_logprob_temperature, tempered_logprobs
from lpf.analysis.speculative_decisions import decision_test
from lpf.analysis.steps import Ran, record
from lpf.analysis.thresholds import Thresholds
from lpf.analysis.token_evidence import calibration_floor, evidence_columns
from lpf.analysis.verdicts import summarize_requests

METRIC_COLUMNS = ("abs_logprob_diff", "prob_diff", "k3_kl", "token_mult_prob_error")


def analyze(
    requests: pa.Table,
    tokens: pa.Table,
    reference: pa.Table,
    th: Thresholds,
    greedy: bool,
    trace: pa.Table | None = None,
    engine_info: dict | None = None,
    temperature: float = 0.0,
    calibration: pa.Table | None = None,
    calibration_info: dict | None = None,
    floor_table: dict | None = None,
    run_info: dict | None = None,
    prompt_tokens: pa.Table | None = None,
    prompt_reference: pa.Table | None = None,
    chunk_budget: int | None = None,
    ran: Ran | None = None,
) -> tuple[pa.Table, dict]:
    """(per-request summary, findings dict). Pure: tables in, tables and plain data out.
    `calibration` (a calibration run's table, reference columns) replaces the run's own floor.
    `floor_table` (floors.json) and `run_info` (engine_dtype, reference_dtype, model, sampling) give
    the expected floor: thresholds and tie margin from it, and the run-level test (`run_test`)."""
    joined, starts = m.join_grouped(tokens, reference)
    cols = m.input_arrays(joined)
    cols["position"] = joined.column("position").to_numpy()
    expected, cal_cols = _expected_floor(
        joined, tokens, reference, requests, calibration, calibration_info, floor_table, run_info or {}
    )
    if calibration is not None:
        th, calib = calibrate_from_run(reference, calibration, th, calibration_info)
        th = with_expected_tie_margin(th, expected) if expected else th
    elif expected:
        th, calib = calibrate_to_floor(th, expected)
    else:
        with np.errstate(invalid="ignore"):
            ad = np.abs(np.subtract(cols["engine_logprob"], cols["ref_logprob"]))
        th, calib = calibrate(ad, starts, th)
        del ad
    ids = (
        joined.column("request_id").take(pa.array(starts)).combine_chunks()
        if len(starts)
        else pa.array([], pa.string())
    )
    sampling = (run_info or {}).get("sampling") or {"temperature": temperature}
    own = request_sampling.settings(requests, temperature)
    greedy_ids = None
    if own is not None and own.uniform is not None and own.uniform == own.uniform:  # one temperature, every request
        temperature = own.uniform
        greedy, sampling = temperature == 0, {**sampling, "temperature": temperature}
    elif own is not None:  # mixed: each row judged at its request's own settings
        greedy, temperature = own.rows(ids, starts, joined.num_rows)
        sampling, greedy_ids = request_sampling.MIXED_SAMPLING, own.greedy_ids
    with ThreadPoolExecutor(1, thread_name_prefix="lpf-steps") as pool:
        # the steps that read every token but no verdict, on a second core while this one scores: the answer
        # checks, the run-level test, the logprob-temperature fit (each a pure function of what it is handed, so
        # its result is the one it gives in line; the steps are recorded in their order below)
        found = pool.submit(
            answer_checks.scan,
            tokens,
            joined.column("request_id"),
            cols["position"],
            cols["engine_logprob"],
            cols["ref_logprob"],
            expected,
            th.divergent_abs_diff,
        )
        tested = (
            pool.submit(
                run_level_test, joined, tokens, reference, requests, expected, sampling, cols=cal_cols, starts=starts
            )
            if expected
            else None
        )
        fitted = (
            pool.submit(fit_logprob_temperature, joined, reference, th)
            if "ref_topk_logprobs" in reference.column_names
            else None
        )
        per, flips, same = score_requests(cols, starts, greedy, th, temperature)
        record(ran, "thresholds", "scoring")
        mixed = np.ndim(greedy) > 0
        if mixed:  # the run-level steps below take the run's settings: mixed runs are none of greedy / one temperature
            temperature = request_sampling.MIXED_TEMPERATURE
        summary = apply_inconsistency(summarize_requests(None, requests, th, per=(ids, per), distinct=True), requests)
        metrics = metric_summary(cols, flips, same)  # asked last below; made here while the steps above run
        record(ran, "verdicts", "answer_checks")
        summary, answer_blocks = answer_checks.apply(summary, found.result())
        test = None
        record(ran, "run_test", "localized")
        if expected:
            test = tested.result()
            summary = _localized(
                summary, test, cal_cols, expected, sampling, joined, tokens, reference, requests, starts
            )
        inputs = _InMemory(joined, tokens, reference, requests, trace, th, fitted)
        run = Run(
            requests,
            trace,
            engine_info,
            th,
            calib,
            greedy,
            temperature,
            sampling,
            expected,
            reference.column_names,
            greedy_ids,
        )
        summary, findings = conclude_run(
            run,
            summary,
            test,
            lambda: metrics,
            joined.num_rows,
            inputs,
            ran=ran,
            answer_blocks=answer_blocks,
        )
    return with_prompt(summary, findings, prompt_tokens, prompt_reference, requests, th, trace, chunk_budget, ran)


def with_prompt(
    summary: pa.Table,
    findings: dict,
    prompt_tokens: pa.Table | None,
    prompt_reference: pa.Table | None,
    requests: pa.Table,
    th: Thresholds,
    trace: pa.Table | None,
    chunk_budget: int | None,
    ran: Ran | None = None,
) -> tuple[pa.Table, dict]:
    """The prompt positions' block, their `prompt_` summary columns and the run verdict raised to the
    worst prompt verdict (`lpf.analysis.prompt`), when the run has scored prompt positions."""
    record(ran, "prompt")
    prompt_table, prompt_block = prompt_analysis(prompt_tokens, prompt_reference, requests, th, trace, chunk_budget)
    if prompt_block is not None:
        summary = merge_summary(summary, prompt_table)
        findings["prompt"] = prompt_block
        findings["verdict"] = worst_verdict(findings["verdict"], prompt_block)
    return summary, findings


class _InMemory:
    """`Inputs` from the whole tables (`joined`: `metrics.join_grouped`'s); `fitted`: the logprob-temperature
    fit of these tables when a thread is already making it (a future), else None."""

    def __init__(self, joined, tokens, reference, requests, trace, th, fitted=None):
        self.joined, self.tokens, self.reference, self.requests, self.trace, self.th = (
            joined,
            tokens,
            reference,
            requests,
            trace,
            th,
        )
        self.fitted = fitted

    def decisions(self, run, slack):
        return decision_test(self.tokens, self.reference, self.requests, self.trace, run.sampling, slack, DEFAULT_ALPHA)

    def tempered(self, temperature):
        return tempered_logprobs(self.joined, self.reference, temperature, self.th)

    def penalty(self, tie, greedy_ids, configured=None):
        return _fit_penalty(self.tokens, self.reference, self.requests, tie, True, greedy_ids, configured)

    def logprob_temperature(self):
        if self.fitted is not None:
            return self.fitted.result()
        return fit_logprob_temperature(self.joined, self.reference, self.th)

    def crossed(self, run):
        return crossed_wires(self.joined, self.requests, self.trace)

    def prefix_cache(self, run):
        return prefix_cache_summary(self.requests, self.trace, run.engine_info)

    def outputs(self, run, keep):
        return self.requests


def _localized(summary, test, cols, expected, sampling, joined, tokens, reference, requests, starts):
    """`localized.raise_localized` over the tokens the run test read (every `sampled_every`-th in
    arrival order, as the streamed analysis keeps them; only asked when the run was rejected); its
    info joins the run test's block. `cols`: every token's evidence columns when the caller has them."""
    if test.get("result") != "different":
        return summary
    step = test.get("sampled_every") or 1
    if cols is None:
        cols = evidence_columns(joined, tokens, reference, requests, every=step, starts=starts)
    elif step > 1:
        cols = {k: v[::step] for k, v in cols.items()}
    exceed = token_evidence(cols, expected, sampling)["logprob"]
    summary, info = raise_localized(summary, test, exceed, joined.column("request_id").take(pa.array(cols["order"])))
    test["localized"] = info
    return summary


def _expected_floor(joined, tokens, reference, requests, calibration, calibration_info, floor_table, info):
    """(expected floor, the run-test columns of every token when a calibration run needed them) or
    (None, None) without a floor table or an expected floor for the run's reference dtype."""
    if floor_table is None or joined.num_rows == 0:
        return None, None
    cols = cal = None
    if calibration is not None:
        cols = evidence_columns(joined, tokens, reference, requests)
        cal = calibration_floor(cols, joined, calibration)
    engine_dtype = (calibration_info or {}).get("dtype") or info.get("engine_dtype")
    observed = None
    if infers_dtype(floor_table, info, engine_dtype):  # unknown or `auto`: the pair its errors fit
        with np.errstate(invalid="ignore"):
            d = np.subtract(joined.column("engine_logprob").to_numpy(), joined.column("ref_logprob").to_numpy())
        observed = observed_logit_error(d, joined.column("ref_logprob").to_numpy())
    floor = run_floor(floor_table, info, cal, observed, engine_dtype)
    return (floor, cols) if floor else (None, None)


def _fit_penalty(tokens, reference, requests, tie: float, greedy, greedy_ids: list[str] | None, configured=None):
    """`penalties.fit_penalty` over the greedy requests: all of a greedy run, the ones sent at temperature 0 of a
    run of mixed settings (`greedy_ids`), none of a sampled run."""
    if greedy_ids is not None:
        if not greedy_ids:
            return None
        keep = pa.array(greedy_ids, pa.string())
        tokens, reference, requests = (
            t.filter(pc.is_in(t.column("request_id"), value_set=keep)) for t in (tokens, reference, requests)
        )
        return fit_penalty(tokens, reference, requests, tie, configured=configured)
    return fit_penalty(tokens, reference, requests, tie, configured=configured) if greedy else None


def token_metric_summary(column, n_scored: int, flips: int, same_top1: int) -> dict:
    """findings' `metrics` from the whole-run metric columns, asked for one at a time (`column(name)`
    -> numpy array over all scored tokens, in the analysis' token order: the means are order-exact),
    so a streamed caller holds one column at a time beside abs_logprob_diff."""
    metrics = {name: m.percentiles(column(name)) for name in METRIC_COLUMNS[:3]}
    # exp(|d|) is increasing in |d|: its percentiles come from |d|'s (one sort fewer over all tokens)
    mult = column("token_mult_prob_error")
    finite = np.isfinite(mult)
    if not finite.all():
        mult = mult[finite]
    metrics["token_mult_prob_error"] = {
        **m.monotone_percentiles(metrics["abs_logprob_diff"], np.exp),
        "mean": float(mult.mean()) if mult.size else None,
    }
    if n_scored:
        metrics["greedy_flip_rate"] = float(flips / n_scored)
        metrics["same_top1_pct"] = float(100.0 * (same_top1 / n_scored))
    return metrics
