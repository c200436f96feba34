"""`sglang` engine: SGLang's native `/generate` (one model per server, so no model name is sent).

Request: `input_ids`, `sampling_params` (max_new_tokens, temperature, top_p, top_k (-1 = off),
ignore_eos, sampling_seed), `return_logprob`, `top_logprobs_num`, `logprob_start_len=-1` (output
positions only), `return_text_in_logprobs=false` (ids are what we compare). Answer, as SGLang's
tokenizer manager builds it: `{"text", "output_ids", "meta_info": {"finish_reason": {"type": ...},
"completion_tokens", "output_token_logprobs": [[logprob, token_id, text|null], ...],
"output_top_logprobs": [[[logprob, token_id, text|null], ...] | null, ...]}}`. The ids in
`output_token_logprobs` (the ones paired with logprobs, and the ones stored) must agree with
`output_ids` and `text` when the server sends them, else the answer is kept with an `inconsistency`;
an `abort` finish with no tokens is that request's error, one with tokens an inconsistency.
With `--prompt-logprobs`, `logprob_start_len=0`: `meta_info.input_token_logprobs` (one
[logprob|null, token_id, text] per prompt token, null first) and `input_top_logprobs`; the ids must be
the prompt's (else its prompt logprobs are not stored, and the answer says why).
"""

from __future__ import annotations

from typing import Any

from lpf.adapters.base import Completion
from lpf.adapters.http import RequestFailed
from lpf.adapters.remote import Problems, RemoteEngine, snippet, as_logprob
from lpf.core.workload import EngineRequest


class SGLangEngine(RemoteEngine):
    name = "sglang"
    supports_prompt_logprobs = True

    def endpoint(self) -> str:
        return "/generate"

    def url(self, path: str) -> str:
        base = self.options.base_url.rstrip("/")
        # /generate sits at the server root, beside (not under) the OpenAI /v1 routes
        return base.removesuffix("/v1") + path

    def payload(self, req: EngineRequest) -> dict:
        s = self.sampling
        return {
            "input_ids": list(req.prompt_token_ids),
            "sampling_params": {
                "max_new_tokens": req.max_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k or -1,
                "ignore_eos": s.ignore_eos,
                "sampling_seed": req.seed,
            },
            "return_logprob": True,
            "top_logprobs_num": s.logprobs,
            "logprob_start_len": 0 if s.prompt_logprobs else -1,
            "return_text_in_logprobs": False,
            "stream": False,
        }

    def tag(self, req, payload, attempt):
        rid = self.told(req, self.attempt_id(req, attempt))
        return {**payload, "rid": rid}, {}, rid  # SGLang's own request id field

    def parse(self, req: EngineRequest, body: Any) -> Completion:
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            raise RequestFailed("answer has no meta_info object")
        meta = body["meta_info"]
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        detail = finish.get("message") if isinstance(finish, dict) else None
        entries = meta.get("output_token_logprobs")
        if kind not in ("stop", "length") and not entries:
            raise RequestFailed(f"finish_reason {kind!r}" + (f": {detail}" if detail else ""))
        if not isinstance(entries, list):
            raise RequestFailed("answer has no output_token_logprobs (was return_logprob ignored?)")
        problems = Problems()
        ids, logprobs = [], []
        for pos, e in enumerate(entries):
            if not isinstance(e, list) or len(e) < 2:
                raise RequestFailed(f"output_token_logprobs[{pos}] is {e!r}, not [logprob, token_id, ...]")
            logprobs.append(problems.logprob(e[0], pos))
            ids.append(e[1])
        self.check_ids(ids)
        output_ids = body.get("output_ids")
        if output_ids is not None:
            if not isinstance(output_ids, list):
                problems.add("output_ids", f"output_ids is {type(output_ids).__name__}, not a list")
            elif output_ids != ids:
                pos = next(
                    (i for i, (a, b) in enumerate(zip(output_ids, ids)) if a != b), min(len(ids), len(output_ids))
                )
                problems.add(
                    "output_ids",
                    f"output_ids ({len(output_ids)} tokens) and output_token_logprobs "
                    f"({len(ids)}) disagree at position {pos} (output_ids there: "
                    f"{snippet(output_ids[pos : pos + 8])})",
                )
        self.check_answer(req, ids, meta.get("completion_tokens"), kind, body.get("text"), problems, detail)
        topk_ids, topk_lps = self.top_k(
            meta.get("output_top_logprobs"),
            len(ids),
            "output_top_logprobs",
            lambda entry, pos: self.top_pairs(entry, pos, problems),
            problems,
        )
        prompt = self._input_logprobs(req, meta, problems) if self.sampling.prompt_logprobs else None
        return Completion(
            request_id=req.request_id,
            output_token_ids=ids,
            logprobs=logprobs,
            topk_ids=topk_ids,
            topk_logprobs=topk_lps,
            finish_reason=str(kind),
            inconsistency=problems.text(),
            prompt_logprobs=prompt[0] if prompt else None,
            prompt_topk_ids=prompt[1] if prompt else [],
            prompt_topk_logprobs=prompt[2] if prompt else [],
        )

    def _input_logprobs(self, req: EngineRequest, meta: dict, problems: Problems) -> tuple[list, list, list] | None:
        """(logprobs, top-k ids, top-k logprobs) of prompt positions 1..P-1 (logprob_start_len=0)."""
        prompt = list(req.prompt_token_ids)
        entries = meta.get("input_token_logprobs")
        ok = (
            isinstance(entries, list)
            and len(entries) == len(prompt)
            and all(isinstance(e, list) and len(e) >= 2 for e in entries)
        )
        if not ok or [e[1] for e in entries] != prompt:
            problems.add(
                "input_token_logprobs",
                "input_token_logprobs are not one [logprob, id] per prompt token "
                "with the prompt's ids (prompt logprobs not stored)",
            )
            return None
        lps = [problems.logprob(e[0], pos) for pos, e in enumerate(entries) if pos]
        top = meta.get("input_top_logprobs")
        ids, tlps = self.top_k(
            top[1:] if isinstance(top, list) else top,
            len(prompt) - 1,
            "input_top_logprobs",
            lambda entry, pos: self.top_pairs(entry, pos, problems),
            problems,
        )
        return lps, ids, tlps

    def top_pairs(self, entry: Any, pos: int, problems: Problems) -> list[tuple[float, int]]:
        """One `output_top_logprobs` entry: [[logprob, token_id, text|null], ...]; an alternative that is
        not of that shape or names an id outside the vocabulary is left out, and noted (the sampled
        token's logprob is what gets compared)."""
        pairs = []
        for e in entry if isinstance(entry, list) else []:
            tid = e[1] if isinstance(e, list) and len(e) >= 2 else None
            if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < self.vocab_size:
                problems.add(
                    "top_logprobs",
                    f"output_top_logprobs[{pos}] holds {snippet(e)}, not [logprob, token_id in the vocabulary, ...]",
                )
                continue
            pairs.append((as_logprob(e[0], pos), tid))
        return pairs
