"""`openai` engine: any OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp, `transformers serve`, `lpf serve`,
hosted APIs), on `/v1/completions` or `/v1/chat/completions`.

One HTTP request per run request (n=1: rollouts are separate requests, each with its own seed).
Route (`-E api=auto|completions|chat`; `--api`): chat when asked, or (auto) when the workload has
`messages`; the messages are sent and the reference scores the tokenizer's rendering of them (`lpf.core.chat`).
Prompt (`-E prompt=auto|ids|text`, completions only): token ids, or the prompt's text; auto sends ids
and, when the server refuses them (a 4xx naming the prompt, "prompt must be a string", or a validation
error under any status, "Input should be a valid string" in a 500: never retried), sends text for the
rest of the run, once, and says so (`notes`); with `ids` the refusal is the request's error, with the
hint to try `-E prompt=text`. Request ids (`-E request_id_header=uuid|lpf|none`): each attempt's
`X-Request-Id` is a fresh UUID by default (request-id middleware may refuse anything else), lpf's id, or
absent; the value sent is the attempt's `sent_id`, and the run's records keep lpf's ids either way.
The server's prompt is checked against the reference's: its `prompt_token_ids` (vLLM's
`return_token_ids`) or `usage.prompt_tokens` must be the stored prompt's (else the answer is kept with `prompt_tokens`, or `chat_template` on the chat route: the server
rendered the messages differently, and its tokens are scored after the reference's rendering).
Logprobs: `logprobs=k` (completions) or `logprobs: true, top_logprobs: k` (chat), read in either shape
on either route (`openai_shapes`: the legacy lists, or the `logprobs.content` list with or without ids
and bytes). Token identity (`token_map`): with `token_ids=auto` the request asks for vLLM's
`return_tokens_as_token_ids` and `return_token_ids`; a server that refuses them is asked again without
them, once for the whole run; strings and bytes are mapped back to ids with the local tokenizer, each
mapping checked. An answer with no logprobs at all (`-E logprobs=auto`, the default; `require` makes it
the request's error) is kept tokens only: its ids from the server's `token_ids`, else its text
re-encoded (checked: it must decode back to the same text and count what `usage` counts, the stop
token added when the server skipped its text; else kept with `retokenized`), its logprobs null; a
server that refuses `logprobs` altogether is asked without them (once, said in `notes`).
How ids are recovered where the entries alone do not give them, and the empty `stop` answer: `openai_ids`.
Answers are checked before they are trusted (see `remote`).
Prompt logprobs (`--prompt-logprobs`, completions route): `-E prompt_logprobs=echo` asks `echo` with
`logprobs` (the answer's tokens then start with the prompt, which they must be), `=field` asks vLLM's
`prompt_logprobs: k`; what an answer says of its prompt is read and checked in `openai_prompt`.
"""

from __future__ import annotations

import math
import re
import uuid
from collections import Counter
from typing import Any, Literal

from pydantic import Field, model_validator

from lpf.adapters import openai_prompt
from lpf.adapters.base import Completion
from lpf.adapters.http import RequestFailed, is_validation_error
from lpf.adapters.logprob_gaps import fill_gaps
from lpf.adapters.openai_ids import counts_more, empty_stop, sampled_ids, tokens_only
from lpf.adapters.openai_shapes import MISSING, read_logprobs
from lpf.adapters.remote import Problems, RemoteEngine, RemoteOptions, as_logprob
from lpf.adapters.token_map import TOKEN_ID_PREFIX, TokenMap  # noqa: F401  (TOKEN_ID_PREFIX re-exported)
from lpf.core.errors import LpfError
from lpf.core.knobs import knob
from lpf.core.workload import EngineRequest

