"""The `sglang` adapter: against `lpf serve`'s SGLang `/generate` (a real server in a child process),
and against a scripted server answering in SGLang's documented shape, good and bad (there is no
SGLang install here; the shape follows sglang's tokenizer_manager: meta_info.output_token_logprobs =
[[logprob, token_id, text|null], ...], output_top_logprobs = [[[logprob, token_id, text|null], ...]])."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from conftest import write_prompts
from scripted_http import Reply, ScriptedServer

MODEL = "zoo:hybrid"


@pytest.fixture(scope="module")
def lpf_server():
    from lpf.serve.process import served

    with served("--model", MODEL, "--cache-mb", 8, env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_audit_through_lpf_serve_generate_is_clean(lpf_cli, lpf_server, tmp_path, prompts_200):
    prompts = write_prompts(
        tmp_path / "p.jsonl", [json.loads(line) for line in prompts_200.read_text().splitlines()[:16]]
    )
    out = tmp_path / "run"
    r = lpf_cli(
        "audit",
        "--engine",
        "sglang",
        "--base-url",
        lpf_server.base_url,
        "--model",
        MODEL,
        "--workload",
        prompts,
        "--max-tokens",
        8,
        "--out",
        out,
        "--json",
    )
    assert r.code == 0, r.err
    f = json.loads(r.out)
    assert f["verdict"] == "clean" and f["n_requests"] == 16 and f["errors"] == 0
    assert f["metrics"]["abs_logprob_diff"]["max"] < 1e-3
    tokens = pq.read_table(out / "tokens").to_pylist()
    assert all(
        len(t["engine_topk_ids"]) == 5 and t["token_id"] in t["engine_topk_ids"]
        for t in tokens
        if t["engine_logprob"] > -1
    )  # the top-k came back as ids, the sampled token among them when likely
    m = json.loads((out / "manifest.json").read_text())
    assert m["engine"]["name"] == "sglang" and m["model"]["spec"] == MODEL


def _meta(ids, lp=-0.5, finish=None, **extra):
    meta = {
        "id": "x",
        "finish_reason": finish or {"type": "length", "length": len(ids)},
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "output_token_logprobs": [[lp, t, None] for t in ids],
        "output_top_logprobs": [[[lp, t, None], [-4.0, 40, None]] for t in ids],
    }
    meta.update(extra)
    return meta


SCRIPT = {
    "ok": lambda ids: Reply(200, {"text": "ABCD", "output_ids": ids, "meta_info": _meta(ids)}),
    "stop": lambda ids: Reply(
        200,
        {
            "text": "AB",
            "output_ids": ids[:2] + [2],
            "meta_info": _meta(ids[:2] + [2], finish={"type": "stop", "matched": 2}),
        },
    ),
    "abort": lambda ids: Reply(
        200,
        {
            "text": "",
            "output_ids": [],
            "meta_info": _meta([], finish={"type": "abort", "message": "out of memory", "status_code": 500}),
        },
    ),
    "ids_disagree": lambda ids: Reply(200, {"text": "ABCD", "output_ids": [35, 36, 99, 38], "meta_info": _meta(ids)}),
    "no_logprobs": lambda ids: Reply(
        200,
        {
            "text": "ABCD",
            "output_ids": ids,
            "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 4}, "completion_tokens": 4},
        },
    ),
    "fewer_logprobs": lambda ids: Reply(200, {"text": "ABCD", "output_ids": ids, "meta_info": _meta(ids[:3])}),
    "bad_entry": lambda ids: Reply(
        200,
        {
            "text": "ABCD",
            "output_ids": ids,
            "meta_info": _meta(
                ids, output_token_logprobs=[[-0.5, 35, None], "oops", [-0.5, 37, None], [-0.5, 38, None]]
            ),
        },
    ),
    "not_object": lambda ids: Reply(200, ["not", "an", "answer"]),
}
CASES = list(SCRIPT) + ["busy_then_ok"]
CODE = {c: 100 + i for i, c in enumerate(CASES)}


def sglang_script(server, path, body, attempt):
    if path != "/generate":
        return Reply(404, {"detail": "Not Found"})
    case = next(c for c, code in CODE.items() if code == body["input_ids"][1])
    ids = [35, 36, 37, 38][: body["sampling_params"]["max_new_tokens"]]
    if case == "busy_then_ok":
        return Reply(503, {"error": {"message": "busy"}}) if attempt == 1 else SCRIPT["ok"](ids)
    return SCRIPT[case](ids)


def test_sglang_answers_checked_and_every_request_recorded(lpf_cli, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": c, "prompt_token_ids": [1, CODE[c], 20]} for c in CASES])
    out = tmp_path / "run"
    with ScriptedServer(sglang_script) as server:
        r = lpf_cli(
            "audit",
            "--engine",
            "sglang",
            "--base-url",
            server.url + "/v1",
            "--model",
            MODEL,
            "--workload",
            prompts,
            "--max-tokens",
            4,
            "--logprobs",
            2,
            "--seed",
            5,
            "--out",
            out,
            "--fail-on",
            "never",
            "--json",
            "-E",
            "backoff_s=0.05",
        )
    assert r.code == 0, r.err
    rows = {row["request_id"].removesuffix("-r0"): row for row in pq.read_table(out / "requests").to_pylist()}
    assert set(rows) == set(CASES)
    err = {c: row["error"] for c, row in rows.items()}
    # answers that contradict themselves are kept as returned (the ids paired with logprobs), with why
    kept = {
        "ids_disagree": [
            "output_ids: output_ids (4 tokens) and output_token_logprobs (4) disagree at position 2 "
            "(output_ids there: [99, 38])"
        ],
        "fewer_logprobs": [
            "output_ids: output_ids (4 tokens) and output_token_logprobs (3) disagree at position 3 "
            "(output_ids there: [38])",
            "finish_reason: finish_reason 'length' after 3 of max_tokens 4 tokens",
            "text: the answer's text 'ABCD' is not its tokens' text 'ABC'",
        ],
    }
    assert {c for c, e in err.items() if e is None} == {"ok", "stop", "busy_then_ok"} | set(kept)
    for case, reasons in kept.items():
        assert rows[case]["inconsistency"] == "; ".join(reasons), rows[case]["inconsistency"]
    assert rows["ids_disagree"]["output_token_ids"] == [35, 36, 37, 38]
    assert rows["fewer_logprobs"]["output_token_ids"] == [35, 36, 37]
    assert "finish_reason 'abort': out of memory" in err["abort"]
    assert "no output_token_logprobs" in err["no_logprobs"]
    assert "output_token_logprobs[1] is 'oops'" in err["bad_entry"]
    assert "no meta_info" in err["not_object"]
    assert rows["stop"]["finish_reason"] == "stop" and rows["stop"]["output_token_ids"] == [35, 36, 2]

    # what was sent: SGLang's native fields, /generate at the server root (not under /v1), our ids as rid
    first = server.posts[0]
    assert first.path == "/generate"
    assert set(first.body) >= {
        "input_ids",
        "sampling_params",
        "return_logprob",
        "top_logprobs_num",
        "logprob_start_len",
        "rid",
    }
    assert first.body["return_logprob"] is True and first.body["top_logprobs_num"] == 2
    assert first.body["logprob_start_len"] == -1
    sp = first.body["sampling_params"]
    assert sp["max_new_tokens"] == 4 and sp["temperature"] == 0 and sp["top_k"] == -1
    assert isinstance(sp["sampling_seed"], int)
    busy = [p for p in server.posts if p.body["input_ids"][1] == CODE["busy_then_ok"]]
    assert [p.body["rid"] for p in busy] == ["busy_then_ok-r0", "busy_then_ok-r0~retry1"]

    tokens = [t for t in pq.read_table(out / "tokens").to_pylist() if t["request_id"] == "ok-r0"]
    assert [t["token_id"] for t in tokens] == [35, 36, 37, 38]
    assert tokens[0]["engine_topk_ids"] == [35, 40] and tokens[0]["engine_logprob"] == -0.5
    f = json.loads(r.out)
    assert f["errors"] == len(CASES) - 5 and sum(f["counts"].values()) == 5
    assert f["evidence"]["inconsistent"]["by_reason"] == {"finish_reason": 1, "output_ids": 2, "text": 1}
