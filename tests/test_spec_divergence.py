"""Where a speculating run's requests first went wrong, from the trace's speculative columns (synthetic
tables, no engine): `speculative_features.spec_divergence` (first diverged at a token of the first decode step
after the prefill, on the speculative decode path) and `signatures.sample_steps` on speculative rows
(a verify row samples 1 + accepted positions from the one after its last non-draft token)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lpf.analysis.hypotheses import rank_hypotheses
from lpf.analysis.signatures import sample_steps
from lpf.analysis.speculative_features import spec_divergence
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


def _first_decode_rows_by_row(requests, trace):
    """The per-row walk `_first_decode_rows` computes with columns: each request's rows by step, until the
    first past its prompt (a decode/verify row sampling from output position >= 0 gives (first, 1 +
    accepted, drafts)) or a prompt row off the prefill/extend path (nothing)."""
    plen = {q["request_id"]: len(q["prompt_token_ids"]) for q in requests.to_pylist()}
    rows = sorted((r for r in trace.to_pylist() if not r["preempted"]), key=lambda r: r["step"])
    out, done = {}, set()
    for r in rows:
        rid = r["request_id"]
        if rid in done or rid not in plen:
            continue
        if r["num_computed_tokens"] < plen[rid]:
            if r["phase"] not in ("prefill", "extend"):
                done.add(rid)
            continue
        drafts = r["num_draft_tokens"] or 0
        first = r["num_computed_tokens"] + r["num_scheduled_tokens"] - drafts - plen[rid]
        if r["phase"] in ("decode", "verify") and first >= 0:
            out[rid] = (first, 1 + (r["num_accepted_tokens"] or 0), drafts)
        done.add(rid)
    return out


def _random_trace(rng, n_requests):
    """Requests of random prompt lengths: prefill chunks (some on the verify path), preemptions (a
    preemption row, phase null, then the prompt again from 0), decode and verify rows with random drafts
    and accepted counts, an occasional odd row (a decode-path row sampling before the output, a null
    phase); a request the run does not have; rows shuffled."""
    rows, step = [], 0
    for i in range(n_requests + 1):
        rid, plen = f"r{i}", int(rng.integers(1, 9))
        start = int(rng.integers(0, 6))
        computed, s = 0, start
        for _ in range(int(rng.integers(1, 9))):
            if rng.random() < 0.1:  # preempted: a row with phase null, then its prompt from scratch
                rows.append({**_row(s, rid, None, 0, 0), "preempted": True, "num_draft_tokens": None})
                computed, s = 0, s + 1
                continue
            if computed < plen:
                chunk = int(rng.integers(1, plen - computed + 1))
                phase = str(
                    rng.choice(["prefill" if computed == 0 else "extend", "verify", "decode"], p=[0.8, 0.1, 0.1])
                )
                rows.append(_row(s, rid, phase, computed, chunk))
                computed += chunk
            else:
                drafts = int(rng.integers(0, 4))
                accepted = int(rng.integers(0, drafts + 1)) if drafts else None
                phase = "verify" if drafts else str(rng.choice(["decode", "extend", None], p=[0.85, 0.1, 0.05]))
                back = int(rng.integers(0, 3)) if rng.random() < 0.1 else 0  # samples before the output
                rows.append(_row(s, rid, phase, computed - back, 1 + drafts, drafts, accepted))
                computed += 1 + (accepted or 0)
            s += 1
        step = max(step, s)
        # a step that saw two rows of the request (a tie the walk takes in trace order)
        if rng.random() < 0.05:
            rows.append(_row(start, rid, "decode", plen, 1))
        rows[-1]["prompt_len"] = plen
    plens = {r["request_id"]: r.pop("prompt_len") for r in rows if "prompt_len" in r}
    requests = pa.Table.from_pylist(
        [
            {
                "request_id": f"r{i}",
                "seq": i,
                "prompt_id": f"p{i}",
                "rollout": 0,
                "prompt_token_ids": [1] * plens[f"r{i}"],
            }
            for i in range(n_requests)  # the last request's rows are in the trace, the request is not
        ],
        schema=REQUESTS,
    )
    order = rng.permutation(len(rows))
    return requests, pa.Table.from_pylist([rows[i] for i in order], schema=SCHEMA)


def test_first_decode_rows_by_columns_is_the_per_row_walk():
    from lpf.analysis.speculative_features import _first_decode_rows

    rng = np.random.default_rng(7)
    seen = set()
    for _ in range(40):
        requests, trace = _random_trace(rng, int(rng.integers(1, 30)))
        want = _first_decode_rows_by_row(requests, trace)
        assert _first_decode_rows(requests, trace) == want
        seen |= {("drafts" if d else "none", n > 1) for _, n, d in want.values()}
    assert {("drafts", True), ("drafts", False), ("none", False)} <= seen  # the cases were reached
    requests, trace = _random_trace(rng, 3)
    assert _first_decode_rows(requests, trace.slice(0, 0)) == {}
