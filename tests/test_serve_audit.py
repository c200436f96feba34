"""Auditing a deployment through HTTP: `lpf serve` (a real server in a child process on 127.0.0.1) +
`lpf audit --engine openai` with 64 concurrent requests. Without a fault: clean. With the seed's
stale-state fault and a small cache: the lying requests are found through HTTP alone, and they are
exactly among the ones the server's own ground truth (its --trace-dir) says were corrupted.

Both servers run tiny:jamba (the seed's Mamba1 + attention architecture) with the same knobs; the
8-token step budget and 8 sequences make a new request regularly get 1 token of budget (the pre-fix
classification's trigger) while slots recycle.
"""

from __future__ import annotations

import json
import urllib.request

import pyarrow.parquet as pq
import pytest

from conftest import write_prompts

pytestmark = pytest.mark.slow  # long end-to-end runs: `make test-fast` skips them

MODEL = "tiny:jamba"
KNOBS = ["--cache-mb", 1, "--max-num-batched-tokens", 8, "--max-num-seqs", 8]


@pytest.fixture(scope="module")
def prompts64(tmp_path_factory):
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=11, n=64)
    return write_prompts(
        tmp_path_factory.mktemp("serve-audit") / "p64.jsonl",
        [{"id": it["id"], "prompt": it["prompt"], "expected": it["expected"]} for it in items],
    )


def _audit(lpf_cli, server, prompts, out):
    return lpf_cli(
        "audit",
        "--engine",
        "openai",
        "--base-url",
        server.base_url + "/v1",
        "--model",
        MODEL,
        "--workload",
        prompts,
        "--max-tokens",
        16,
        "-E",
        "concurrency=64",
        "--out",
        out,
        "--json",
    )


def _metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.base_url + "/metrics", timeout=10).read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_audit_through_http_clean_then_stale_state_found(lpf_cli, tmp_path, prompts64):
    from lpf.serve.process import served

    env = {"OMP_NUM_THREADS": "1"}
    with served("--model", MODEL, *KNOBS, env=env) as server:
        r = _audit(lpf_cli, server, prompts64, tmp_path / "clean")
        batched = _metric(server, "lpf_batch_size_max")
    assert r.code == 0, r.err
    f = json.loads(r.out)
    assert f["verdict"] == "clean" and f["n_requests"] == 64 and f["errors"] == 0
    assert f["counts"]["clean"] == 64
    assert batched > 1  # concurrent HTTP requests shared engine steps

    trace = tmp_path / "server-trace"
    with served("--model", MODEL, *KNOBS, "--inject", "stale-state", "--trace-dir", trace, env=env) as server:
        r = _audit(lpf_cli, server, prompts64, tmp_path / "stale")
    assert r.code == 1, r.err  # findings at or above the default --fail-on divergent
    f = json.loads(r.out)
    assert f["n_requests"] == 64 and f["errors"] == 0
    flagged = {x["request_id"] for x in f["flagged"]}
    assert flagged and f["counts"]["divergent"] + f["counts"]["corrupt"] == len(flagged)
    # the server's ground truth names engine requests "cmpl-<X-Request-Id>-<choice>": the UUID each
    # attempt sent, recorded on the attempt (attempts.sent_id), maps them back to our request ids
    rows = pq.read_table(tmp_path / "stale" / "requests").to_pylist()
    ours = {a["sent_id"]: r["request_id"] for r in rows for a in r["attempts"] if a["sent_id"]}
    named = {
        rid.removeprefix("cmpl-").removesuffix("-0")
        for rid in pq.read_table(trace / "faults").column("request_id").to_pylist()
    }
    assert named <= set(ours), named - set(ours)  # every imposter the server made is a request of this run
    truth = {ours[x] for x in named}
    assert flagged <= truth, flagged - truth
