"""`lpf watch`'s parts without a server: what a sampled request asks for and gives back (`wire`), one sample
as run-schema rows (`record`, with the zoo's real tokenizer), the change point (`windows._split`), and the
supervisor's alarms: a real HTTP server receives the webhook's JSON, --fail-after stops the proxy."""

from __future__ import annotations

import copy
import json
import math

import pyarrow as pa
import pytest

from lpf.run import schema
from lpf.watch import wire
from lpf.watch.evidence import Sample
from lpf.watch.windows import _split, requests_test


def test_augment_adds_only_what_the_client_did_not_ask_and_strip_puts_it_back():
    body = {"model": "m", "prompt": "hi", "max_tokens": 3}
    sent, added = wire.augment(wire.COMPLETIONS, body, 5)
    assert sent == {**body, "logprobs": 5, "return_token_ids": True} and added == wire.Added(True, True)
    assert body == {"model": "m", "prompt": "hi", "max_tokens": 3}  # the client's body is not touched
    own, added = wire.augment(wire.COMPLETIONS, {**body, "logprobs": 0, "return_token_ids": False}, 5)
    assert own["logprobs"] == 0 and own["return_token_ids"] is False and added == wire.Added(False, False)
    chat, added = wire.augment(wire.CHAT, {"messages": [{"role": "user", "content": "x"}]}, 4)
    assert chat["logprobs"] is True and chat["top_logprobs"] == 4 and added.logprobs
    refused, added = wire.augment(wire.COMPLETIONS, body, 5, frozenset({wire.ID_FIELD}))
    assert wire.ID_FIELD not in refused and added == wire.Added(True, False)

    answer = {
        "id": "c",
        "choices": [
            {"index": 0, "text": "ab", "logprobs": {"tokens": ["a"]}, "token_ids": [1], "prompt_token_ids": [2]}
        ],
    }
    whole = wire.strip(copy.deepcopy(answer), wire.Added(True, True))
    assert whole["choices"][0] == {
        "index": 0,
        "text": "ab",
        "logprobs": None,
        "token_ids": None,
        "prompt_token_ids": None,
    }
    plain = {"id": "c", "choices": [{"index": 0, "text": "ab", "logprobs": None}]}
    assert wire.strip(copy.deepcopy(plain), wire.Added(True, True)) == plain  # absent fields stay absent
    # a chat chunk vLLM sends only because logprobs or token ids were asked (its text held back) is extra
    empty = {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": None}]}
    assert wire.extra_chunk(wire.CHAT, empty, {"messages": []})
    assert not wire.extra_chunk(wire.CHAT, empty, {"messages": [], "logprobs": True})  # the client's own
    assert not wire.extra_chunk(wire.COMPLETIONS, empty, {"prompt": "x"})
    kept = wire.strip(copy.deepcopy(answer), wire.Added(False, False))
    assert kept == answer


@pytest.mark.parametrize(
    "route,body,ok",
    [
        (wire.COMPLETIONS, {"prompt": "x"}, True),
        (wire.COMPLETIONS, {"prompt": [1, 2]}, True),
        (wire.COMPLETIONS, {"prompt": ["a", "b"]}, False),  # several prompts
        (wire.COMPLETIONS, {"prompt": "x", "n": 2}, False),
        (wire.COMPLETIONS, {"prompt": "x", "echo": True}, False),
        (wire.CHAT, {"messages": []}, True),
        (wire.CHAT, {"prompt": "x"}, False),
        ("/v1/models", {"prompt": "x"}, False),
        (wire.COMPLETIONS, None, False),  # not JSON
    ],
)
def test_what_can_be_sampled(route, body, ok):
    assert wire.sampleable(route, body) is ok


def _sample(body, chunks, added=None, **kw) -> Sample:
    c = wire.Collected(wire.COMPLETIONS)
    for ch in chunks:
        c.add_chunk(ch)
    added = wire.Added(True, True) if added is None else added
    return Sample(0, wire.COMPLETIONS, body, added, True, 1.0, 3, c, t_first=1.5, t_end=2.0, status=200, **kw)


@pytest.fixture(scope="module")
def recording():
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.watch.record import Recording

    tok = load_tokenizer(resolve_model("zoo:hybrid"))
    return lambda keep_text=True: Recording(tok, len(tok), keep_text)


def _chunk(text, tid, lp, top=None):
    block = {"tokens": [text], "token_logprobs": [lp], "top_logprobs": [top or {text: lp}], "text_offset": [0]}
    return {"id": "x", "choices": [{"index": 0, "text": text, "logprobs": block, "token_ids": [tid]}]}


def test_a_streamed_sample_becomes_rows_with_the_servers_ids_and_logprobs(recording):
    tok = recording().tok
    ids = tok.encode("AB", add_special_tokens=False)
    chunks = [_chunk(tok.decode([t]), t, -0.5 * (i + 1)) for i, t in enumerate(ids)]
    chunks.append({"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    body = {"prompt": "Q:", "max_tokens": 2, "temperature": 0, "stream": True}
    req, tokens, watch = recording().rows(_sample(body, chunks, headers={"x-request-id": "up-7", "server": "vllm"}))
    assert req["prompt_token_ids"] == tok.encode("Q:") and req["output_token_ids"] == ids
    assert req["finish_reason"] == "length" and req["error"] is None and req["output_text"] == "AB"
    assert [t["engine_logprob"] for t in tokens] == [-0.5, -1.0]
    assert tokens[0]["engine_topk_ids"] == [ids[0]]
    assert watch["upstream_request_id"] == "up-7" and json.loads(watch["replica_headers"])["server"] == "vllm"
    assert watch["in_flight"] == 3 and watch["temperature"] == 0.0 and watch["lpf_added"] == "logprobs,token_ids"
    # the request's own sampling settings, as sent (what the analysis judges it at: not the run's)
    assert req["sampling"]["temperature"] == 0.0 and req["sampling"]["top_p"] is None
    assert req["sampling"]["logprobs"] is None  # lpf asked for the logprobs, not the client
    sampled = {"prompt": "Q:", "temperature": 0.8, "top_p": 0.95, "seed": 3, "logprobs": 2, "stream": True}
    req, _, _ = recording().rows(_sample(sampled, chunks, added=wire.Added(False, True)))
    assert {k: v for k, v in req["sampling"].items() if v is not None} == {
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": 3,
        "logprobs": 2,
    }
    rows = pa.Table.from_pylist([req], schema=schema.REQUESTS)  # it fits the run schema
    assert rows.column("sampling").to_pylist()[0]["temperature"] == 0.8


def test_a_null_logprob_is_nan_and_a_token_past_the_entries_has_none(recording):
    """An entry whose logprob is null (a server's NaN serialized as JSON null) is NaN: never clean. A token
    with no entry at all (llama-server leaves out a token that ends inside a UTF-8 character) has no
    logprob (None): the analysis judges it from the token alone (`lpf.analysis.absent`)."""
    tok = recording().tok
    ids = tok.encode("AB", add_special_tokens=False)[:2]
    text = tok.decode([ids[0]])
    block = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [{text: None}], "text_offset": [0]}
    chunks = [{"id": "x", "choices": [{"index": 0, "text": tok.decode(ids), "logprobs": block, "token_ids": ids}]}]
    chunks.append({"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    body = {"prompt": "Q:", "max_tokens": 2, "temperature": 0, "stream": True}
    req, tokens, _ = recording().rows(_sample(body, chunks))
    assert req["output_token_ids"] == ids and len(tokens) == 2
    assert math.isnan(tokens[0]["engine_logprob"]) and tokens[0]["engine_topk_ids"] == []
    assert tokens[1]["engine_logprob"] is None
    assert "logprobs: 1 logprob entries for 2 token ids" in req["inconsistency"]


def test_no_text_keeps_ids_only_and_a_malformed_answer_is_evidence(recording):
    body = {"prompt": [5, 6], "max_tokens": 1}
    ch = _chunk("A", 7, -0.1)
    req, _, _ = recording(keep_text=False).rows(_sample(body, [ch]))
    assert req["output_text"] is None and req["output_token_ids"] == [7]
    bad = _sample(body, [], error="malformed answer (Expecting value)", raw_evidence="<html>oops</html>")
    req, tokens, _ = recording().rows(bad)
    assert req["finish_reason"] == "error" and "<html>oops" in req["error"] and tokens == []
    req, _, _ = recording(keep_text=False).rows(bad)
    assert "oops" not in req["error"]  # --no-text: not even an answer's bytes


def test_the_change_point_is_where_the_exceedance_rate_rises():
    import numpy as np

    n = np.full(20, 16.0)
    k = np.r_[np.zeros(12), np.full(8, 6.0)]
    k[3] = 1  # one honest exceedance before the change
    assert _split(k, n) == 12
    assert _split(np.zeros(5), np.full(5, 10.0)) is None  # no rise, no change


def test_a_window_alarms_on_its_requests_only_past_what_an_honest_engine_of_its_dtype_shows():
    # one divergent request among 64 scored bfloat16 tokens: what honest bfloat16 arithmetic does now and then
    one = requests_test(1, 0, 64, "bfloat16")
    assert not one["alarm"] and 0 < one["expected"] < 0.1 and one["p_value"] > 1e-3
    # four of them in as few tokens: far past the expected count
    assert requests_test(4, 0, 64, "bfloat16")["alarm"]
    # a divergent one far beyond the floor (a stale-state imposter, 1e4x) alarms alone too
    assert requests_test(1, 0, 64, "bfloat16", far_beyond=1)["alarm"]
    # a corrupt request (confident gibberish) alarms alone, whatever the expected count
    assert requests_test(0, 1, 64, "bfloat16")["alarm"] and requests_test(0, 1, 100_000, "float32")["alarm"]
    # float32 expects fewer than bfloat16; an unknown dtype gets the most lenient rate
    assert requests_test(2, 0, 64, "float32")["rate"] < requests_test(2, 0, 64, "bfloat16")["rate"]
    assert requests_test(2, 0, 64, None)["rate"] == requests_test(2, 0, 64, "bfloat16")["rate"]
    # the same count over many more tokens is expected: the test is on the rate, not the count
    assert requests_test(3, 0, 64, "float32")["alarm"] and not requests_test(3, 0, 50_000, "float32")["alarm"]
    assert not requests_test(4, 0, 64, "bfloat16", alpha=1e-12)["alarm"]  # at the alpha given


def test_a_prompt_answered_the_same_twice_counts_once():
    import pyarrow as pa

    from lpf.watch.windows import _distinct

    requests = pa.table(
        {
            "request_id": ["a", "b", "c", "d", "e"],
            "prompt_token_ids": [[1, 2], [1, 2], [1, 2], [3], [4]],
            "output_token_ids": [[5, 6, 7], [5, 6, 7], [5, 6, 8], [9], [9, 9]],
        }
    )
    summary = pa.table(
        {
            "request_id": ["a", "b", "c", "d", "e"],
            "verdict": ["divergent", "divergent", "divergent", "corrupt", "unscored"],
        }
    )
    # a and b are one piece of evidence; c answered the same prompt otherwise; e was not scored
    assert _distinct(requests, summary) == (2, 1, 0, 3 + 3 + 1)
    # c's largest token error is 12x the floor's threshold: far beyond, and still one of the divergent
    assert _distinct(requests, summary, {"a": 0.9, "b": 0.9, "c": 12.0}) == (2, 1, 1, 3 + 3 + 1)


def test_alarms_are_posted_logged_and_fail_after_stops(tmp_path):
    from scripted_http import Reply, ScriptedServer

    from lpf.watch.metrics import WatchMetrics
    from lpf.watch.supervisor import Supervisor

    (tmp_path / "live").mkdir()
    seen, stopped = [], []
    with ScriptedServer(lambda *a: Reply(json={"ok": True})) as hook:
        m = WatchMetrics()
        sup = Supervisor(
            tmp_path, [], m, seen.append, webhook=hook.url + "/alert", fail_after=2, stop=lambda: stopped.append(1)
        )
        lines = [
            {"window": 0, "alarm": False, "verdicts": {"clean": 4}, "run_test": {"result": "same", "p_value": 0.5}},
            {
                "window": 1,
                "alarm": True,
                "verdicts": {"clean": 1, "divergent": 3},
                "run_test": {"result": "different", "p_value": 1e-9},
                "change": {"seq": 5, "request_id": "w000000005"},
                "first_seq": 4,
                "last_seq": 7,
            },
        ]
        (tmp_path / "live" / "windows.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines) + '{"window": 2, "al'
        )
        sup.tick()
        assert [w["window"] for w in seen] == [0, 1] and not stopped  # the cut line waits
        assert len(hook.posts) == 1
        posted = hook.posts[0].body
        assert posted["event"] == "lpf_watch_alarm" and posted["change_request_id"] == "w000000005"
        with open(tmp_path / "live" / "windows.jsonl", "a") as f:
            f.write('arm": true, "verdicts": {}, "run_test": {"result": "different", "p_value": 1e-12}}\n')
        sup.tick()
        assert [w["window"] for w in seen] == [0, 1, 2] and stopped == [1] and sup.failed
        text = m.render()[0].decode()
        assert "lpf_watch_alarms_total 2.0" in text and 'lpf_watch_verdicts_total{verdict="divergent"} 3.0' in text
        sup.close()


def test_metrics_mean_something_from_the_start_and_lag_counts_only_answered_samples():
    import math

    from lpf.watch.metrics import WatchMetrics

    m = WatchMetrics()
    text = m.render()[0].decode()
    assert 'result="None"' not in text and 'lpf_watch_windows_total{result="upstream-failing"} 0.0' in text
    assert 'lpf_watch_unscored_total{reason="stream-stripped"} 0.0' in text
    assert 'lpf_watch_samples_failed_total{status_class="5xx"} 0.0' in text
    assert "lpf_watch_window_run_test_p_value NaN" in text  # no window yet: no rule reads a p-value of 0
    assert "lpf_watch_scoring_lag_seconds 0.0" in text
    status = {"scored": 3, "pending": 2, "oldest_pending_arrival": 100.0, "failed": {"5xx": 7}, "unscored": {}}
    m.observe_status(status, now=130.0)
    m.observe_status(dict(status, failed={"5xx": 9}), now=131.0)  # totals: counted by what they grew
    text = m.render()[0].decode()
    assert "lpf_watch_scoring_lag_requests 2.0" in text and "lpf_watch_scoring_lag_seconds 31.0" in text
    assert 'lpf_watch_samples_failed_total{status_class="5xx"} 9.0' in text
    assert "lpf_watch_requests_scored_total 3.0" in text
    m.observe_status({"scored": 3, "pending": 0, "oldest_pending_arrival": None, "failed": {"5xx": 9}}, now=500.0)
    assert "lpf_watch_scoring_lag_seconds 0.0" in m.render()[0].decode()  # idle: nothing waits
    m.observe_window({"window": 0, "n_requests": 0, "n_settled": 4, "n_failed": 4, "upstream_failing": True})
    text = m.render()[0].decode()
    assert 'lpf_watch_windows_total{result="upstream-failing"} 1.0' in text
    assert "lpf_watch_window_upstream_failing 1.0" in text and "lpf_watch_upstream_failing_windows_total 1.0" in text
    assert math.isnan(m.p_value._value.get())


def test_outages_and_unscorable_samples_are_classed_and_said():
    from lpf.watch import outages as o

    assert o.failure_class(None, 200) is None and o.failure_class("HTTP 502: x", 502) == "5xx"
    assert (
        o.failure_class("HTTP 401", 401) == "4xx" and o.failure_class("upstream: UpstreamTimeout", None) == "no-answer"
    )
    assert o.failure_class("the client disconnected", None) == "client-gone"
    retok = "retokenized: the upstream returned neither token ids nor logprobs; ids re-encoded"
    assert o.unscored_reason(None, 5, retok, True) == "stream-stripped"
    assert (
        o.unscored_reason(None, 5, retok, False) == "retokenized" and o.unscored_reason(None, 0, None, False) == "empty"
    )
    assert o.unscored_reason(None, 3, "logprobs: 2 logprob entries for 1 token ids", True) == "inconsistent"
    assert o.unscored_reason("HTTP 500", 0, None, False) is None  # a failure, counted as one
    facts = o.window_facts(["5xx"] * 11 + ["client-gone"] + [None] * 8, [None] * 12 + ["stream-stripped"] * 8)
    assert facts == {
        "n_failed": 11,
        "failed": {"5xx": 11, "client-gone": 1},
        "unscored": {"stream-stripped": 8},
        "upstream_failing": True,  # 11 of the 19 requests the upstream was asked to answer
    }
    line = {"n_settled": 20, **facts}
    assert o.window_result(line) == "upstream-failing"
    assert o.window_notes(line) == (
        "11 of 20 failed upstream (5xx 11): upstream failing; 1 of 20 left by their clients; "
        "8 of 20 not scorable: the upstream or a gateway strips logprobs and token ids from streamed answers"
    )
    assert o.window_result({"n_requests": 0}) == "unscored" and o.window_result({"n_requests": 3}) == "undecided"
    self_judged = {"n_requests": 3, "run_test": {"result": "not applicable"}}
    assert o.window_result(self_judged) == "not-applicable"  # a self-reference's window is never `same`
    assert not o.window_facts(["5xx"] * 10 + [None] * 10, [None] * 20)["upstream_failing"]  # half is not more


def test_fail_after_counts_alarmed_windows_in_arrival_order_even_when_judged_at_once(tmp_path):
    from lpf.watch.metrics import WatchMetrics
    from lpf.watch.supervisor import Supervisor

    (tmp_path / "live").mkdir()
    seen, stopped = [], []
    sup = Supervisor(tmp_path, [], WatchMetrics(), seen.append, fail_after=1, stop=lambda: stopped.append(1))
    lines = [
        {"window": i, "alarm": True, "verdicts": {"corrupt": 1}, "run_test": {"result": "different", "p_value": 1e-9}}
        for i in range(4)
    ]
    (tmp_path / "live" / "windows.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    sup.tick()  # the scorer judged four windows at once: --fail-after 1 takes the first and stops
    sup.tick()
    assert [w["window"] for w in seen] == [0] and stopped == [1] and sup.alarms == 1 and sup.failed
    sup.close()


def test_an_upstream_failing_window_is_posted_as_its_own_event(tmp_path):
    from scripted_http import Reply, ScriptedServer

    from lpf.watch.metrics import WatchMetrics
    from lpf.watch.supervisor import Supervisor

    (tmp_path / "live").mkdir()
    line = {
        "window": 3,
        "first_seq": 12,
        "last_seq": 15,
        "n_settled": 4,
        "n_requests": 1,
        "n_failed": 3,
        "failed": {"5xx": 3},
        "upstream_failing": True,
        "alarm": False,
        "verdicts": {"clean": 1},
        "run_test": {"result": None},
    }
    (tmp_path / "live" / "windows.jsonl").write_text(json.dumps(line) + "\n")
    with ScriptedServer(lambda *a: Reply(json={"ok": True})) as hook:
        m = WatchMetrics()
        sup = Supervisor(tmp_path, [], m, lambda w: None, webhook=hook.url + "/alert")
        sup.tick()
        sup.close()
        (posted,) = [p.body for p in hook.posts]
    assert posted["event"] == "lpf_watch_upstream_failing" and posted["n_failed"] == 3 and posted["share"] == 0.5
    assert posted["sentence"] == "3 of 4 failed upstream (5xx 3): upstream failing"
    assert 'lpf_watch_windows_total{result="upstream-failing"} 1.0' in m.render()[0].decode()


def test_the_live_page_lists_windows_newest_first_and_escapes_what_it_shows():
    from lpf.watch.page import render_page

    ws = [
        {
            "window": 0,
            "first_seq": 0,
            "last_seq": 3,
            "n_tokens": 40,
            "verdicts": {"clean": 4},
            "run_test": {"result": "same"},
        },
        {
            "window": 1,
            "first_seq": 4,
            "last_seq": 7,
            "n_tokens": 41,
            "alarm": True,
            "verdicts": {"corrupt": 2},
            "run_test": {"result": "different", "p_value": 1e-9},
            "change": {"request_id": "w000000005"},
            "flagged": ["w000000005", "w000000006", "x'><script>"] + [f"w00000001{i}" for i in range(8)],
        },
    ]
    html = render_page(ws, {"upstream": "http://x/<script>", "alarms": 1})
    assert html.index("w000000005") < html.index("<td>0</td>")  # newest first
    assert "ALARM" in html and 'class="alarm"' in html and "1e-09" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    # the flagged requests link into the drill-down of the report served beside the page (at most 8, the rest counted)
    assert "<a href='report.html#request-w000000005'>w000000005</a>" in html
    assert "<a href='report.html#request-x%27%3E%3Cscript%3E'>x&#x27;&gt;&lt;script&gt;</a>" in html
    assert html.count("href='report.html#request-") == 8 and " +3 more" in html


def test_the_live_page_draws_the_timeline_the_incident_and_the_outage():
    from lpf.watch.page import departure, render_page

    def w(i, **kw):
        base = {"window": i, "first_seq": 4 * i, "last_seq": 4 * i + 3, "n_settled": 4, "t_first": 3600.0 * 10 + i}
        return {**base, "n_requests": 4, "flagged_rate": 0.0, "expected_rate": 0.01, **kw}

    change = {"request_id": "w000000009", "seq": 9, "refined": True, "was": {"request_id": "w000000010", "seq": 10}}
    ws = [
        w(0, run_test={"result": "same", "p_value": 1.0}),
        w(1, n_requests=0, flagged_rate=None, n_failed=4, failed={"5xx": 4}, upstream_failing=True),
        w(2, flagged_rate=0.5, alarm=True, change=change, incident={"id": 2, "windows": 1}),
        w(3, flagged_rate=0.4, alarm=True, change=change, incident={"id": 2, "windows": 2}),
    ]
    assert departure(ws[0]) == 1e-2 and departure(ws[2]) == 50.0 and departure(ws[1]) is None
    config = {"reference": "zoo:hybrid", "reference dtype": "float32", "upstream dtype": "bfloat16"}
    status = {"pending": 3, "oldest_pending_arrival": 100.0, "scored": 9, "recorded": 16, "failed": {"5xx": 4}}
    html = render_page(ws, {"alarms": 2}, config, status, now=112.0)
    assert "reference dtype: float32" in html and "upstream dtype: bfloat16" in html
    assert "scoring lag: 3 answered samples waiting, oldest 12 s" in html and "failed: 5xx 4" in html
    assert html.count("<circle") == 3 and html.count("class='alarm'") == 2  # the outage has no point
    assert html.count("class='change'") == 1  # one incident, one change point, at window 2 (seq 9)
    assert "4 of 4 failed upstream (5xx 4): upstream failing" in html and 'class="failing"' in html
    assert "incident 2: w000000009 (refined)" in html and "10:00:02..-" in html


def test_a_chat_sample_is_scored_after_the_templates_rendering_with_ids_mapped_from_strings(recording):
    from lpf.core.chat import render

    rec = recording()
    tok = rec.tok
    ids = tok.encode("12", add_special_tokens=False)
    content = [{"token": tok.decode([t]), "logprob": -0.3, "bytes": None, "top_logprobs": []} for t in ids]
    answer = {
        "id": "chat-1",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "12"},
                "logprobs": {"content": content},
                "finish_reason": "stop",
            }
        ],
    }
    c = wire.Collected(wire.CHAT)
    c.add_answer(answer)
    messages = [{"role": "user", "content": "ADD:1+11="}]
    s = Sample(4, wire.CHAT, {"messages": messages}, wire.Added(True, False), False, 1.0, 0, c, 1.1, 1.2, 200)
    req, tokens, _ = rec.rows(s)
    assert req["prompt_token_ids"] == render(tok, messages)  # no prompt_token_ids came back: the template's
    assert req["output_token_ids"] == ids and [t["engine_logprob"] for t in tokens] == [-0.3] * len(ids)
    assert req["request_id"] == "w000000004" and req["seq"] == 4


def recorded_run(path, n: int, text_of, error_of=lambda seq: None):
    """A watch run directory holding `n` recorded requests (ADD:1+2= answered `text_of(seq)`, every token
    at logprob -0.1; or failed with `error_of(seq)`, no output), as `lpf watch` records them; returns the run."""
    from lpf.run import schema
    from lpf.watch.service import Settings, prepare

    run, tok, _ = prepare(Settings(upstream="http://127.0.0.1:1", reference="zoo:hybrid", out=path))
    rows, toks = [], []
    for seq in range(n):
        rid = f"w{seq:09d}"
        error = error_of(seq)
        out = [] if error else tok.encode(text_of(seq), add_special_tokens=False)
        rows.append(
            {
                "request_id": rid,
                "seq": seq,
                "rollout": 0,
                "prompt_token_ids": tok.encode("ADD:1+2="),
                "output_token_ids": out,
                "error": error,
                "t_submit": 1_000_000.0 + seq,
            }
        )
        toks += [{"request_id": rid, "position": i, "token_id": t, "engine_logprob": -0.1} for i, t in enumerate(out)]
    run.append_requests(schema.table(schema.REQUESTS, _cols(rows)), schema.table(schema.TOKENS, _cols(toks)))
    return run


@pytest.mark.slow  # loads the reference and judges 7 windows: ~20-60 s on the shared machine
def test_the_scorer_keeps_its_lag_bounded_and_judges_full_windows(tmp_path, recording):
    from lpf.watch.scorer import SKIPPED, WINDOWS, Scorer

    run = recorded_run(tmp_path / "run", 30, lambda seq: f"{seq}")
    sc = Scorer(run.path, "zoo:hybrid", "float32", "cpu", window=4, max_lag=10, per_cycle=5)
    sc.cycle()
    skipped = (run.path / SKIPPED).read_text().split()
    assert skipped == [f"w{s:09d}" for s in range(20)]  # the oldest backlog given up, the newest 10 kept
    assert len(sc.scored) == 5  # one cycle's share
    sc.cycle()
    assert len(sc.scored) == 10
    lines = [json.loads(x) for x in (run.path / WINDOWS).read_text().splitlines()]
    assert [x["window"] for x in lines] == list(range(7))  # 30 settled requests: 7 full windows of 4
    assert lines[0]["n_unscored"] == 4 and lines[-1]["n_unscored"] == 0 and lines[-1]["n_requests"] == 4
    # the scored windows alarm: these "engine" logprobs (-0.1 everywhere) are not the model's; the skipped ones cannot
    assert [x["alarm"] for x in lines] == [False] * 5 + [True] * 2


@pytest.mark.slow  # loads the reference and judges 4 windows
def test_an_outage_is_a_failing_window_and_one_incident_keeps_one_change_point(tmp_path):
    from lpf.watch.scorer import STATUS, WINDOWS, Scorer

    # windows of 4: requests 8..11 failed (the upstream down); every answered one departs (logprobs -0.1)
    run = recorded_run(tmp_path / "run", 16, lambda seq: f"{seq}", lambda seq: "HTTP 503" if 8 <= seq < 12 else None)
    sc = Scorer(run.path, "zoo:hybrid", "float32", "cpu", window=4)
    sc.cycle()
    lines = [json.loads(x) for x in (run.path / WINDOWS).read_text().splitlines()]
    # (a run-level test needs more tokens than these windows hold: the corrupt requests alarm them)
    assert [x["result"] for x in lines] == ["undecided", "undecided", "upstream-failing", "undecided"]
    assert [x["alarm"] for x in lines] == [True, True, False, True]
    out = lines[2]
    assert out["n_failed"] == 4 and out["failed"] == {"no-answer": 4} and out["upstream_failing"] and not out["alarm"]
    assert (out["first_seq"], out["last_seq"]) == (8, 11) and out["t_first"] == 1_000_008.0
    # one incident from window 0: the outage says nothing about the engine and leaves it open
    assert [x.get("incident", {}).get("id") for x in lines] == [0, 0, None, 0]
    assert [x["incident"]["windows"] for x in (lines[0], lines[1], lines[3])] == [1, 2, 3]
    first = lines[0]["change"]
    for later in (lines[1], lines[3]):  # the incident's change point, or its refinement (said so)
        assert (
            later["change"]["request_id"] == first["request_id"]
            or later["change"]["was"]["request_id"] == (first["request_id"])
        )
    status = json.loads((run.path / STATUS).read_text())
    # failed samples are facts, not lag: nothing answered waits
    assert status["pending"] == 0 and status["oldest_pending_arrival"] is None and status["failed"] == {"no-answer": 4}


def _cols(rows: list[dict]) -> dict:
    return {n: [r[n] for r in rows] for n in rows[0]}


@pytest.mark.parametrize(
    "args,says",
    [
        (["--upstream", "ftp://x", "--sample", "0.1"], "--upstream must be an http(s) URL"),
        (["--upstream", "http://127.0.0.1:1", "--sample", "2"], "--sample must be in 0..1"),
        (["--upstream", "http://127.0.0.1:1", "--listen", "nowhere"], "--listen must be HOST:PORT"),
        (["--upstream", "http://127.0.0.1:1", "--window", "0"], "--window must be >= 1"),
        (["--upstream", "http://127.0.0.1:1", "--retain", "5XB"], "--retain takes a size"),
        (["--upstream", "http://127.0.0.1:1", "--actors", "2"], "need --executor ray"),
        (
            ["--upstream", "http://127.0.0.1:1", "--executor", "ray", "--reference-device", "cuda"],
            "needs --gpus-per-actor",
        ),
    ],
)
def test_bad_watch_options_are_one_line_and_exit_2(lpf_cli, tmp_path, args, says):
    r = lpf_cli("watch", "--reference", "zoo:hybrid", "--out", tmp_path / "run", "--listen", "127.0.0.1:0", *args)
    assert r.code == 2 and says in r.err and "Traceback" not in r.err
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.fixture
def in_thread_proxy(tmp_path, recording):
    """`lpf.watch.proxy` under uvicorn on a thread (a real socket on 127.0.0.1), every request sampled, with a real
    recorder: for the upstream failures a scripted server can make."""
    import threading
    import time

    import uvicorn

    from lpf.serve.process import free_port
    from lpf.watch.metrics import WatchMetrics
    from lpf.watch.proxy import create_proxy
    from lpf.watch.recorder import Recorder
    from lpf.watch.sample import Sampler
    from lpf.watch.service import Settings, prepare

    started = []

    def start(upstream: str, timeout: float | None = None):
        run, _, _ = prepare(Settings(upstream=upstream, reference="zoo:hybrid", out=tmp_path / f"run{len(started)}"))
        recorder = Recorder(run, recording(), part_seconds=0.1)
        metrics = WatchMetrics()
        app = create_proxy(upstream, Sampler(1.0), recorder, metrics, 5, timeout)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        started.append((server, thread, recorder))
        return f"http://127.0.0.1:{port}", run, metrics, recorder

    yield start
    for server, thread, recorder in started:
        server.should_exit = True
        thread.join(10)
        recorder.close()


def test_upstream_failures_reach_the_client_as_the_upstream_gave_them_and_are_recorded(in_thread_proxy):
    import time

    import httpx
    import pyarrow.parquet as pq
    from scripted_http import Reply, ScriptedServer

    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}

    def script(server, path, sent, attempt):
        p = sent.get("prompt")
        if p == [1]:
            return Reply(status=500, raw=b'{"error": "engine died"}')
        if p == [2]:
            return Reply(raw=b"<html>not json</html>")
        if p == [3]:
            return Reply(json={"ok": 1}, delay=2.0)
        if p == [4] and "return_token_ids" in sent:  # a server that refuses vLLM's field
            return Reply(status=400, json={"error": {"message": "unknown field return_token_ids"}})
        return Reply(
            json={"id": "c", "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length"}]}
        )

    with ScriptedServer(script) as up:
        base, run, metrics, recorder = in_thread_proxy(up.url, timeout=1.0)
        url = base + "/v1/completions"
        r = httpx.post(url, json={**body, "prompt": [1]})
        assert (r.status_code, r.content) == (500, b'{"error": "engine died"}')
        r = httpx.post(url, json={**body, "prompt": [2]})
        assert (r.status_code, r.content) == (200, b"<html>not json</html>")  # kept as the upstream sent it
        r = httpx.post(url, json={**body, "prompt": [3]})
        assert r.status_code == 504 and "did not answer in time" in r.json()["error"]["message"]
        r = httpx.post(url, json={**body, "prompt": [4]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
        last = [p.body for p in up.posts if p.body.get("prompt") == [4]]
        assert "return_token_ids" in last[0] and "return_token_ids" not in last[1]  # sent again as the client sent it
        r = httpx.post(url, json={**body, "prompt": [4]})
        assert "return_token_ids" not in up.posts[-1].body  # not asked again
        up.stop()
        r = httpx.post(url, json=body)
        assert r.status_code == 502 and "could not be reached" in r.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while recorder.recorded < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    req = {tuple(x["prompt_token_ids"]): x for x in pq.read_table(run.path / "requests").to_pylist()}
    assert req[(1,)]["error"].startswith("HTTP 500") and "engine died" in req[(1,)]["error"]
    assert req[(2,)]["error"].startswith("malformed answer") and "<html>" in req[(2,)]["error"]
    assert req[(3,)]["error"] and req[(4,)]["error"] is None and req[(5, 6, 7)]["error"]
    text = metrics.render()[0].decode()
    # the 500 answer, the time-out and the refused connection (the refusal answered again 200 is not one)
    assert "lpf_watch_upstream_errors_total 3.0" in text
    assert 'lpf_watch_upstream_answers_total{status_class="5xx"} 1.0' in text
    assert 'lpf_watch_upstream_answers_total{status_class="4xx"} 0.0' in text