_ID_FIELDS = ("return_tokens_as_token_ids", "return_token_ids")
MAX_ADAPTATIONS = 4
# a validator wanting text where lpf sent token ids (pydantic's "Input should be a valid string", ...)
_WANTS_TEXT = re.compile(
    r"valid string|\bstring_type\b|(?:be|expected) (?:a |an )?(?:str|string)\b|invalid type: sequence"
)
_OF_TYPE = re.compile(r"\b(?:str|string|text|list|array|token ids?|type)\b")
PROMPT_HINT = "the server refuses token-id prompts: try -E prompt=text"


class OpenAIOptions(RemoteOptions):
    served_model: str = knob(
        "", help="openai engine: the name the server serves, when --model is the local copy.", flag=True
    )
    token_ids: Literal["auto", "server", "tokenizer"] = knob(
        "auto", help="How token ids are known: server (demand token_id:N), tokenizer (map the strings), auto."
    )
    prompt_logprobs: Literal["echo", "field"] = knob(
        "echo", help="How --prompt-logprobs asks: echo + logprobs, or vLLM's prompt_logprobs field."
    )
    api: Literal["auto", "completions", "chat"] = knob(
        "auto",
        flag=True,
        help="openai engine: the route, /v1/completions or /v1/chat/completions (auto: chat "
        "when the workload has messages).",
    )
    prompt: Literal["auto", "ids", "text"] = Field(
        "auto", description="completions prompts as token ids or text; auto: ids, text once a server refuses ids"
    )
    logprobs: Literal["auto", "require"] = Field(
        "auto", description="an answer without logprobs: audited from its tokens (auto) or the request's error"
    )
    request_id_header: Literal["uuid", "lpf", "none"] = knob(
        "uuid",
        help="X-Request-Id sent with each attempt: a fresh UUID (recorded per attempt, so a server's trace "
        "maps back), lpf's own request id (ID~retryN on retries), or none (request-id middleware "
        "may accept only UUIDs).",
    )
    dtype: str | None = Field(
        None,
        description="the dtype the server says it computes in (its floor is the one judged against); "
        "unset: the most lenient pair measured",
    )

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
    trace_source = "joined"  # a vLLM server's lpf-vllm-trace directory, --trace-dir

    def __init__(self, model, sampling, options: OpenAIOptions):
        super().__init__(model, sampling, options)
        if sampling.prompt_logprobs and options.api == "chat":
            raise LpfError("--prompt-logprobs is read on the completions route only: drop it or use --api completions")
        self.ask_for_ids = options.token_ids != "tokenizer"
        self.send_text = options.prompt == "text"
        self.ask_logprobs = True
        self.map = TokenMap(self.tokenizer, self.vocab_size, options.token_ids)
        self.notes: list[str] = []
        self.routes: Counter = Counter()
        self.returned: Counter = Counter()  # answers by what came back: logprobs shape, or tokens only and from where
        self.top_k_seen = 0

    @classmethod
    def chat_prompts(cls, options) -> bool | None:
        return {"chat": True, "completions": False}.get(options.api)

    # -- the request ----------------------------------------------------------------------------------
    @staticmethod
    def is_chat(req: EngineRequest) -> bool:
        return req.messages is not None

    def endpoint(self, req: EngineRequest | None = None) -> str:
        path = "/chat/completions" if req is not None and self.is_chat(req) else "/completions"
        return path if self.options.base_url.rstrip("/").endswith("/v1") else "/v1" + path

    def url_for(self, req: EngineRequest) -> str:
        return self.url(self.endpoint(req))

    def describe(self) -> dict:
        d = super().describe()
        d["token_identity"] = sorted(self.map.seen) or None
        d["return_tokens_as_token_ids"] = self.ask_for_ids
        d["routes"] = dict(self.routes) or None
        d["prompt_form"] = "text" if self.send_text else "ids"
        d["returned"] = {"answers": dict(self.returned), "top_k": self.top_k_seen} if self.returned else None
        d["notes"] = list(self.notes)
        return d

    def configuration(self) -> dict:
        """What the server says of its configuration, where it says it (`engine_config`): vLLM's
        `/server_info` (VLLM_SERVER_DEV_MODE=1), llama-server's `/props`, `lpf serve`'s `/v1/models`,
        llama-cpp-python's `/openapi.json`; each
        asked once, briefly; a server that answers none of them says nothing."""
        from lpf.adapters import engine_config as ec

        readers = (
            # vLLM's answers only once it has collected its environment (pip, lscpu, ...: seconds): asked with
            # time to spare, and only of a server that answered GET /version (vLLM, SGLang)
            (
                "/server_info?config_format=json",
                lambda b: ec.from_vllm_config(b.get("vllm_config"), None, "GET /server_info"),
                30.0 if self.server_version is not None else None,
            ),
            ("/props", ec.from_llama_props, 3.0),
            ("/v1/models", ec.from_lpf_models, 3.0),
            ("/openapi.json", ec.from_openapi, 3.0),  # llama-cpp-python's server: its documented defaults
        )
        out: dict = {}
        for path, reader, timeout in readers:
            body = self._get_json(path, timeout) if timeout else None
            if isinstance(body, dict):
                for field, said in reader(body).items():
                    out.setdefault(field, said)
        return out

    def _get_json(self, path: str, timeout: float):
        import httpx

        root = self.options.base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            answer = httpx.get(root + path, headers=headers, timeout=timeout)
            return answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def payload(self, req: EngineRequest) -> dict:
        s = self.sampling
        body = {
            "model": self.options.served_model,
            "max_tokens": req.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": req.seed,
            "n": 1,
            "stream": False,
        }
        if self.is_chat(req):
            body["messages"] = [dict(m) for m in req.messages]
            if self.ask_logprobs:
                body["logprobs"], body["top_logprobs"] = True, s.logprobs
        else:
            body["prompt"] = self.prompt_text(req) if self.send_text else list(req.prompt_token_ids)
            if self.ask_logprobs:
                body["logprobs"] = s.logprobs
        # vLLM/SGLang extensions: sent only when they change something (strict servers refuse unknown fields)
        if s.top_k:
            body["top_k"] = s.top_k
        if s.ignore_eos:
            body["ignore_eos"] = True
        if self.ask_for_ids:
            for name in _ID_FIELDS:
                body[name] = True
        if s.prompt_logprobs and self.options.prompt_logprobs == "echo":
            body["echo"] = True
        elif s.prompt_logprobs:
            body["prompt_logprobs"] = s.logprobs
        return body

    def prompt_text(self, req: EngineRequest) -> str:
        """The prompt as text: the workload's, or its ids decoded when they round-trip through text."""
        if req.text is not None:
            return req.text
        text = self.tokenizer.decode(list(req.prompt_token_ids), skip_special_tokens=True)
        if self.tokenizer.encode(text) != list(req.prompt_token_ids):
            raise RequestFailed(
                "this prompt's token ids do not round-trip through text (decode, then encode): "
                "it cannot be sent to a server that takes text only"
            )
        return text

    def tag(self, req, payload, attempt):
        """vLLM and lpf serve adopt X-Request-Id as their request's name; lpf's records keep lpf's id
        whatever is sent, and the attempt's record keeps what was sent."""
        how = self.options.request_id_header
        if how == "none":
            return payload, {}, None
        sent = str(uuid.uuid4()) if how == "uuid" else self.attempt_id(req, attempt)
        return payload, {"X-Request-Id": self.told(req, sent)}, sent

    async def call(self, client, req, deadline, breaker, attempts):
        from lpf.adapters.http import post_json

        for _ in range(MAX_ADAPTATIONS + 1):
            sent = self.payload(req)
            try:
                body = await post_json(
                    client,
                    self.url_for(req),
                    sent,
                    self.options.policy(),
                    deadline,
                    self.stats,
                    breaker,
                    tag=lambda p, a: self.tag(req, p, a),
                    attempts=attempts,
                )
                self.routes[self.endpoint(req).rsplit("/v1", 1)[-1]] += 1
                return body
            except RequestFailed as e:
                self.adapt(str(e), sent)
                if self.payload(req) == sent:  # nothing to route around (or another request already did)
                    if self.prompt_refused(str(e), sent):
                        raise RequestFailed(f"{e}; {PROMPT_HINT}") from None
                    raise
        raise RequestFailed(f"the server kept refusing after {MAX_ADAPTATIONS} adaptations")

    @staticmethod
    def refusal(error: str) -> str | None:
        """What the server said when `error` is a refusal of the request (a 4xx other than 404/429, or a
        validation error under any status: some servers wrap one in a 500), lower-cased; else None."""
        said = error.split(" from ", 1)[-1].split(": ", 1)[-1]
        if re.search(r"\bHTTP 4(?!04|29)\d\d\b", error) or (
            re.search(r"\bHTTP \d{3}\b", error) and is_validation_error(said)
        ):
            return said.lower()
        return None

    def prompt_refused(self, error: str, sent: dict) -> bool:
        """Whether `error` refuses the token-id prompt `sent` carried (names the prompt, or says a
        string was wanted: the prompt is the one list lpf sends where servers may want text)."""
        said = self.refusal(error)
        return (
            said is not None
            and isinstance(sent.get("prompt"), list)
            and (_WANTS_TEXT.search(said) is not None or ("prompt" in said and _OF_TYPE.search(said) is not None))
        )

    def adapt(self, error: str, sent: dict) -> None:
        """Route around a refusal, once for the whole run (requests in flight then retry with the new
        payload): vLLM's id fields, token-id prompts, logprobs. A 404 (no such route or model) is not one."""
        said = self.refusal(error)
        if said is None:
            return
        detail = error.split(": ", 1)[-1][:160]
        if (
            any(f in sent for f in _ID_FIELDS)
            and self.options.token_ids == "auto"
            and any(f in said for f in _ID_FIELDS)
        ):
            self.ask_for_ids = False
        elif self.options.prompt == "auto" and self.prompt_refused(error, sent):
            if not self.send_text:
                self.send_text = True
                self.notes.append(
                    f"the server refused token-id prompts ({detail}): prompts were sent as text from "
                    f"then on, and their tokenization checked against usage"
                )
        elif "logprobs" in sent and self.options.logprobs == "auto" and "logprob" in said:
            if self.ask_logprobs:
                self.ask_logprobs = False
                self.notes.append(
                    f"the server refused logprobs ({detail}): asked without them from then on; the "
                    f"answers are audited from their tokens alone"
                )

    # -- the answer -----------------------------------------------------------------------------------
    def parse(self, req: EngineRequest, body: Any) -> Completion:
        if not isinstance(body, dict):
            raise RequestFailed(f"answer is a JSON {type(body).__name__}, not an object")
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise RequestFailed("answer has no choices")
        choice = choices[0]
        chat = self.is_chat(req)
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        text = message.get("content") if chat else choice.get("text")
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        problems = Problems()
        block = read_logprobs(choice.get("logprobs"))
        echoed = self.sampling.prompt_logprobs and self.options.prompt_logprobs == "echo" and not chat
        prompt, topk_ids, topk_lps, cut = None, [], [], False
        finish = choice.get("finish_reason")
        if not echoed and empty_stop(block, text, finish, usage, self.tokenizer.eos_token_id):
            # an empty `stop` answer is an answer: the server stopped at its first token and withheld that token,
            # its logprob and its count (llama-cpp-python: the stop token never joins completion_tokens, on chat
            # and completions alike). Kept as the end-of-sequence token without a logprob, so the reference judges
            # that choice as it judges any tokens-only token: a server answering empty where the model would not
            # is caught, not dropped as a failed request
            self.returned["empty stop (its end-of-sequence token withheld)"] += 1
            ids, logprobs, claimed = [self.tokenizer.eos_token_id], [None], None
        elif block is None:
            if self.options.logprobs == "require":
                raise RequestFailed("answer has no logprobs (the server ignored logprobs=k)")
            ids = tokens_only(self.map, choice, text, usage, finish, problems, self.tokenizer.eos_token_id, self)
            logprobs: list = [None] * len(ids)
            claimed = None  # counted against usage while the ids were recovered
        else:
            self.returned[block.shape] += 1
            ids = sampled_ids(self.map, block.positions, text, finish, self.tokenizer.eos_token_id)
            self.check_ids(ids)
            # an echoed prompt's first token has no logprob (nothing precedes it): not a problem there
            logprobs = [
                math.nan if echoed and pos == 0 else problems.logprob(None if p.logprob is MISSING else p.logprob, pos)
                for pos, p in enumerate(block.positions)
            ]
            top = None if all(p.top is None for p in block.positions) else [p.top for p in block.positions]
            if block.top_problem:
                problems.add("top_logprobs", block.top_problem)
            if echoed:
                prompt = openai_prompt.echoed(
                    req,
                    ids,
                    logprobs,
                    top,
                    lambda t, n, what: self.top_k(t, n, what, self.top_pairs, problems),
                    problems,
                )
                n = len(req.prompt_token_ids)  # the answer's tokens start with the prompt: the outputs follow it
                ids, logprobs, top = ids[n:], logprobs[n:], top[n:] if isinstance(top, list) else top
            elif self.sampling.prompt_logprobs:
                prompt = openai_prompt.vllm_field(req, choice.get("prompt_logprobs"), self.sampling.logprobs, problems)
            topk_ids, topk_lps = self.top_k(top, len(ids), "top_logprobs", self.top_pairs, problems)
            self.top_k_seen = max([self.top_k_seen] + [len(t) for t in topk_ids])
            claimed = usage.get("completion_tokens")
            if counts_more(claimed, ids) and isinstance(text, str) and not echoed:
                special = set(getattr(self.tokenizer, "all_special_ids", None) or [])
                ids, logprobs, topk_ids, topk_lps, cut = fill_gaps(
                    block.positions, text, claimed, (ids, logprobs, topk_ids, topk_lps), self.map, special, problems
                )
                if cut:  # count and text disagree by what logprobs_missing says; the tokens kept are the server's
                    claimed, text = None, None
        openai_prompt.check(req, body, choice, usage, chat, problems)
        if finish is None:  # no claim to check; what the length says
            finish = "length" if len(ids) >= req.max_tokens else "stop"
        # a cut answer is short of max_tokens by the entries left out, not by its finish
        checked = "stop" if cut and finish == "length" else finish
        self.check_answer(req, ids, claimed, checked, None if echoed else text, problems)
        return Completion(
            request_id=req.request_id,
            output_token_ids=ids,
            logprobs=logprobs,
            topk_ids=topk_ids,
            topk_logprobs=topk_lps,
            finish_reason=str(finish),
            inconsistency=problems.text(),
            prompt_logprobs=prompt[0] if prompt else None,
            prompt_topk_ids=prompt[1] if prompt else [],
            prompt_topk_logprobs=prompt[2] if prompt else [],
        )

    def top_pairs(self, entry: Any, pos: int) -> list[tuple[float, int]]:
        """One position's alternatives (`openai_shapes.Alt`s); those without a usable id are left out."""
        pairs = []
        for alt in entry or ():
            tid = self.map.resolve(alt.token, alt.tid, alt.raw, pos, strict=False)
            if tid is not None and 0 <= tid < self.vocab_size:
                pairs.append((as_logprob(None if alt.logprob is MISSING else alt.logprob, pos), tid))
        return pairs

    def map_string(self, text: str) -> int | None:
        return self.map.by_string(text)
