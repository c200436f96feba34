"""The `llamacpp` engine's wire format: llama-server's native `POST /completion`, token ids both ways.

Request (`payload`): `prompt` as a list of token ids (llama-server adds no BOS to an id list:
`tokenize_mixed`, tools/server/server-common.cpp), `n_predict`, `seed`, `return_tokens`, `stream:
false`, `cache_prompt` and `id_slot: -1` (any free slot), `n_probs = max(1, k)` with
`post_sampling_probs: false`. With post_sampling_probs false, `populate_token_probs`
(tools/server/server-context.cpp) takes `get_token_probabilities` (server-common.cpp): the softmax of
the raw logits over the whole vocabulary, before any sampler and before temperature, in float32,
and the answer carries `logprob = log(p)` (`completion_token_output::logarithm`, server-task.cpp; a
probability that underflowed to 0 is sent as -FLT_MAX, read here as -inf). That is what lpf calls
the raw logprob. Every sampler is set explicitly, because llama-server's defaults are top_k 40,
top_p 0.95, min_p 0.05, typical 1, and its chain ends in `dist` (a random draw):
`samplers` is ["temperature"] for greedy (temperature 0: `llama_sampler_temp_impl` keeps only the
argmax, src/llama-sampler.cpp) and ["temperature", "top_k", "top_p"] otherwise (lpf's order:
temperature, then top-k, then top-p), with top_k (0 = off), top_p, min_p 0, typical_p 1, top_n_sigma
-1, xtc_probability 0, repeat_last_n 0 / repeat_penalty 1 / frequency 0 / presence 0, dry_multiplier 0,
mirostat 0, dynatemp_range 0, adaptive_target -1 and no logit bias, grammar or stop strings;
`ignore_eos` only with the engine's `ban_eos` (llama-server then bans end-of-generation tokens).

Answer (`parse`, `server_task_result_cmpl_final::to_json_non_oaicompat`): `tokens` (the ids), `content`,
`stop_type` (eos | limit | word | none), `truncated`, `tokens_predicted`, `id_slot`, `tokens_cached`,
`timings` {cache_n (prompt tokens reused from the slot's cache), prompt_n (prompt tokens computed),
predicted_n, prompt_ms, predicted_ms}, `completion_probabilities` [{id, token, bytes, logprob,
top_logprobs: [{id, token, bytes, logprob}]}]. `tokens` are the generated ids (`return_tokens`), but
`completion_probabilities` may hold fewer: `process_token` (server-context.cpp) adds a token's
probabilities only when the text so far is complete UTF-8, so a token that ends inside a multi-byte
character gets none (which tokens: `_sent_positions` replays the rule from their bytes, since a repeated
token makes matching by id alone ambiguous), and server-task.cpp leaves the key out when no token got
one. When the entries are `tokens` in order with some (or all) missing, the tokens are stored with no
logprob (None, as for any server that returned none) and no top-k where none came, and the answer notes
`logprobs_missing` (evidence; the analysis judges such a token from the token alone,
`lpf.analysis.absent`, while a logprob that is no number stays NaN, never clean); entries that are no
such subsequence are stored as sent with a `tokens` inconsistency; an answer with neither entries nor
tokens is a failed request. The count must agree with `tokens_predicted`, the text with the tokens, and
`truncated` must be false (the slot's context ran out, or a context shift dropped tokens), else the
answer is kept with an `inconsistency`. `slot_row` is the trace's view of the answer (which slot, how
much of the prompt came from its cache).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from lpf.adapters.base import Completion
from lpf.adapters.http import RequestFailed
from lpf.adapters.remote import Problems, as_logprob, snippet
from lpf.core.sampling import SamplingParams
from lpf.core.workload import EngineRequest

_FLT_MAX = 3.4028234663852886e38
FINISH = {"eos": "stop", "word": "stop", "limit": "length"}


def samplers(s: SamplingParams) -> list[str]:
    return ["temperature"] if s.greedy else ["temperature", "top_k", "top_p"]


def payload(req: EngineRequest, s: SamplingParams, cache_prompt: bool, ban_eos: bool = False) -> dict:
    return {
        "prompt": list(req.prompt_token_ids),
        "n_predict": req.max_tokens,
        "seed": req.seed,
        "stream": False,
        "return_tokens": True,
        "cache_prompt": cache_prompt,
        "id_slot": -1,
        "n_probs": max(1, s.logprobs),
        "post_sampling_probs": False,
        "samplers": samplers(s),
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": 0.0,
        "typical_p": 1.0,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "dynatemp_range": 0.0,
        "repeat_last_n": 0,
        "repeat_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "dry_multiplier": 0.0,
        "mirostat": 0,
        "adaptive_target": -1.0,
        "min_keep": 0,
        "logit_bias": [],
        "ignore_eos": bool(s.ignore_eos and ban_eos),
        "stop": [],
        "n_cmpl": 1,
    }


def logprob(value: Any, pos: int, problems: Problems) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= -_FLT_MAX * 0.999:
        return -math.inf  # llama.cpp's stand-in for log(0) (JSON has no -inf)
    return problems.logprob(value, pos)


def parse(
    req: EngineRequest, body: Any, s: SamplingParams, vocab_size: int, bytes_of: Callable | None, check_answer
) -> Completion:
    """One answer -> Completion; `check_answer` is RemoteEngine.check_answer (count, finish, text);
    `bytes_of` (a token id's bytes, `TokenMap.bytes_of`; None: not known) places missing entries."""
    if not isinstance(body, dict):
        raise RequestFailed(f"answer is a JSON {type(body).__name__}, not an object")
    probs = body.get("completion_probabilities")
    tokens = body.get("tokens")
    problems = Problems()
    if probs is None and isinstance(tokens, list) and tokens:
        # server-task.cpp leaves the key out when no token got an entry (every token ended inside a
        # UTF-8 character, or a server ignoring n_probs): the tokens stand, each without a logprob
        probs = []
        problems.add("logprobs_missing", "the answer has no completion_probabilities for any of its tokens")
    if not isinstance(probs, list):
        raise RequestFailed("answer has no completion_probabilities (was n_probs ignored?)")
    ids, lps, top_ids, top_lps = [], [], [], []
    for pos, e in enumerate(probs):
        tid = e.get("id") if isinstance(e, dict) else None
        if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab_size:
            raise RequestFailed(
                f"completion_probabilities[{pos}] has id {snippet(tid)}, not a token id of the "
                f"model's vocabulary (0..{vocab_size - 1})"
            )
        ids.append(tid)
        lps.append(logprob(e.get("logprob"), pos, problems))
        pairs = []
        for alt in e.get("top_logprobs") or []:
            aid = alt.get("id") if isinstance(alt, dict) else None
            if not isinstance(aid, int) or isinstance(aid, bool) or not 0 <= aid < vocab_size:
                problems.add("top_logprobs", f"top_logprobs[{pos}] holds {snippet(alt)}, not a token id")
                continue
            v = alt.get("logprob")
            pairs.append(
                (-math.inf if isinstance(v, (int, float)) and v <= -_FLT_MAX * 0.999 else as_logprob(v, pos), aid)
            )
        pairs.sort(key=lambda p: -p[0])
        top_ids.append([t for _, t in pairs[: s.logprobs]])
        top_lps.append([v for v, _ in pairs[: s.logprobs]])
    if isinstance(tokens, list) and tokens != ids:
        at = _subsequence(ids, tokens, vocab_size)
        if at is not None and bytes_of is not None:
            at = _sent_positions(ids, tokens, bytes_of) or at
        if at is None:
            bad = next((i for i, (a, b) in enumerate(zip(tokens, ids)) if a != b), min(len(tokens), len(ids)))
            problems.add(
                "tokens", f"tokens ({len(tokens)}) and completion_probabilities ({len(ids)}) disagree at position {bad}"
            )
        else:  # entries missing, the rest in order: the generated tokens stand, no logprob where none was sent
            missing = sorted(set(range(len(tokens))) - set(at))
            problems.add(
                "logprobs_missing",
                f"no completion_probabilities entry for {len(missing)} of {len(tokens)} "
                f"tokens (positions {snippet(missing)}): llama-server adds a token's "
                f"probabilities only once the text is complete UTF-8",
            )
            full = [None] * len(tokens), [[] for _ in tokens], [[] for _ in tokens]
            for j, i in enumerate(at):
                full[0][i], full[1][i], full[2][i] = lps[j], top_ids[j], top_lps[j]
            ids, (lps, top_ids, top_lps) = list(tokens), full
    if body.get("truncated"):
        problems.add(
            "truncated",
            "the server says truncated: the slot's context (ctx_size / parallel) ran out before "
            "max_tokens, or a context shift discarded tokens the answer was computed without",
        )
    stop_type = body.get("stop_type")
    finish = FINISH.get(stop_type, stop_type if isinstance(stop_type, str) else "length")
    check_answer(
        req,
        ids,
        body.get("tokens_predicted"),
        finish,
        body.get("content"),
        problems,
        f"stop_type {stop_type!r}" if finish not in ("stop", "length") else None,
    )
    keep_top = s.logprobs > 0
    return Completion(
        request_id=req.request_id,
        output_token_ids=ids,
        logprobs=lps,
        topk_ids=top_ids if keep_top else [],
        topk_logprobs=top_lps if keep_top else [],
        finish_reason=str(finish),
        inconsistency=problems.text(),
    )


def _sent_positions(ids: list, tokens: list, bytes_of: Callable) -> list[int] | None:
    """The positions llama-server sent an entry for, replayed from the tokens' bytes: `process_token`
    (server-context.cpp) adds a token's probabilities only when `validate_utf8` (server-common.cpp) finds
    no multi-byte character cut off at the end of the text generated so far. Where `ids` repeats a token,
    matching entries to tokens in order cannot tell which copy went without: tokens [lone lead byte of a
    3-byte character, "7", "7", EOS] get entries for positions 2 and 3 (the text is cut off until the
    second "7"), where the first match puts the second entry's logprob and top-k on position 1. None when
    a token's bytes are unknown or the replay's positions do not hold `ids` (then the first match stands)."""
    text, sent = b"", []
    for i, t in enumerate(tokens):
        piece = bytes_of(t)
        if piece is None:
            return None
        text += piece
        if not _cut_off(text):
            sent.append(i)
    return sent if [tokens[i] for i in sent] == list(ids) else None


def _cut_off(text: bytes) -> bool:
    """llama-server's `validate_utf8(text) < text.size()`: a multi-byte character's lead byte among the
    last four bytes, with fewer bytes after it than the character needs."""
    for i in range(1, min(4, len(text)) + 1):
        c = text[-i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) or (c & 0xF8 == 0xF0 and i < 4):
            return True
    return False


def _subsequence(sub: list, full: list, vocab_size: int) -> list[int] | None:
    """Where each item of `sub` sits in `full` (greedy, in order), or None when `sub` is not a
    subsequence of `full` (or `full` holds something other than the vocabulary's token ids)."""
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in full):
        return None
    at, i = [], 0
    for t in sub:
        while i < len(full) and full[i] != t:
            i += 1
        if i == len(full):
            return None
        at.append(i)
        i += 1
    return at


def slot_row(req: EngineRequest, body: Any) -> dict:
    """The trace's facts from one answer (None where the server did not say)."""
    body = body if isinstance(body, dict) else {}
    t = body.get("timings") if isinstance(body.get("timings"), dict) else {}

    def num(d, k, kind=int):
        v = d.get(k)
        return kind(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    return {
        "request_id": req.request_id,
        "state_slot": num(body, "id_slot"),
        "cache_n": num(t, "cache_n"),
        "prompt_n": num(t, "prompt_n"),
        "predicted_n": num(t, "predicted_n"),
        "tokens_cached": num(body, "tokens_cached"),
        "prompt_ms": num(t, "prompt_ms", float),
        "predicted_ms": num(t, "predicted_ms", float),
        "n_prompt_tokens": len(req.prompt_token_ids),
    }
