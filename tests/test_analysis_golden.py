"""Golden findings: fixed synthetic runs whose findings.json and per-request summary are pinned.

The speed work on the analysis (issue 27) must change nothing a user sees: these files were written by
the code before it (main at 3a53f69) and every later version must reproduce them on any machine (floats
within `REL` / `ABS`, derived where they are set; all else exactly). The runs cover the paths the hot loop has: greedy and sampled, tables that line up row for row and ones that
need the join, tokens out of arrival order, the run-level test on every k-th token, the run's own
calibration, a calibration run, an expected floor, prompt positions, a trace (crossed wires, slot
features, divergence steps), NaN logprobs, failed, unscored and inconsistent requests, attempts, the
tempered-logprob signature; and two run directories analysed by `analyze_run` in memory and streamed.

Regenerate only for a change meant to change findings (or after merging one), and say so in its commit,
with the code that makes that change and not the code under test, e.g. main's after a merge:
`git archive main src | tar -x -C /tmp/m && LPF_WRITE_GOLDEN=1 PYTHONPATH=/tmp/m/src pytest
tests/test_analysis_golden.py` rewrites tests/data/golden/. So the module builds its tables itself and
patches only knobs every version has (where they live moved: `_knob`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lpf.analysis.findings import analyze
from lpf.analysis.thresholds import Thresholds
from lpf.core.jsonsafe import finite
from lpf.run import schema

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden"
WRITE = os.environ.get("LPF_WRITE_GOLDEN") == "1"
FLOAT32 = {"engine_dtype": "float32", "reference_dtype": "float32", "model": "zoo:hybrid"}


def _lists(matrix: np.ndarray, typ) -> pa.Array:
    n, k = matrix.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)), pa.array(matrix.ravel(), typ))


def edge_run(temperature: float = 0.0, seed: int = 11):
    """(requests, tokens, reference, trace, prompt_tokens, prompt_reference, calibration) of a small
    run with every kind of request: honest (float32-level noise), corrupt from a position on (in
    state slots >= 48), a near-tie flip, a swapped pair (crossed wires), a NaN logprob, two failed
    requests, an unscored one, inconsistent answers, HTTP attempts. Token rows are grouped by
    request in an order other than arrival."""
    rng = np.random.default_rng(seed)
    n_req, n_tok, plen_max = 240, 12, 40
    ids = np.array([f"p{i // 2}-r{i % 2}" for i in range(n_req)], dtype=object)  # ids of varying length
    plen = rng.integers(4, plen_max, n_req)
    failed = np.zeros(n_req, bool)
    failed[[17, 150]] = True
    steps_of = np.arange(n_req) // 6  # six requests arrive each step
    slot = (np.arange(n_req) * 7) % 64
    corrupt = (slot >= 48) & (rng.random(n_req) < 0.5) & ~failed
    onset = rng.integers(0, n_tok - 4, n_req)
    vocab = 300
    token = rng.integers(3, vocab, (n_req, n_tok)).astype(np.int32)
    ref_lp = -np.abs(rng.normal(0.3, 0.4, (n_req, n_tok)))
    eng_lp = ref_lp + rng.normal(0, 2e-6, (n_req, n_tok))
    top1 = token.copy()
    top1_lp = ref_lp.copy()
    pos = np.broadcast_to(np.arange(n_tok), (n_req, n_tok))
    lie = corrupt[:, None] & (pos >= onset[:, None])
    eng_lp[lie] = -0.02
    ref_lp[lie] = -rng.uniform(6, 15, int(lie.sum()))
    top1[lie] = (token[lie] + 1) % vocab
    top1_lp[lie] = -0.03
    flip = 31  # a near-tie greedy flip: the reference prefers another token by a hair
    top1[flip, 5], top1_lp[flip, 5], ref_lp[flip, 5] = token[flip, 5] + 1, -0.69, -0.70
    eng_lp[flip, 5] = -0.70 + 1e-6
    a, b, at = 60, 61, 4  # same arrival step: each got the token the other's reference expected
    ta, tb = token[a, at], token[b, at]
    top1[a, at], top1[b, at] = tb, ta
    top1_lp[a, at] = top1_lp[b, at] = -0.05
    ref_lp[a, at] = ref_lp[b, at] = -4.0
    eng_lp[a, at] = eng_lp[b, at] = -0.05
    eng_lp[90, 3] = np.nan  # an engine that returned no number
    rank = np.where(token == top1, 1, 4).astype(np.int32)
    rtop = np.stack([top1, top1 + 7, top1 + 9], -1).astype(np.int32)
    rtop_lp = np.stack([top1_lp, top1_lp - 2.5, top1_lp - 3.5], -1).astype(np.float32)
    if temperature:  # a third of the requests report the reference's tempered logprobs as raw
        lse = np.log(np.exp(rtop_lp.astype(np.float64) / temperature).sum(-1))
        hot = (np.arange(n_req) % 3 == 0)[:, None] & ~lie & (token == top1)
        eng_lp = np.where(hot, ref_lp / temperature - lse, eng_lp)
    etop = np.stack([token, token + 1, token + 2], -1).astype(np.int32)
    # the engine's own top-k as an honest answer has it: its token's entry its reported logprob, the others
    # below it and within the rest of the mass (the answer never contradicts itself, `self_contradiction`)
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.log(np.maximum(-np.expm1(np.minimum(eng_lp, -1e-9)), 1e-12)) + np.log(0.6)
    second = np.where(np.isnan(eng_lp), eng_lp, np.minimum(eng_lp - 2, rest))
    etop_lp = np.stack([eng_lp, second, second - 1], -1).astype(np.float32)

    inconsistency = np.full(n_req, None, dtype=object)
    inconsistency[[5, 61]] = ["token_count: 12 tokens, 13 logprobs", "text: differs from the tokens"]
    attempts = [
        [
            {
                "attempt": 0,
                "sent": True,
                "status": 200 if not failed[i] else 500,
                "error": None if not failed[i] else "HTTP 500",
                "t_start": 100.0 + i,
                "t_end": 100.5 + i,
            }
        ]
        for i in range(n_req)
    ]
    requests = schema_table(
        schema.REQUESTS,
        {
            "request_id": ids,
            "seq": np.arange(n_req, dtype=np.int64),
            "prompt_id": np.array([f"p{i // 2}" for i in range(n_req)], dtype=object),
            "rollout": (np.arange(n_req) % 2).astype(np.int32),
            "prompt_token_ids": pa.array(
                [list(range(1, p + 1)) for p in plen], schema.REQUESTS.field("prompt_token_ids").type
            ),
            "output_token_ids": pa.array(
                [[] if failed[i] else token[i].tolist() for i in range(n_req)],
                schema.REQUESTS.field("output_token_ids").type,
            ),
            "finish_reason": np.where(failed, "error", "length").astype(object),
            "error": pa.array([("engine died" if f else None) for f in failed], pa.string()),
            "t_submit": 100.0 + np.arange(n_req),
            "t_first_token": 100.2 + np.arange(n_req),
            "t_finish": 100.5 + np.arange(n_req),
            "inconsistency": pa.array(inconsistency.tolist(), pa.string()),
            "attempts": pa.array(attempts, schema.REQUESTS.field("attempts").type),
        },
    )

    rows = np.flatnonzero(~failed)
    order = np.r_[rows[rows % 3 == 1], rows[rows % 3 != 1]]  # grouped by request, not in arrival order
    rid = np.repeat(ids[order], n_tok)
    flat = lambda x: x[order].reshape(order.size * n_tok, *x.shape[2:])  # noqa: E731
    p = np.tile(np.arange(n_tok, dtype=np.int32), order.size)
    tokens = schema_table(
        schema.TOKENS,
        {
            "request_id": rid,
            "position": p,
            "token_id": flat(token),
            "engine_logprob": flat(eng_lp),
            "engine_topk_ids": _lists(flat(etop), pa.int32()),
            "engine_topk_logprobs": _lists(flat(etop_lp), pa.float32()),
        },
    )
    reference = schema_table(
        schema.REFERENCE,
        {
            "request_id": rid,
            "position": p,
            "ref_logprob": flat(ref_lp),
            "ref_rank": flat(rank),
            "ref_entropy": np.full(rid.size, 0.4, np.float32),
            "ref_top1_id": flat(top1),
            "ref_top1_logprob": flat(top1_lp),
            "ref_topk_ids": _lists(flat(rtop), pa.int32()),
            "ref_topk_logprobs": _lists(flat(rtop_lp), pa.float32()),
        },
    )
    unscored = ids[order[7]]
    keep = np.asarray(reference.column("request_id").to_numpy(zero_copy_only=False) != unscored)
    reference = reference.filter(pa.array(keep))

    # the trace: a prefill step at arrival, then one decode a step per output token
    t_rows = [
        (
            int(steps_of[i]) + j,
            ids[i],
            "prefill" if j == 0 else "decode",
            0 if j == 0 else int(plen[i]) + j - 1,
            int(plen[i]) if j == 0 else 1,
            int(slot[i]),
            12,
            40,
            False,
        )
        for i in rows
        for j in range(n_tok)
    ]
    trace = pa.Table.from_pylist([dict(zip(schema.TRACE.names, r)) for r in t_rows], schema=schema.TRACE)

    # prompt positions 1..plen-1 of the honest half, one request departing at position 3
    pr = [i for i in rows if i % 2 == 0]
    prid = np.concatenate([[ids[i]] * (plen[i] - 1) for i in pr])
    ppos = np.concatenate([np.arange(1, plen[i]) for i in pr]).astype(np.int32)
    p_ref = -np.abs(rng.normal(1.0, 0.8, prid.size))
    p_eng = p_ref + rng.normal(0, 2e-6, prid.size)
    p_eng[(prid == ids[pr[3]]) & (ppos >= 3)] -= 2.5
    empty_i = pa.array([[]] * prid.size, pa.list_(pa.int32()))
    empty_f = pa.array([[]] * prid.size, pa.list_(pa.float32()))
    prompt_tokens = schema_table(
        schema.PROMPT_TOKENS,
        {
            "request_id": prid,
            "position": ppos,
            "token_id": np.ones(prid.size, np.int32),
            "engine_logprob": p_eng,
            "engine_topk_ids": empty_i,
            "engine_topk_logprobs": empty_f,
        },
    )
    prompt_reference = schema_table(
        schema.PROMPT_REFERENCE,
        {
            "request_id": prid,
            "position": ppos,
            "ref_logprob": p_ref,
            "ref_rank": np.ones(prid.size, np.int32),
            "ref_entropy": np.ones(prid.size, np.float32),
            "ref_top1_id": np.ones(prid.size, np.int32),
            "ref_top1_logprob": p_ref,
            "ref_topk_ids": empty_i,
            "ref_topk_logprobs": empty_f,
        },
    )

    calibration = reference.set_column(
        2, "ref_logprob", pa.array(reference.column("ref_logprob").to_numpy() + rng.normal(0, 3e-6, reference.num_rows))
    )
    return requests, tokens, reference, trace, prompt_tokens, prompt_reference, calibration


def schema_table(target: pa.Schema, columns: dict) -> pa.Table:
    """A table of `target` with these columns, the others null (built here, not by the code under test)."""
    n = len(next(iter(columns.values())))
    return pa.table(
        {f.name: (columns[f.name] if f.name in columns else pa.nulls(n, f.type)) for f in target}, schema=target
    )


def _knob(monkeypatch, modules: tuple[str, ...], name: str, value) -> None:
    """Set `name` in the first of `modules` that has it (a knob that moved between versions)."""
    import importlib

    for mod in modules:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, name):
            monkeypatch.setattr(m, name, value)
            return
    raise AssertionError(f"no {name} in {modules}")


def shuffled(table: pa.Table, seed: int) -> pa.Table:
    return table.take(pa.array(np.random.default_rng(seed).permutation(table.num_rows)))


def _floor_table():
    from lpf.pipeline.analyze import floor_table

    return floor_table()


ENGINE_INFO = {"name": "builtin", "options": {"dtype": "float32"}, "state_slot_stride": 14880}


def case_tables(name: str):
    """(requests, tokens, reference, kwargs for `analyze`) of each in-memory golden case."""
    temperature = 0.7 if name == "sampled-tempered" else 0.0
    req, tok, ref, trace, ptok, pref, cal = edge_run(temperature)
    kw = dict(greedy=temperature == 0, temperature=temperature, trace=trace, engine_info=ENGINE_INFO)
    sampling = {"temperature": temperature}
    if name == "greedy-floor-zip":  # tables that line up row for row, the expected floor, the run-level test
        kw.update(floor_table=_floor_table(), run_info={**FLOAT32, "sampling": sampling})
    elif name == "joined-own-floor-prompt":  # the hash join, the run's own floor, prompt positions
        ref = shuffled(ref, 1)
        kw.update(prompt_tokens=ptok, prompt_reference=shuffled(pref, 2), chunk_budget=16)
    elif name == "calibration-run":  # a calibration run's floor and the expected floor's test
        kw.update(
            calibration=shuffled(cal, 3),
            calibration_info={"dtype": "float32", "reference_dtype": "float32", "same_as_reference": True},
            floor_table=_floor_table(),
            run_info={**FLOAT32, "sampling": sampling},
        )
    elif name == "sampled-tempered":  # sampled, tempered logprobs, no trace
        kw.update(trace=None, floor_table=_floor_table(), run_info={**FLOAT32, "sampling": sampling})
    return req, tok, ref, kw


CASES = ("greedy-floor-zip", "joined-own-floor-prompt", "calibration-run", "sampled-tempered")


# Floats agree within a tolerance derived from how they are computed, everything else exactly (keys, strings,
# ints, bools, lengths, orders: every verdict, count, id and flagged list). The pins are written on one
# machine and read on any other, whose numpy and pyarrow pick other SIMD kernels (AVX-512 vs AVX2) for sums
# and for exp/log: the same inputs then round differently in the last bits.
# - REL: a float64 reduction over n values moves by at most ~n x 2^-52 relative when its order changes; the
#   largest golden run has 40,000 scored tokens (40,000 x 2.2e-16 = 8.9e-12), and exp/log kernels differ by a
#   few ulp a term: 1e-9 leaves a 100x margin over both and is still 1e6 below the 3-4 significant digits a
#   user reads (2026-12-07: an AVX-512 machine moved prob_diff's p90 by 2.6e-11 relative, past the old 1e-12).
# - ABS: quantities computed as the small difference of O(1) numbers carry the operands' absolute rounding,
#   not a relative one: prob_diff = |exp(a) - exp(b)| with a ~ b (1.7e-6 from two ~0.74 whose ulp is 1.1e-16),
#   k3_kl = rho - log(rho) - 1 ~ d^2/2 (2e-12 from rho ~ 1: a relative error near 1e-4). A few ulp of an O(1)
#   operand, summed pairwise (numpy) over <= 40,000 terms, stays below 1e-14: 1e-12 keeps a 100x margin.
# Neither bound can hide a change in a decision: the decisions are the non-float values, compared exactly.
REL = 1e-9
ABS = 1e-12


def _close(got: float, want: float) -> bool:
    return (got != got and want != want) or math.isclose(got, want, rel_tol=REL, abs_tol=ABS)


def _same(got, want, where: str = "findings") -> None:
    """`got` == `want` with floats within REL / ABS (NaN equal to NaN); keys, strings, ints and lengths exactly."""
    if isinstance(want, float) and isinstance(got, (float, int)) and not isinstance(got, bool):
        assert _close(float(got), want), (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, sorted(set(got) ^ set(want)))
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, len(got), len(want))
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want and type(got) is type(want), (where, got, want)


def same_summary(got: pa.Table, want: pa.Table, where: str) -> None:
    """The per-request summary: the same schema and rows in the same order; float columns within REL /
    ABS element by element (NaN equal to NaN, nulls in the same rows), every other column exactly."""
    assert got.schema.equals(want.schema), (where, got.schema, want.schema)
    assert got.num_rows == want.num_rows, (where, got.num_rows, want.num_rows)
    for name in want.column_names:
        g, w = got.column(name), want.column(name)
        if pa.types.is_floating(w.type):
            assert g.is_null().equals(w.is_null()), (where, name, "nulls differ")
            a = g.to_numpy(zero_copy_only=False).astype(np.float64)
            b = w.to_numpy(zero_copy_only=False).astype(np.float64)
            with np.errstate(invalid="ignore"):  # inf - inf: isclose already took equal infinities
                bad = ~np.isclose(a, b, rtol=0.0, atol=ABS, equal_nan=True)
                bad &= ~(np.abs(a - b) <= REL * np.maximum(np.abs(a), np.abs(b)))  # math.isclose's symmetric form
            rows = np.flatnonzero(bad)
            assert not rows.size, (where, name, [(int(i), a[i], b[i]) for i in rows[:5]])
        else:
            assert g.equals(w), (where, name, "differs")


def check(name: str, findings_bytes: bytes, summary: pa.Table) -> None:
    path, summary_path = GOLDEN / f"{name}.json", GOLDEN / f"{name}.summary.parquet"
    if WRITE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_bytes(findings_bytes)
        pq.write_table(summary, summary_path, compression="zstd")
    _same(json.loads(findings_bytes), json.loads(path.read_bytes()), name)  # findings differ from the pinned file
    same_summary(summary, pq.read_table(summary_path), f"{name}.summary")


def test_tolerance_tells_rounding_from_a_change():
    """REL / ABS let through what another machine's rounding moves (the issue-51 pair, a k3_kl-sized
    value a few ulp off) and catch what any change to the analysis moves (a relative 1e-6, a verdict)."""
    assert _close(1.6763690269483432e-06, 1.6763690269039343e-06)  # prob_diff p90, AVX2 vs AVX-512
    k3 = 2e-12
    assert _close(k3 + 3 * 2.2e-16, k3)
    assert not _close(0.4161 * (1 + 1e-6), 0.4161) and not _close(1.5e-7 * 1.01, 1.5e-7)
    with pytest.raises(AssertionError):
        _same({"verdict": "clean", "n": 3}, {"verdict": "noise", "n": 3})
    with pytest.raises(AssertionError):
        _same({"flagged": ["p3-r1"]}, {"flagged": ["p3-r0"]})


@pytest.mark.parametrize("name", CASES)
def test_in_memory_findings_are_pinned(name, monkeypatch):
    from lpf.analysis import run_test

    monkeypatch.setattr(run_test, "MAX_TOKENS", 700)  # the run-level test on every k-th token in arrival order
    monkeypatch.setattr(run_test, "EVIDENCE_BLOCK", 250, raising=False)  # its evidence in blocks (later code)
    req, tok, ref, kw = case_tables(name)
    summary, findings = analyze(req, tok, ref, Thresholds(), **kw)
    assert findings["flagged"] and findings["counts"]["corrupt"] > 0  # the run has lies to find
    check(name, (json.dumps(finite(findings), indent=2, default=float) + "\n").encode(), summary)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_analysis", ROOT / "bench" / "analysis.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shuffle", [False, True], ids=["zip", "ranges"])
def test_run_directory_findings_are_pinned_both_ways(tmp_path, monkeypatch, shuffle):
    """bench/analysis.py's synthetic run directory (40k tokens in parts of 3,000; top-5 lists; greedy,
    or sampled at 0.7 with reference parts that do not line up), analysed by `analyze_run` in memory
    and streamed in chunks of 999 rows, the run-level test on every 5th token."""
    from lpf.analysis import run_test
    from lpf.pipeline.analyze import analyze_run
    from lpf.run.store import RunDir

    monkeypatch.setattr(run_test, "MAX_TOKENS", 8000)
    monkeypatch.setattr(run_test, "EVIDENCE_BLOCK", 1000, raising=False)
    _knob(monkeypatch, ("lpf.pipeline.stream_parts", "lpf.pipeline.analyze_stream"), "CHUNK_ROWS", 999)
    run, _ = _bench().write_synthetic_run(
        tmp_path / "run",
        40_000,
        part_tokens=3000,
        topk=5,
        temperature=0.7 if shuffle else 0.0,
        shuffle_reference=shuffle,
        out_tokens=20,
    )
    name = "rundir-ranges" if shuffle else "rundir-zip"
    for stream in (False, True):
        d = tmp_path / f"stream-{stream}"
        shutil.copytree(run.path, d)
        analyze_run(RunDir.open(d), Thresholds(), attribute=False, stream=stream)
        f = json.loads((d / "findings.json").read_bytes())
        assert f["counts"]["corrupt"] > 0 and f["run_test"]["sampled_every"] == 5
        check(name, (d / "findings.json").read_bytes(), pq.read_table(d / "summary.parquet"))
