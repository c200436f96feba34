"""One sampled request as rows of the run schema (requests, tokens) and of the `watch` side table.

Contract: `Recording(tokenizer, vocab_size, keep_text).rows(sample) -> (request row, token rows, watch row)`.
Token ids come from the upstream's `token_ids` (vLLM's and lpf serve's `return_token_ids`), else from the
logprob entries mapped back with the local tokenizer (`lpf.adapters.token_map`, each mapping checked),
else from the answer's text re-encoded (kept as `retokenized` in `inconsistency`: the rescore stage never
scores ids that are not the server's). Logprobs are read in either shape (`openai_shapes.read_logprobs`)
and paired with the ids position by position; a count that does not match is kept as returned, with the
mismatch in `inconsistency` (a token past the last entry has no logprob: null; an entry whose logprob is
no number: NaN, never clean). The prompt's ids: the upstream's `prompt_token_ids`, else the client's
token-id prompt, else its text encoded, else (chat) its messages rendered with the tokenizer's template.
An upstream error, a malformed answer or a stream cut short is a request row with `error` set (evidence,
never scored). `keep_text=False` (`--no-text`): no text (outputs, evidence) is written, token ids only.
The `watch` table's columns are `WATCH`'s; the request's API key is never among them.
"""

from __future__ import annotations

import hashlib
import json
import math

import pyarrow as pa

from lpf.adapters.http import RequestFailed
from lpf.adapters.openai_shapes import MISSING, read_logprobs
from lpf.adapters.token_map import TokenMap
from lpf.watch.evidence import Sample
from lpf.watch.wire import CHAT

WATCH = pa.schema(
    [
        ("request_id", pa.string()),
        ("route", pa.string()),
        ("stream", pa.bool_()),
        ("status", pa.int32()),
        ("in_flight", pa.int32()),
        ("upstream_request_id", pa.string()),
        ("replica_headers", pa.string()),  # JSON object of evidence.REPLICA_HEADERS answered
        ("model", pa.string()),
        ("temperature", pa.float64()),
        ("client_asked_logprobs", pa.bool_()),
        ("lpf_added", pa.string()),  # what lpf asked for beyond the client: logprobs, token_ids
    ]
)


# the body's sampling fields as `schema.SAMPLING` names them (OpenAI's names; vLLM's and SGLang's extras)
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _number(value, kind):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return kind(value)


def sent_sampling(body: dict, lpf_added_logprobs: bool) -> dict:
    """The request's sampling settings as its client sent them (`schema.SAMPLING`; a field not sent is null:
    the server's default); `logprobs`: the top-k the client itself asked for (chat: `top_logprobs`)."""
    out = {name: _number(body.get(name), float) for name in _FLOATS}
    out["top_k"] = _number(body.get("top_k"), int)
    out["seed"] = _number(body.get("seed"), int)
    asked = body.get("top_logprobs") if body.get("logprobs") is True else body.get("logprobs")
    out["logprobs"] = None if lpf_added_logprobs else _number(asked, int)
    return out


def request_id(seq: int) -> str:
    return f"w{seq:09d}"


