"""Where a speculating run's requests first went wrong, from the trace's speculative columns (synthetic
tables, no engine): `spec_features.spec_divergence` (first diverged at a token of the first decode step
after the prefill, on the speculative decode path) and `signatures.sample_steps` on speculative rows
(a verify row samples 1 + accepted positions from the one after its last non-draft token)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lpf.analysis.hypotheses import rank_hypotheses
from lpf.analysis.signatures import sample_steps
from lpf.analysis.spec_features import spec_divergence
from lpf.run.schema import REQUESTS, SPEC_TRACE, TRACE

SCHEMA = pa.schema(list(TRACE) + [pa.field(n, t) for n, t in SPEC_TRACE])
PLEN = 4


def _requests(n):
    return pa.Table.from_pylist(
        [
            {"request_id": f"r{i}", "seq": i, "prompt_id": f"p{i}", "rollout": 0, "prompt_token_ids": [1] * PLEN}
            for i in range(n)
        ],
        schema=REQUESTS,
    )


def _row(step, rid, phase, computed, scheduled, drafts=0, accepted=None):
    return {
        "step": step,
        "request_id": rid,
        "phase": phase,
        "num_computed_tokens": computed,
        "num_scheduled_tokens": scheduled,
        "state_slot": 0,
        "batch_size": 1,
        "batch_tokens": scheduled,
        "preempted": False,
        "num_draft_tokens": drafts,
        "num_accepted_tokens": accepted,
    }


def _life(rid, first_drafts, first_accepted, prefill_phase="prefill"):
    """A request: its prompt prefilled in one step (output position 0), then a decode-path step with
    `first_drafts` drafts of which `first_accepted` were accepted, then a plain decode."""
    phase = "verify" if first_drafts else "decode"
    after = PLEN + 1 + first_accepted
    return [
        _row(0, rid, prefill_phase, 0, PLEN),
        _row(1, rid, phase, PLEN, 1 + first_drafts, first_drafts, first_accepted if first_drafts else None),
        _row(2, rid, "decode", after, 1),
    ]


def _summary(firsts):
    return pa.table(
        {"request_id": [f"r{i}" for i in range(len(firsts))], "first_divergence": pa.array(firsts, pa.int32())}
    )


def test_a_verify_row_samples_one_position_plus_its_accepted_drafts():
    trace = pa.Table.from_pylist(_life("r0", 3, 1), schema=SCHEMA)
    got = sample_steps(trace, _requests(1)).sort_by("position").to_pydict()
    # the prefill samples position 0; the verify step positions 1 (the accepted draft's) and 2 (its own
    # token after it); the decode after it position 3: not 4 as num_computed + num_scheduled would say
    assert got["position"] == [0, 1, 2, 3] and got["step"] == [0, 1, 1, 2]


def test_first_divergence_at_the_first_speculative_decode_is_named_and_elsewhere_not():
    rows = (
        _life("r0", 3, 0)  # diverged at position 1: the verify step's own token
        + _life("r1", 3, 2)  # at 3: the token after 2 accepted drafts, still the first decode step's
        + _life("r2", 0, 0)  # at 1: a decode step with no drafts (vLLM's layout is speculative all the same)
        + _life("r3", 3, 0)  # at 2: the step after the first decode: not it
        + _life("r4", 3, 0)  # clean
        + _life("r5", 3, 0, prefill_phase="verify")  # prompt on the verify path: prompt_on_verify_path's
    )
    trace = pa.Table.from_pylist(rows, schema=SCHEMA)
    f = spec_divergence(_summary([1, 3, 1, 2, None, 1]), _requests(6), trace)
    assert f.name == "diverged_at_first_spec_decode"
    assert f.values.tolist() == [True, True, True, False, False, False]
    assert "up to 3 drafts; 2 of those steps verified drafts, 1 had none" in f.phrase


def test_no_speculative_columns_or_no_request_there_gives_no_signature():
    plain = pa.Table.from_pylist([{k: v for k, v in r.items() if k in TRACE.names} for r in _life("r0", 0, 0)])
    assert spec_divergence(_summary([1]), _requests(1), plain) is None
    trace = pa.Table.from_pylist(_life("r0", 3, 0), schema=SCHEMA)
    assert spec_divergence(_summary([2]), _requests(1), trace) is None
    assert spec_divergence(_summary([None]), _requests(1), trace) is None


def test_ranked_over_the_whole_run_when_most_requests_went_wrong_there():
    """The vLLM CPU n-gram shape (docs/bugs.md 22): nearly every request goes wrong at its first decode,
    so a flagged-vs-clean contrast has few clean ones to go on; the signature is tested for the run."""
    n, wrong = 40, 38
    rows = [r for i in range(n) for r in _life(f"r{i}", 3 if i % 4 else 0, 0)]
    trace = pa.Table.from_pylist(rows, schema=SCHEMA)
    f = spec_divergence(_summary([1] * wrong + [None] * (n - wrong)), _requests(n), trace)
    flagged = np.arange(n) < wrong
    top = rank_hypotheses([], flagged, np.ones(n, bool), "corrupt", signatures=[f])[0]
    assert top["feature"] == "diverged_at_first_spec_decode" and top["scope"] == "run"
    assert top["sentence"].startswith("38/40 requests (38/38 corrupt ones) first diverged at a token of their first")


def test_a_shrink_reads_the_signature_from_the_runs_summary():
    """`lpf shrink` keeps the top mechanism in its target's signature: this one reads where the request
    first diverged, so it needs the run's summary (None without it: the run cannot say)."""
    from lpf.experiments.shrink.signature import target_feature

    trace = pa.Table.from_pylist(_life("r0", 3, 0) + _life("r1", 3, 0), schema=SCHEMA)
    summary, req = _summary([1, 2]), _requests(2)
    name = "diverged_at_first_spec_decode"
    assert target_feature(name, 0, req, trace, {}, summary=summary) is True
    assert target_feature(name, 1, req, trace, {}, summary=summary) is False
    assert target_feature(name, 0, req, trace, {}) is None
