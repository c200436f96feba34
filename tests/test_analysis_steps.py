"""One analysis, two executions: the in-memory (`findings.analyze`) and the streamed analysis
(`lpf analyze --stream`) run the steps of `lpf.analysis.steps.STEPS`, in that order, and write the
same findings.json byte for byte and the same summary.parquet, on one run of every drill family:
the seed's bugs with prompt logprobs (stale-state), prefix caching (conv-into-shared-block on 24
shared-prefix prompts: hits, no request flagged at that size),
speculative sampled decisions (spec-draft-probs-permuted: the decision test flags requests), a server
penalty, a logprob temperature of the server's own, answers that contradict themselves or move sure
tokens (the floor inferred from the errors or declared), and tokens only. The last three are built from
arrays as the penalty tests build theirs (a greedy engine choosing from penalised logits, logprobs
reported at T = 0.7), written as run directories of several parts and read in small chunks, also
with the fits' samples made small (the streamed analysis must take the same sample from its chunks).
Each execution records the steps it ran: walked against `STEPS`, a step added to one execution only
fails here."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import lpf_main, write_prompts
from lpf.analysis.steps import NAMES, Ran
from lpf.analysis.thresholds import Thresholds
from lpf.pipeline import stream_memory, stream_parts
from lpf.pipeline.analyze import analyze_run
from lpf.run import schema
from lpf.run.store import RunDir

V, K = 40, 5


def both_ways(src, tmp, monkeypatch, chunk_rows: int = 300):
    """(in-memory, streamed): (findings.json bytes, summary table, findings, steps ran), each on a copy."""
    monkeypatch.setattr(stream_parts, "CHUNK_ROWS", chunk_rows)
    out = []
    for stream in (False, True):
        d = tmp / f"stream-{stream}"
        shutil.copytree(src, d)
        ran = Ran()
        analyze_run(RunDir.open(d), Thresholds(), attribute=False, stream=stream, ran=ran)
        raw = (d / "findings.json").read_bytes()
        out.append((raw, pq.read_table(d / "summary.parquet"), json.loads(raw), list(ran)))
    return out


def assert_one_analysis(mem, st):
    assert mem[3] == st[3] == list(NAMES)  # every step, in order, in both executions
    assert st[0] == mem[0]
    assert st[1].equals(mem[1])


def _audit(tmp, *args):
    proc = lpf_main(
        "audit", "--engine", "builtin", "--no-attribution", "--out", tmp / "run", "--fail-on", "never", *args
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return tmp / "run"


@pytest.fixture(scope="module")
def oracle40(tmp_path_factory):
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=3, n=40)
    return write_prompts(
        tmp_path_factory.mktemp("w") / "p.jsonl", [{"id": i["id"], "prompt": i["prompt"]} for i in items]
    )


@pytest.mark.slow  # its own audit (~6 s)
def test_seed_bug_with_prompt_logprobs(tmp_path, monkeypatch, oracle40):
    run = _audit(
        tmp_path, "--model", "tiny:jamba-longmem", "--workload", oracle40, "--n", 2, "--max-tokens", 8,
        "--inject", "stale-state", "--cache-mb", 3, "--max-num-seqs", 16, "--max-num-batched-tokens", 32,
        "--prompt-logprobs",
    )  # fmt: skip
    mem, st = both_ways(run, tmp_path, monkeypatch)
    f = mem[2]
    assert f["flagged"] and "prompt" in f and "run_test" in f
    assert_one_analysis(mem, st)


@pytest.mark.slow  # its own audit (~6 s)
def test_prefix_caching_drill(tmp_path, monkeypatch):
    from lpf.zoo import registry

    items = [{k: it[k] for k in ("id", "prompt")} for it in registry.workload_items("shared-prefix", n=24)]
    prompts = write_prompts(tmp_path / "p.jsonl", items)
    run = _audit(
        tmp_path, "--model", "tiny:jamba-longmem", "--workload", prompts, "--max-tokens", 8, "--cache-mb", 3,
        "--max-num-batched-tokens", 48, "--enable-prefix-caching", "--inject", "conv-into-shared-block",
    )  # fmt: skip
    mem, st = both_ways(run, tmp_path, monkeypatch)
    f = mem[2]
    # what the prompts share is read from their ids (the streamed requests hold their lengths only)
    assert f["prefix_cache"]["requests_hit"] and f["prefix_cache"]["requests_sharing"]
    assert_one_analysis(mem, st)


@pytest.mark.slow  # its own audit with a draft model (~15 s)
def test_speculative_sampled_decisions(tmp_path, monkeypatch, oracle40):
    """spec-draft-probs-permuted (bench/bugs.py's configuration, 40 prompts): the decision test runs in
    both executions and flags the same requests (the streamed one used to report the run clean)."""
    run = _audit(
        tmp_path, "--model", "tiny:jamba-longmem", "--workload", oracle40, "--n", 2, "--max-tokens", 12,
        "--temperature", 1.0, "-E", "speculative=draft:zoo:llama:4", "--max-num-seqs", 8,
        "--max-num-batched-tokens", 256, "--seed", 5, "--inject", "spec-draft-probs-permuted",
    )  # fmt: skip
    mem, st = both_ways(run, tmp_path, monkeypatch)
    f = mem[2]
    assert f["spec_decisions"]["requests"] > 0 and any("spec_decision" in r for r in f["flagged"])
    assert_one_analysis(mem, st)


def _synthetic(path, mech: str = "none", value: float = 1.0, hot: float | None = None, n_req: int = 90, parts=3):
    """A greedy run written as a run directory: prompts of a few tokens (repeats), raw logits N(0, 3),
    the engine's token the argmax of the logits under a `mech` penalty of `value`; its reported
    logprobs the raw ones (1e-6 apart) or, with `hot`, log-softmax(z / hot) over the top-k and the token."""
    rng = np.random.default_rng(3)
    run = RunDir.create(
        path,
        {
            "run_id": "synthetic",
            "status": "complete",
            "engine": {"name": "openai", "options": {}},
            "model": {"spec": "zoo:hybrid"},
            "reference": {"spec": "zoo:hybrid", "dtype": "float32"},
            "sampling": {"temperature": 0.0},
        },
    )
    per = -(-n_req // parts)
    for first in range(0, n_req, per):
        req, tok, ref = {k: [] for k in ("id", "prompt", "out")}, [], []
        for r in range(first, min(n_req, first + per)):
            prompt, out = rng.integers(0, 12, rng.integers(4, 12)).tolist(), []
            for p in range(20):
                z = rng.normal(0.0, 3.0, V)
                pz = z.copy()
                if mech == "repetition_penalty":
                    seen = sorted(set(prompt) | set(out))
                    pz[seen] = np.where(z[seen] > 0, z[seen] / value, z[seen] * value)
                t = int(np.argmax(pz))
                lse = float(np.log(np.exp(z - z.max()).sum()) + z.max())
                lp = z - lse
                top = np.argsort(-lp)[:K]
                eng = float(lp[t]) + rng.normal(0, 1e-6)
                if hot is not None:
                    terms = np.r_[lp[top] / hot, [] if t in top else [lp[t] / hot]]
                    eng = float(lp[t] / hot - np.logaddexp.reduce(terms))
                tok.append((f"r{r:04d}", p, t, eng))
                ref.append((f"r{r:04d}", p, float(lp[t]), top.tolist(), lp[top].tolist(), lse, int(top[0])))
                out.append(t)
            req["id"].append(f"r{r:04d}"), req["prompt"].append(prompt), req["out"].append(out)
        n = len(req["id"])
        requests = schema.table(
            schema.REQUESTS,
            {
                "request_id": req["id"],
                "seq": np.arange(first, first + n, dtype=np.int64),
                "prompt_id": req["id"],
                "rollout": np.zeros(n, np.int32),
                "prompt_token_ids": pa.array(req["prompt"], pa.list_(pa.int32())),
                "output_token_ids": pa.array(req["out"], pa.list_(pa.int32())),
                "finish_reason": ["length"] * n,
            },
        )
        tokens = schema.table(
            schema.TOKENS,
            {
                "request_id": [x[0] for x in tok],
                "position": pa.array([x[1] for x in tok], pa.int32()),
                "token_id": pa.array([x[2] for x in tok], pa.int32()),
                "engine_logprob": [x[3] for x in tok],
            },
        )
        reference = schema.table(
            schema.REFERENCE,
            {
                "request_id": [x[0] for x in ref],
                "position": pa.array([x[1] for x in ref], pa.int32()),
                "ref_logprob": [x[2] for x in ref],
                "ref_rank": pa.array([1] * len(ref), pa.int32()),
                "ref_top1_id": pa.array([x[6] for x in ref], pa.int32()),
                "ref_top1_logprob": [x[4][0] for x in ref],
                "ref_topk_ids": pa.array([x[3] for x in ref], pa.list_(pa.int32())),
                "ref_topk_logprobs": pa.array([x[4] for x in ref], pa.list_(pa.float32())),
                "ref_logsumexp": pa.array([x[5] for x in ref], pa.float32()),
            },
        )
        run.append_requests(requests, tokens)
        run.append("reference", reference)
    return path


@pytest.mark.parametrize("sample", ["whole", "sampled", "sampled-some-without-lse"])
def test_server_penalty(tmp_path, monkeypatch, sample):
    """The penalty fit on every request, and on the fit's sample of requests (MAX_POSITIONS lowered:
    every 2nd request), known before the pass or, with reference rows lacking a log-sum-exp, after it."""
    from lpf.analysis import penalty_evidence

    run = _synthetic(tmp_path / "run", "repetition_penalty", 1.3)
    if sample != "whole":
        monkeypatch.setattr(penalty_evidence, "MAX_POSITIONS", 400)  # 1,800 rows: every 2nd request
    if sample == "sampled-some-without-lse":
        part = RunDir.open(run).parts("reference")[1]
        t = pq.read_table(part)
        lse = t.column("ref_logsumexp").to_pylist()
        pq.write_table(t.set_column(t.column_names.index("ref_logsumexp"), "ref_logsumexp", pa.array(
            [None if i % 9 == 0 else x for i, x in enumerate(lse)], pa.float32())), part)  # fmt: skip
    mem, st = both_ways(run, tmp_path, monkeypatch)
    fit = mem[2]["server_processing"]["penalty"]
    assert fit["mechanism"] == "repetition_penalty" and abs(fit["value"] - 1.3) <= 0.05
    # the requests whose only flips it explains are the server's sampling, no longer divergent (on a sample
    # of half the requests, only those sampled can be)
    assert fit["lowered"] > 0 or sample != "whole", mem[2]["counts"]
    summary = mem[1]
    n = len(summary.column("server_processing").drop_null()) if "server_processing" in summary.column_names else 0
    assert n == fit["lowered"]
    assert_one_analysis(mem, st)


@pytest.mark.parametrize("sample", [False, True], ids=["whole", "sampled"])
def test_logprob_temperature(tmp_path, monkeypatch, sample):
    """Logprobs reported at T = 0.7 on a greedy run: the fit (on every departing token, or on every
    k-th: MAX_TEMPERED_TOKENS lowered) and the tempered signature at it, both ways alike."""
    from lpf.analysis import signatures

    if sample:
        monkeypatch.setattr(signatures, "MAX_TEMPERED_TOKENS", 300)
    monkeypatch.setattr(stream_memory, "KEEP_ROWS", 500)  # the departing rows go to files part way
    run = _synthetic(tmp_path / "run", hot=0.7)
    mem, st = both_ways(run, tmp_path, monkeypatch)
    fit = mem[2]["server_processing"]["logprob_temperature"]
    assert abs(fit["value"] - 0.7) <= 0.02 and (fit["tokens"] <= 300) == sample
    assert mem[2]["hypotheses"][0]["feature"] == "tempered_logprobs"
    assert_one_analysis(mem, st)


def test_tokens_only(tmp_path, monkeypatch):
    """A run whose engine returned no logprob: both executions judge it from its tokens alone (one
    judge, `tokens_only`: no step of the list runs)."""
    run = _synthetic(tmp_path / "run")
    for part in RunDir.open(run).parts("tokens"):
        t = pq.read_table(part)
        pq.write_table(t.set_column(3, "engine_logprob", pa.nulls(t.num_rows, pa.float64())), part)
    mem, st = both_ways(run, tmp_path, monkeypatch)
    assert mem[2]["judged"]["logprobs"] == "none" and mem[3] == st[3] == []
    assert st[0] == mem[0]
    assert st[1].schema == mem[1].schema and st[1].to_pandas().equals(mem[1].to_pandas())  # NaN where NaN


def test_a_step_outside_the_list_is_refused():
    with pytest.raises(KeyError, match="not in lpf.analysis.steps.STEPS"):
        Ran().step("a_new_step")


@pytest.mark.parametrize("engine_dtype", [None, "bfloat16"], ids=["inferred", "declared"])
def test_answer_checks(tmp_path, monkeypatch, engine_dtype):
    """Answers that contradict themselves (a token's logprob and its top-k entry disagree) and sure tokens
    lowered by 1.5 nats (test_configured_judgement's lying server), the floor inferred from the errors or
    declared: both executions raise the same requests with the same blocks."""
    import math

    rng = np.random.default_rng(3)
    engine = {"name": "openai", "options": {"dtype": engine_dtype} if engine_dtype else {}}
    run = RunDir.create(
        tmp_path / "run",
        {
            "run_id": "lies",
            "status": "complete",
            "engine": engine,
            "model": {"spec": "zoo:hybrid"},
            "reference": {"spec": "zoo:hybrid", "dtype": "float32"},
            "sampling": {"temperature": 0.0},
        },
    )
    for first in range(0, 60, 20):
        req, tok, ref = [], [], []
        for i in range(first, first + 20):
            rid = f"r{i:03d}"
            req.append({"request_id": rid, "seq": i, "prompt_id": rid, "rollout": 0, "prompt_token_ids": [1]})
            for p in range(12):
                r = math.log(0.999) if p % 3 else math.log(rng.uniform(0.3, 0.6))
                e = top_e = r + rng.normal(0, 3e-6)
                if i % 5 == 0 and p >= 6:  # lowered; every other one leaves its top-k entry as it was
                    e -= 1.5
                    top_e = e if i % 10 == 0 else top_e
                second = math.log1p(-math.exp(r)) - 0.5
                tok.append({"request_id": rid, "position": p, "token_id": 7, "engine_logprob": e,
                            "engine_topk_ids": [7, 8], "engine_topk_logprobs": [top_e, min(top_e, second + 0.5) - 0.5]})  # fmt: skip
                ref.append({"request_id": rid, "position": p, "ref_logprob": r, "ref_rank": 1, "ref_entropy": 0.5,
                            "ref_top1_id": 7, "ref_top1_logprob": r, "ref_topk_ids": [7, 8],
                            "ref_topk_logprobs": [r, second]})  # fmt: skip
            req[-1]["output_token_ids"] = [7] * 12
        run.append_requests(
            pa.Table.from_pylist(req, schema=schema.REQUESTS), pa.Table.from_pylist(tok, schema=schema.TOKENS)
        )
        run.append("reference", pa.Table.from_pylist(ref, schema=schema.REFERENCE))
    mem, st = both_ways(run.path, tmp_path, monkeypatch, chunk_rows=100)
    f = mem[2]
    assert f["self_contradiction"]["requests"] == 6 and len(f["flagged"]) == 12
    assert_one_analysis(mem, st)


def _sent(run, temperatures) -> None:
    """Each request's own sampling column: the temperature its client sent (`temperatures(i)`: request i's)."""
    at = 0
    for part in RunDir.open(run).parts("requests"):
        t = pq.read_table(part)
        sent = [{"temperature": temperatures(at + i)} for i in range(t.num_rows)]
        at += t.num_rows
        col = pa.array(sent, schema.SAMPLING)
        pq.write_table(t.set_column(t.column_names.index("sampling"), "sampling", col), part)


def test_per_request_sampling(tmp_path, monkeypatch):
    """Requests that all sent temperature 0 in a run whose manifest says 0.7 are judged greedy by both
    executions alike (the penalty found); requests of mixed settings are refused by `--stream` in one line."""
    from lpf.core.errors import LpfError

    run = _synthetic(tmp_path / "run", "repetition_penalty", 1.3, n_req=60)
    m = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**m, "sampling": {"temperature": 0.7}}))
    _sent(run, lambda i: 0.0)
    mem, st = both_ways(run, tmp_path / "alike", monkeypatch)
    assert mem[2]["server_processing"]["penalty"]["mechanism"] == "repetition_penalty"
    assert_one_analysis(mem, st)
    _sent(run, lambda i: 0.0 if i % 2 else 0.8)
    with pytest.raises(LpfError, match="mixed|several kinds.*--no-stream"):
        analyze_run(RunDir.open(run), Thresholds(), attribute=False, stream=True)
