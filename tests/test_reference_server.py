"""`--reference` says where the reference runs: a trusted deployment (`http(s)://HOST:PORT/v1`) or the audited
server itself (`self`), each re-scoring prompt + output through prompt logprobs (`lpf.pipeline.reference_http`).

Fast: the forms, the one-line refusals, the rank rule. Slow (real `lpf serve` children on 127.0.0.1, started
together, tiny:jamba):
- a stale-state server audited with a clean server as the `http://` reference flags the same requests as
  the same run rescored with the transformers reference, and the manifest's `reference` block says how;
  `lpf.compare` and `lpf rl rescore` given the same `http://` reference score the same way;
  vLLM's `prompt_logprobs` field and OpenAI's `echo` give the same scores;
- a 4-bit weight substitution audited with `--reference self`: never `same` (the run-level test is not
  applicable), the one-line limitation printed and in the findings, while the transformers reference and the
  trusted deployment (`different` within 100 scored tokens) see the substitution in the same run;
- a clean server with `--reference self`: clean, exit 0.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest

from conftest import write_prompts
from lpf.pipeline.reference_http import _field_ranks, reference_form
from lpf.pipeline.reference_prompt import LIMITATION
from lpf.pipeline.reference_prompt import _rank

MODEL = "tiny:jamba"
# a 4-token step budget and 4 sequences: a new request regularly gets 1 token of budget (the stale-state
# drill's trigger) while a 1 MiB cache recycles state slots
STALE = ["--cache-mb", 1, "--max-num-batched-tokens", 4, "--max-num-seqs", 4, "--inject", "stale-state"]


def test_reference_forms():
    assert reference_form(None) == "transformers" and reference_form("zoo:hybrid") == "transformers"
    assert reference_form("/models/x") == "transformers" and reference_form("self") == "self"
    assert reference_form("http://h:1/v1") == "http" and reference_form("HTTPS://h/v1") == "http"


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["--reference", "self"],
            "--reference self re-scores with the audited engine itself: it needs --engine openai (its server) or --engine vllm",
        ),
        (["--reference", "http://127.0.0.1:1/v1"], "needs --reference-model NAME"),
        (["--reference-model", "M"], "--reference-model goes with --reference http(s)://... or self"),
        (["--reference", "http://u:p@h:1/v1", "--reference-model", "M"], "--reference must not carry credentials"),
        (["--reference", "http://h:1/v1", "--reference-model", "M", "--calibrate"], "needs a transformers reference"),
        (
            ["--engine", "openai", "--base-url", "http://h:1/v1", "--model", "SERVED", "--reference", "self"],
            "--model must be the local copy of the served model",
        ),
        (
            ["--reference", "http://h:1/v1", "--reference-model", "M", "--reference-concurrency", "0"],
            "--reference-concurrency must be >= 1",
        ),
    ],
)
def test_a_reference_that_cannot_run_is_refused_in_one_line_before_the_run(lpf_cli, tmp_path, args, said):
    r = lpf_cli("audit", "--model", MODEL, "--max-tokens", 2, "--limit", 1, *args, "--out", tmp_path / "run")
    assert r.code == 2 and said in r.err, r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_rank_from_the_top_k_is_exact_inside_it_and_a_lower_bound_outside():
    assert _rank(7, -0.5, [3, 7, 9], [-0.1, -0.5, -2.0]) == 2
    assert _rank(7, -0.1, [7, 3], [-0.1, -0.1]) == 1  # a tie is not above
    assert _rank(8, -4.0, [3, 7, 9], [-0.1, -0.5, -2.0]) == 4

    class Req:
        prompt_token_ids = (5, 6, 7)

    body = {"choices": [{"prompt_logprobs": [None, {"6": {"logprob": -3.0, "rank": 12}}, {"1": {"logprob": -0.1}}]}]}
    assert _field_ranks(Req, body) == [12, None]  # the server's own rank; none given for token 7
    assert _field_ranks(Req, {"choices": [{}]}) is None


# -- real servers --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers():
    """clean, stale-state and 4-bit-weights `lpf serve`s of one model, started side by side."""
    from lpf.serve.process import served

    env = {"OMP_NUM_THREADS": "1"}
    argv = {"clean": [], "stale": STALE, "quantized": ["--inject", "quantize-weights:4"]}

    def start(args):
        cm = served("--model", MODEL, *args, env=env)
        return cm, cm.__enter__()

    with ThreadPoolExecutor(len(argv)) as pool:
        started = {k: pool.submit(start, a) for k, a in argv.items()}
    with ExitStack() as stack:
        urls, failed = {}, []
        for name, f in started.items():
            if f.exception() is not None:
                failed.append(f.exception())
                continue
            cm, s = f.result()
            stack.push(cm.__exit__)  # stopped on the way out, whichever others failed to start
            urls[name] = s.base_url + "/v1"
        if failed:
            raise failed[0]
        yield urls


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=3, n=24)
    path = tmp_path_factory.mktemp("refserver") / "w24.jsonl"
    return write_prompts(path, [{"id": it["id"], "prompt": it["prompt"]} for it in items])


def _audit(lpf_cli, url, prompts, out, *extra, code=None):
    r = lpf_cli(
        "audit",
        "--engine",
        "openai",
        "--base-url",
        url,
        "--model",
        MODEL,
        "--workload",
        prompts,
        "--max-tokens",
        8,
        "-E",
        "concurrency=24",
        "--reference-device",
        "cpu",
        "--out",
        out,
        "--json",
        *extra,
    )
    assert r.code == (0 if code is None else code), r.err
    return json.loads(r.out), r.err


def _rescore(lpf_cli, run, *reference):
    r = lpf_cli("rescore", run, "--redo", "--reference-device", "cpu", *reference)
    assert r.code == 0, r.err
    r = lpf_cli("analyze", run, "--json", "--fail-on", "never")
    assert r.code == 0, r.err
    return json.loads(r.out)


def _flagged(f) -> set:
    return {x["request_id"] for x in f["flagged"]}


@pytest.mark.slow
def test_a_trusted_deployment_flags_what_the_transformers_reference_flags(lpf_cli, servers, prompts, tmp_path):
    run = tmp_path / "stale"
    by_http, _ = _audit(
        lpf_cli, servers["stale"], prompts, run, "--reference", servers["clean"], "--reference-model", MODEL, code=1
    )
    m = json.loads((run / "manifest.json").read_text())["reference"]
    assert m["kind"] == "http" and m["url"] == servers["clean"] and m["served_model"] == MODEL
    assert m["prompt_logprobs"] == "field" and m["dtype"] is None and m["cost"]["requests"] == 24
    assert by_http["reference"] == servers["clean"] and by_http["reference_kind"] == "http"
    assert "run_test" not in by_http or by_http["run_test"]["result"] != "not applicable"

    from lpf.run.store import RunDir

    ref = RunDir.open(run).read("reference")
    assert ref.num_rows == by_http["n_scored_tokens"] == by_http["n_tokens"] == 192
    assert ref.column("ref_entropy").null_count == ref.num_rows == ref.column("ref_logsumexp").null_count
    assert min(ref.column("ref_rank").to_pylist()) >= 1

    shutil.copytree(run, tmp_path / "by-transformers")
    by_model = _rescore(lpf_cli, tmp_path / "by-transformers", "--reference", MODEL)
    assert "reference_kind" not in by_model  # the default reference: findings as they always were
    # the server said its dtype (/v1/models): judged with the measured float32/float32 ref=http floor, the
    # same flagged set as the transformers reference's, and the run-level test sees the drill too
    assert by_http["run_test"]["floor_pair"] == "float32/float32 ref=http"
    assert _flagged(by_http) and _flagged(by_http) == _flagged(by_model)
    assert by_http["counts"]["corrupt"] == by_model["counts"]["corrupt"]
    # engine against engine is the tighter floor: what the float32 transformers floor calls different, it does
    # too (with small victims only, it alone may: the arrival timing picks the imposters)
    assert by_http["run_test"]["result"] == "different" or by_model["run_test"]["result"] != "different"
    _compare_and_rl_rescore_take_the_same_reference(lpf_cli, run, servers["clean"], by_http, tmp_path)


def _compare_and_rl_rescore_take_the_same_reference(lpf_cli, run, url, by_http, tmp_path):
    """`lpf.compare` and `lpf rl rescore` with the trusted deployment as `--reference`: the audit's construction,
    so the same scores and (compare) the same flagged requests as the audit's."""
    import pyarrow.parquet as pq

    import lpf

    req = {r["request_id"]: r for r in pq.read_table(run / "requests").to_pylist()}
    tokens = {}
    for t in sorted(pq.read_table(run / "tokens").to_pylist(), key=lambda t: t["position"]):
        tokens.setdefault(t["request_id"], []).append(t)
    outputs = [
        {
            "request_id": rid,
            "prompt_token_ids": r["prompt_token_ids"],
            "output_token_ids": r["output_token_ids"],
            "logprobs": [t["engine_logprob"] for t in tokens[rid]],
            "topk_ids": [t["engine_topk_ids"] for t in tokens[rid]],
            "topk_logprobs": [t["engine_topk_logprobs"] for t in tokens[rid]],
        }
        for rid, r in sorted(req.items(), key=lambda kv: kv[1]["seq"])
    ]
    f = lpf.compare(
        outputs, reference=url, reference_model=MODEL, model=MODEL, dtype="float32", out=tmp_path / "compare"
    )
    assert f.raw["reference_kind"] == "http"
    found = json.loads((tmp_path / "compare" / "manifest.json").read_text())["reference"]
    assert found["kind"] == "http" and found["url"] == url and found["cost"]["requests"] == 24
    assert {r.request_id for r in f.flagged} == _flagged(by_http)

    # the same responses as an RL dump: lpf rl rescore scores them on the same server, the same numbers
    dump = tmp_path / "dump.jsonl"
    lines = [
        {
            "step": 1,
            "request_id": o["request_id"],
            "prompt_token_ids": o["prompt_token_ids"],
            "response_token_ids": o["output_token_ids"],
            "rollout_logprobs": o["logprobs"],
            "trainer_logprobs": o["logprobs"],
        }
        for o in outputs
    ]
    dump.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = lpf_cli("rl", "rescore", dump, "--reference", url, "--reference-model", MODEL, "--model", MODEL)
    assert r.code == 0, r.err
    got = pq.read_table(tmp_path / "dump.rl" / "reference.parquet").to_pylist()
    ref = {(x["request_id"], x["position"]): x["ref_logprob"] for x in pq.read_table(run / "reference").to_pylist()}
    assert len(got) == len(ref) == 192 and all(x["reference_sensitivity"] is None for x in got)
    # 8 requests in flight each time, batched differently by the server: float32 rounding apart
    assert max(abs(x["reference_logprob"] - ref[(x["request_id"], x["position"])]) for x in got) < 1e-4
    r = lpf_cli("rl", "analyze", dump, "--json")
    assert r.code in (0, 1) and "Traceback" not in r.err, r.err


