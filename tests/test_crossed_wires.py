"""Forensics without a trace, through HTTP alone: `lpf serve` (a real server in a child process) behind a
lying proxy on 127.0.0.1 (`crossed_proxy.LyingProxy`), audited with `lpf audit --engine openai`.

- Crossed wires: the proxy hands every 4th pair of consecutive requests each other's answers. The
  attribution ("whose answer is this?") must name the right source for >= 95% of the swapped requests
  whose answers differ, with no wrong attribution; the swapped answers whose token count disagrees
  with their response's `usage` are kept as evidence (inconsistent), scored and flagged.
- A timing drill: under open-loop arrivals (-E arrival_rate) only the requests arriving while many
  others are in flight get lying logprobs; the timing hypothesis (concurrency at arrival) ranks first.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import write_prompts
from crossed_proxy import LyingProxy

pytestmark = pytest.mark.slow  # two servers and audits end to end

MODEL = "zoo:hybrid"


@pytest.fixture(scope="module")
def server():
    from lpf.serve.process import served

    with served("--model", MODEL, "--cache-mb", 16, env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def _workload(tmp_path, n, seed):
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=seed, n=n)
    return write_prompts(tmp_path / f"w{n}.jsonl", [{"id": it["id"], "prompt": it["prompt"]} for it in items])


def _audit(lpf_cli, url, workload, out, *extra):
    r = lpf_cli(
        "audit",
        "--engine",
        "openai",
        "--base-url",
        url + "/v1",
        "--model",
        MODEL,
        "--workload",
        workload,
        "--out",
        out,
        "--json",
        "--fail-on",
        "never",
        # the proxy records its swaps by the run's own request ids (lpf sends a UUID per attempt by default)
        "-E",
        "request_id_header=lpf",
        *extra,
    )
    assert r.code == 0, r.err
    return json.loads(r.out)


def test_crossed_wires_through_a_swapping_proxy_are_attributed_to_their_source(lpf_cli, server, tmp_path):
    with LyingProxy(server.base_url, swap_every=4) as proxy:
        f = _audit(
            lpf_cli,
            proxy.url,
            _workload(tmp_path, 128, seed=5),
            tmp_path / "run",
            "--max-tokens",
            8,
            "-E",
            "concurrency=16",
        )
    swapped = {s["got"]: s["from"] for s in proxy.swaps if not s["same_tokens"]}  # an identical answer is no lie
    assert len(proxy.swaps) >= 28 and len(swapped) >= 24
    named = {a["request_id"]: a["source_request_id"] for a in f["attribution"]["attributed"]}
    right = [r for r, src in swapped.items() if named.get(r) == src]
    wrong = {r: src for r, src in named.items() if swapped.get(r) != src}
    assert len(right) >= 0.95 * len(swapped), (len(right), len(swapped))
    assert wrong == {}
    # every swapped request is flagged; every flagged one was swapped (the server itself is honest)
    assert {x["request_id"] for x in f["flagged"]} == set(swapped)
    # the hypotheses say it in words, with the gain
    top = [h for h in f["hypotheses"] if h["feature"] == "answer_of_other_request"]
    assert len(top) == len(named) and f["hypotheses"][0]["feature"] == "answer_of_other_request"
    assert (
        top[0]["sentence"].startswith(
            f"request {top[0]['request_id']} received the answer meant for request {top[0]['source_request_id']}"
        )
        and top[0]["gain_nats"] > 20
    )
    # the swapped answers keep their response's own usage and prompt_token_ids (lpf serve returns them when
    # asked): a count or a prompt that is not this request's is evidence, kept and scored
    inc = f["evidence"]["inconsistent"]
    assert inc["n"] >= 1 and set(inc["by_reason"]) <= {"token_count", "prompt_tokens"}
    assert inc["by_reason"].get("prompt_tokens", 0) >= 0.9 * len(swapped)  # a prompt, not this request's
    assert inc["scored"] == inc["n"] == inc["flagged"] and set(inc["requests"]) <= set(swapped)


def test_a_timing_hypothesis_ranks_first_when_only_concurrent_arrivals_lie(lpf_cli, server, tmp_path):
    workload = _workload(tmp_path, 200, seed=6)
    load = ["--max-tokens", 6, "-E", "concurrency=256", "-E", "arrival_rate=50", "--no-attribution"]
    # a first pass measures the concurrency this load builds on this machine; the drill corrupts its top ~40%.
    # The concurrency an open-loop load builds follows the server's speed, which a busy machine changes from
    # one pass to the next: a drill that corrupted too few or too many is set up again from its own arrivals
    with LyingProxy(server.base_url, delay_s=0.5) as calm:
        _audit(lpf_cli, calm.url, workload, tmp_path / "calm", *load)
    arrivals = calm.arrivals
    for attempt in range(3):
        cut = int(np.quantile(list(arrivals.values()), 0.6))
        with LyingProxy(server.base_url, corrupt_at=cut, delay_s=0.5) as proxy:
            f = _audit(lpf_cli, proxy.url, workload, tmp_path / f"drill-{attempt}", *load)
        corrupted, arrivals = set(proxy.corrupted), proxy.arrivals
        if 0.15 * 200 <= len(corrupted) <= 0.7 * 200:
            break
    assert 0.15 * 200 <= len(corrupted) <= 0.7 * 200, (cut, len(corrupted))
    assert {x["request_id"] for x in f["flagged"]} == corrupted  # lowered logprobs: each one is caught
    best = f["hypotheses"][0]
    assert best["feature"] == "concurrency_at_arrival", [h["sentence"] for h in f["hypotheses"][:3]]
    assert best["split"]["op"] == ">=" and "arrived while >=" in best["sentence"] and "in flight" in best["sentence"]
    assert best["flagged_with"] >= 0.9 * len(corrupted)
