"""`openai` engine: any OpenAI-compatible server's `/v1/completions` (vLLM, SGLang, TGI, llama.cpp, `lpf serve`).

One HTTP request per run request (n=1: rollouts are separate requests, each with its own seed), the
prompt sent as token ids, `logprobs=k`. Token identity: with `token_ids=auto` (default) the request
asks for `return_tokens_as_token_ids` (vLLM and `lpf serve` answer "token_id:N"); a server that
refuses that field is asked again without it, once for the whole run. Token strings are mapped back
to ids with the local tokenizer and every mapping is checked (the id must decode back to the same
string; two ids that decode alike cannot be told apart this way, which is why ids are asked for
first); a sampled token that does not map is that request's error. Top-k entries that do not map are
left out of that position's top-k (the sampled token's logprob is what gets compared).
Answers are checked before they are trusted: logprobs present, one per token and ids inside the
vocabulary (else the request's error), and the server's token count, its text, its finish reason
and the logprob values (else the answer is kept with an `inconsistency`, see `remote`). Each
attempt sends the run's request id as `X-Request-Id`.
Prompt logprobs (`--prompt-logprobs`): `-E prompt_logprobs=echo` (default) asks for `echo` with
`logprobs` (the OpenAI way: the answer's tokens start with the prompt, position 0 without a logprob);
the echoed tokens must be the prompt (else its prompt logprobs are not stored and the answer says
why), and the answer's text is not checked (it starts with the prompt's text). `=field` asks for
vLLM's `prompt_logprobs: k` instead and reads `choices[0].prompt_logprobs` ({token id: {logprob, rank}}).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import model_validator

from lpf.adapters.base import Completion
from lpf.adapters.http import RequestFailed
from lpf.adapters.remote import Problems, RemoteEngine, RemoteOptions, as_logprob
from lpf.core.errors import LpfError
from lpf.core.knobs import knob
from lpf.core.workload import EngineRequest

TOKEN_ID_PREFIX = "token_id:"
_ID_FIELD = "return_tokens_as_token_ids"


class OpenAIOptions(RemoteOptions):
    served_model: str = knob("", help="openai engine: the name the server serves, when --model is the local copy.",
                             flag=True)
    token_ids: Literal["auto", "server", "tokenizer"] = knob(
        "auto", help="How token ids are known: server (demand token_id:N), tokenizer (map the strings), auto.")
    prompt_logprobs: Literal["echo", "field"] = knob(
        "echo", help="How --prompt-logprobs asks: echo + logprobs, or vLLM's prompt_logprobs field.")

    @model_validator(mode="after")
    def _named(self):
        if not self.served_model:
            raise LpfError("--engine openai needs the served model's name (--model NAME or --served-model NAME)")
        return self


class OpenAIEngine(RemoteEngine):
    name = "openai"
    Options = OpenAIOptions
    needs_served_name = True
    supports_prompt_logprobs = True

    def __init__(self, model, sampling, options: OpenAIOptions):
        super().__init__(model, sampling, options)
        self.ask_for_ids = options.token_ids != "tokenizer"
        self.id_modes_seen: set[str] = set()

    def endpoint(self) -> str:
        return "/completions" if self.options.base_url.rstrip("/").endswith("/v1") else "/v1/completions"

    def describe(self) -> dict:
        d = super().describe()
        d["token_identity"] = sorted(self.id_modes_seen) or None
        d["return_tokens_as_token_ids"] = self.ask_for_ids
        return d

    def payload(self, req: EngineRequest) -> dict:
        s = self.sampling
        body = {"model": self.options.served_model, "prompt": list(req.prompt_token_ids),
                "max_tokens": req.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                "seed": req.seed, "n": 1, "logprobs": s.logprobs, "stream": False}
        # vLLM/SGLang extensions: sent only when they change something (strict servers refuse unknown fields)
        if s.top_k:
            body["top_k"] = s.top_k
        if s.ignore_eos:
            body["ignore_eos"] = True
        if self.ask_for_ids:
            body[_ID_FIELD] = True
        if s.prompt_logprobs and self.options.prompt_logprobs == "echo":
            body["echo"] = True
        elif s.prompt_logprobs:
            body["prompt_logprobs"] = s.logprobs
        return body

    def tag(self, req, payload, attempt):
        return payload, {"X-Request-Id": self.attempt_id(req, attempt)}  # vLLM and lpf serve adopt it

    async def call(self, client, req, deadline, breaker, attempts):
        asked = self.ask_for_ids
        try:
            return await super().call(client, req, deadline, breaker, attempts)
        except RequestFailed as e:
            # A strict server rejects the vLLM extension: fall back to string tokens for the whole run.
            if self.options.token_ids == "auto" and asked and "HTTP 4" in str(e) and _ID_FIELD in str(e):
                self.ask_for_ids = False
                return await super().call(client, req, deadline, breaker, attempts)
            raise

    def parse(self, req: EngineRequest, body: Any) -> Completion:
        if not isinstance(body, dict):
            raise RequestFailed(f"answer is a JSON {type(body).__name__}, not an object")
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise RequestFailed("answer has no choices")
        choice = choices[0]
        lp = choice.get("logprobs")
        if not isinstance(lp, dict):
            raise RequestFailed("answer has no logprobs (the server ignored logprobs=k)")
        tokens, values = lp.get("tokens"), lp.get("token_logprobs")
        if not isinstance(tokens, list) or not isinstance(values, list):
            raise RequestFailed("answer's logprobs lack tokens / token_logprobs lists")
        if len(values) != len(tokens):
            raise RequestFailed(f"{len(values)} logprobs for {len(tokens)} tokens")
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        ids = [self.token_id(t, pos, strict=True) for pos, t in enumerate(tokens)]
        self.check_ids(ids)
        problems = Problems()
        echoed = self.sampling.prompt_logprobs and self.options.prompt_logprobs == "echo"
        # an echoed prompt's first token has no logprob (nothing precedes it): not a problem there
        logprobs = [math.nan if echoed and pos == 0 else problems.logprob(v, pos) for pos, v in enumerate(values)]
        top = lp.get("top_logprobs")
        prompt = self._echoed_prompt(req, ids, logprobs, top, problems) if echoed else None
        if echoed:  # the answer's tokens start with the prompt: the outputs follow it
            n = len(req.prompt_token_ids)
            ids, logprobs, top = ids[n:], logprobs[n:], top[n:] if isinstance(top, list) else top
        elif self.sampling.prompt_logprobs:
            prompt = self._prompt_field(req, choice.get("prompt_logprobs"), problems)
        finish = choice.get("finish_reason")
        if finish is None:  # no claim to check; what the length says
            finish = "length" if len(ids) >= req.max_tokens else "stop"
        self.check_answer(req, ids, usage.get("completion_tokens"), finish, None if echoed else choice.get("text"),
                          problems)
        topk_ids, topk_lps = self.top_k(top, len(ids), "top_logprobs", self.top_pairs, problems)
        return Completion(request_id=req.request_id, output_token_ids=ids, logprobs=logprobs, topk_ids=topk_ids,
                          topk_logprobs=topk_lps, finish_reason=str(finish), inconsistency=problems.text(),
                          prompt_logprobs=prompt[0] if prompt else None, prompt_topk_ids=prompt[1] if prompt else [],
                          prompt_topk_logprobs=prompt[2] if prompt else [])

    def _echoed_prompt(self, req, ids, logprobs, top, problems) -> tuple[list, list, list] | None:
        """(logprobs, top-k ids, top-k logprobs) of prompt positions 1..P-1 from an echoed answer; None,
        with the reason noted, when the echo is not the prompt."""
        prompt = list(req.prompt_token_ids)
        n = len(prompt)
        if len(ids) <= n:
            raise RequestFailed(f"echo returned {len(ids)} tokens for a prompt of {n} and at least one output")
        if ids[:n] != prompt:
            at = next(i for i, (a, b) in enumerate(zip(ids, prompt)) if a != b)
            problems.add("echo", f"the echoed tokens differ from the prompt at position {at} (prompt logprobs not stored)")
            return None
        p_ids, p_lps = self.top_k(top[1:n] if isinstance(top, list) else top, n - 1, "top_logprobs (prompt)",
                                  self.top_pairs, problems)
        return logprobs[1:n], p_ids, p_lps

    def _prompt_field(self, req, field: Any, problems) -> tuple[list, list, list] | None:
        """vLLM's `prompt_logprobs`: [null, {token id: {logprob, rank, ...}}, ...], one per prompt token."""
        prompt = list(req.prompt_token_ids)
        if not isinstance(field, list) or len(field) != len(prompt):
            problems.add("prompt_logprobs", f"prompt_logprobs has {len(field) if isinstance(field, list) else 'no'} "
                                            f"entries for {len(prompt)} prompt tokens")
            return None
        lps, ids_out, lps_out = [], [], []
        for pos, (tid, entry) in enumerate(zip(prompt[1:], field[1:]), 1):
            pairs = {}
            for key, value in (entry.items() if isinstance(entry, dict) else ()):
                v = value.get("logprob") if isinstance(value, dict) else value
                if str(key).lstrip("-").isdigit():
                    pairs[int(key)] = v
            lps.append(problems.logprob(pairs.get(tid), pos))
            best = sorted(((as_logprob(v, pos), t) for t, v in pairs.items()), key=lambda p: -p[0])
            best = [(v, t) for v, t in best if v == v][:self.sampling.logprobs]
            ids_out.append([t for _, t in best])
            lps_out.append([v for v, _ in best])
        return lps, ids_out, lps_out

    def top_pairs(self, entry: Any, pos: int) -> list[tuple[float, int]]:
        """One `top_logprobs` entry ({token: logprob}); alternatives without a usable id are left out."""
        pairs = []
        for key, value in (entry.items() if isinstance(entry, dict) else ()):
            tid = self.token_id(key, pos, strict=False)
            if tid is not None and 0 <= tid < self.vocab_size:
                pairs.append((as_logprob(value, pos), tid))
        return pairs

    def token_id(self, token: Any, pos: int, strict: bool) -> int | None:
        """The id behind one answered token; None (strict=False) or RequestFailed when it has none."""
        if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
            try:
                tid = int(token[len(TOKEN_ID_PREFIX):])
                self.id_modes_seen.add("server")
                return tid
            except ValueError:
                pass
        if self.options.token_ids == "server":
            if strict:
                raise RequestFailed(f"token {token!r} at position {pos} is not in token_id:N form")
            return None
        tid = self.map_string(token) if isinstance(token, str) else None
        if tid is None and strict:
            raise RequestFailed(f"token {token!r} at position {pos} does not map back to one token id "
                                f"of the local tokenizer")
        if tid is not None:
            self.id_modes_seen.add("tokenizer")
        return tid

    def map_string(self, text: str) -> int | None:
        """The one id whose decoding is exactly `text` (raw vocabulary pieces and decoded text both
        accepted), checked by decoding it back; None when there is no such single id."""
        tok = self.tokenizer
        candidates = []
        vocab_id = tok.convert_tokens_to_ids(text)
        if isinstance(vocab_id, int) and vocab_id != tok.unk_token_id:
            candidates.append(vocab_id)
        encoded = tok.encode(text, add_special_tokens=False)
        if len(encoded) == 1:
            candidates.append(encoded[0])
        for tid in candidates:
            if tok.decode([tid]) == text or tok.convert_ids_to_tokens(tid) == text:
                return tid
        return None