@pytest.mark.slow
def test_echo_and_the_prompt_logprobs_field_score_alike(servers):
    from dataclasses import replace

    from lpf.core.model_specs import resolve_model
    from lpf.pipeline.reference import ScoreItem
    from lpf.pipeline.reference_http import HttpReference

    items = [ScoreItem(f"r{i}", [5 + i, 6, 7, 8, 9], [10, 11 + i, 12], score_prompt=i == 0) for i in range(3)]
    scored = {}
    for how in ("field", "echo"):
        r = HttpReference("http", servers["clean"], MODEL, resolve_model(MODEL), 3, 2, how=how)
        (batch,) = list(r.score_all(items))
        scored[how] = batch
    # two requests in flight: rows come back in the order the server answered; compared by (request, position)
    keys = [("request_id", "ascending"), ("position", "ascending")]
    f, e = (
        replace(b, reference=b.reference.sort_by(keys), prompt_reference=b.prompt_reference.sort_by(keys))
        for b in (scored["field"], scored["echo"])
    )
    assert f.reference.num_rows == 9 and f.prompt_reference.num_rows == 4
    for name in ("request_id", "position", "ref_top1_id", "ref_topk_ids"):
        assert f.reference.column(name).to_pylist() == e.reference.column(name).to_pylist(), name
    assert f.reference.column("ref_logprob").to_pylist() == pytest.approx(
        e.reference.column("ref_logprob").to_pylist(), abs=1e-5
    )
    assert f.prompt_reference.column("ref_logprob").to_pylist() == pytest.approx(
        e.prompt_reference.column("ref_logprob").to_pylist(), abs=1e-5
    )