class Recording:
    def __init__(self, tokenizer, vocab_size: int, keep_text: bool = True):
        self.tok, self.keep_text = tokenizer, keep_text
        self.map = TokenMap(tokenizer, vocab_size)

    def rows(self, s: Sample) -> tuple[dict, list[dict], dict]:
        rid = request_id(s.seq)
        c = s.collected
        problems = list(c.problems)
        error = s.error
        prompt_ids: list[int] | None = None
        out_ids: list[int] = []
        lps: list = []
        tops: list = []
        try:
            prompt_ids = self._prompt(s)
        except Exception as e:  # a prompt lpf cannot tokenize is the request's error, never the proxy's
            error = error or f"prompt not recorded: {type(e).__name__}: {e}"
        if error is None:
            try:
                out_ids, lps, tops = self._outputs(s, problems)
            except RequestFailed as e:
                error = str(e)
        text = "".join(c.text)
        req = {
            "request_id": rid,
            "seq": s.seq,
            "prompt_id": hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:16],
            "rollout": 0,
            "prompt_token_ids": prompt_ids or [],
            "output_token_ids": out_ids if error is None else [],
            "output_text": text if self.keep_text and error is None else None,
            "finish_reason": "error" if error is not None else (c.finish_reason or "stop"),
            "error": error
            if error is None or s.raw_evidence is None or not self.keep_text
            else f"{error}: {s.raw_evidence}",
            "t_submit": s.t_arrival,
            "t_first_token": s.t_first,
            "t_finish": s.t_end,
            "oracle_expected": None,
            "oracle_ok": None,
            "inconsistency": "; ".join(problems) or None,
            "sampling": sent_sampling(s.body, s.added.logprobs),
            "attempts": [
                {
                    "attempt": 0,
                    "sent": True,
                    "status": s.status,
                    "error": s.error,
                    "t_start": s.t_arrival,
                    "t_end": s.t_end,
                }
            ],
        }
        tokens = (
            []
            if error is not None
            else [
                {
                    "request_id": rid,
                    "position": i,
                    "token_id": t,
                    "engine_logprob": lp,
                    "engine_topk_ids": [a for _, a in top] if top else [],
                    "engine_topk_logprobs": [v for v, _ in top] if top else [],
                }
                for i, (t, lp, top) in enumerate(zip(out_ids, lps, tops))
            ]
        )
        body = s.body
        temperature = body.get("temperature")
        watch = {
            "request_id": rid,
            "route": s.route,
            "stream": s.stream,
            "status": s.status,
            "in_flight": s.in_flight,
            "upstream_request_id": s.upstream_request_id,
            "replica_headers": json.dumps(s.headers, sort_keys=True) if s.headers else None,
            "model": body.get("model") if isinstance(body.get("model"), str) else None,
            "temperature": float(temperature)
            if isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            else None,
            "client_asked_logprobs": not s.added.logprobs,
            "lpf_added": ",".join(
                n for n, on in (("logprobs", s.added.logprobs), ("token_ids", s.added.token_ids)) if on
            )
            or None,
        }
        return req, tokens, watch

    def _prompt(self, s: Sample) -> list[int]:
        c, body = s.collected, s.body
        if c.prompt_token_ids and all(isinstance(t, int) for t in c.prompt_token_ids):
            return [int(t) for t in c.prompt_token_ids]
        if s.route == CHAT:
            from lpf.core.chat import check_messages, render

            return render(self.tok, check_messages(body.get("messages"), "the request"))
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return list(self.tok.encode(prompt))

    def _outputs(self, s: Sample, problems: list[str]) -> tuple[list[int], list, list]:
        c = s.collected
        block = read_logprobs(c.logprobs_block())
        ids = [int(t) for t in c.token_ids if isinstance(t, int)]
        if block is None:
            if not ids:
                ids, exact = self.map.text_ids("".join(c.text))
                problems.append("retokenized: the upstream returned neither token ids nor logprobs; ids re-encoded")
            return ids, [None] * len(ids), [None] * len(ids)
        from_block = [self.map.resolve(p.token, p.tid, p.raw, i, strict=not ids) for i, p in enumerate(block.positions)]
        if not ids:
            ids = from_block
        elif len(from_block) != len(ids):
            problems.append(f"logprobs: {len(from_block)} logprob entries for {len(ids)} token ids")
        lps = [_logprob(p.logprob) for p in block.positions][: len(ids)]
        lps += [None] * (len(ids) - len(lps))
        tops = [self._top(p.top, i) for i, p in enumerate(block.positions)][: len(ids)]
        tops += [None] * (len(ids) - len(tops))
        return ids, lps, tops

    def _top(self, alts, pos: int) -> list | None:
        if not alts:
            return None
        pairs = []
        for a in alts:
            tid = self.map.resolve(a.token, a.tid, a.raw, pos, strict=False)
            v = _logprob(a.logprob)
            if tid is not None and not math.isnan(v):  # an alternative without a number is left out
                pairs.append((v, tid))
        return sorted(pairs, key=lambda p: -p[0])


def _logprob(v) -> float:
    """An entry's logprob: NaN where the entry holds no number (a server that computed NaN may serialize
    it as null: evidence, never clean, as `remote.Problems.logprob` keeps it). A token with no entry at
    all is None (`_outputs`: no logprob came back, judged from the token, `lpf.analysis.absent`)."""
    if v is MISSING or v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    v = float(v)
    return -math.inf if v <= -9999.0 else v  # vLLM renders -inf as -9999.0