@pytest.mark.slow
def test_a_self_reference_never_says_same_and_says_what_it_cannot_see(lpf_cli, servers, prompts, tmp_path):
    run = tmp_path / "quantized"
    by_self, said = _audit(lpf_cli, servers["quantized"], prompts, run, "--reference", "self")
    assert by_self["run_test"]["result"] == "not applicable"
    assert by_self["reference_limitation"] == LIMITATION and LIMITATION in " ".join(said.split())
    m = json.loads((run / "manifest.json").read_text())["reference"]
    assert m["kind"] == "self" and m["url"] == servers["quantized"] and m["concurrency"] == 1
    assert m["run_test"] == "not applicable"
    assert by_self["reference_second_pass"] == m["second_pass"] and "no decode step" in m["second_pass"]
    # the substitution is real: the transformers reference sees it in the same run
    shutil.copytree(run, tmp_path / "by-transformers")
    by_model = _rescore(lpf_cli, tmp_path / "by-transformers", "--reference", MODEL)
    assert by_model["run_test"]["result"] == "different"
    # and a trusted deployment (the clean server) sees it within 100 scored tokens
    shutil.copytree(run, tmp_path / "by-trusted")
    by_trusted = _rescore(lpf_cli, tmp_path / "by-trusted", "--reference", servers["clean"], "--reference-model", MODEL)
    rt = by_trusted["run_test"]
    assert rt["result"] == "different" and rt["floor_pair"] == "float32/float32 ref=http"
    assert 0 < rt["tokens_needed"] <= 100, rt

    # a reference that cannot be reached: one line
    from lpf.serve.process import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1"
    r = lpf_cli("rescore", run, "--redo", "--reference", dead, "--reference-model", MODEL)
    assert r.code == 2 and f"the reference at {dead} cannot be reached" in r.err, r.err
    assert "Traceback" not in r.err


@pytest.mark.slow
def test_a_clean_server_with_a_self_reference_is_clean(lpf_cli, servers, prompts, tmp_path):
    f, _ = _audit(lpf_cli, servers["clean"], prompts, tmp_path / "clean", "--reference", "self")
    assert f["verdict"] == "clean" and f["counts"]["clean"] == 24 and f["errors"] == 0
    assert f["run_test"]["result"] == "not applicable"
