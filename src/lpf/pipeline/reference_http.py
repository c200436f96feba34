"""A reference that runs behind an OpenAI-compatible server: a trusted deployment, or the audited server itself.

`--reference` says where the reference runs (`reference_form`): a model path or `zoo:`/`tiny:` name is
transformers in this process (`lpf.pipeline.reference`); `http(s)://HOST:PORT/v1` is a trusted deployment
of the same model, asked for the served name `--reference-model`; `self` is the audited server
(`--engine openai`: its `--base-url`, served name and API key variable, from the run's manifest), or the
audited vLLM worker (`--engine vllm`: `lpf.pipeline.reference_vllm_self`);
`vllm:MODEL` is vLLM offline (`lpf.pipeline.reference_vllm`). `check_settings` checks the rescore
settings for every form; `findings_notes` is what the findings say of the reference.

Contract:
- `HttpReference(kind, url, served, model, topk, concurrency, api_key_env)` scores `ScoreItem`s as the
  transformers `Rescorer` does, through the same two calls: `score_all(items, tick)` yields `Scored`
  batches (output positions in `reference`, the prompt positions 1..P-1 of items that ask in
  `prompt_reference`; no seeded replay), `score(items, tick)` the `reference` tables alone (attribution);
  `describe()` is the manifest's `reference` block; `max_context` is None (the server refuses what is
  too long: that request's error).
- One `/v1/completions` request per item, sent by the `openai` adapter (`OpenAIEngine`: concurrency limit,
  retries, timeouts, answer checks): prompt = the item's prompt + output token ids, `max_tokens` 1,
  temperature 0, top-k `topk`, and prompt logprobs asked as vLLM's `prompt_logprobs: topk` (`field`) or
  OpenAI's `echo` + `logprobs` (`echo`). `auto` (the default) asks the first item with `field`, then
  `echo`, and keeps the first that answers with prompt logprobs for the whole run; neither, or a server
  that cannot be reached: `LpfError` in one line. The answer is read by `lpf.adapters.openai_prompt` (the adapter's own reading).
- The answers become `reference/` rows as `lpf.pipeline.reference_prompt` says (shared with vLLM's
  in-process reference): the server's own rank where the answer gives one (vLLM's `prompt_logprobs`
  entries, read into `Completion.prompt_ranks`), entropy and log-sum-exp null; a request the reference
  cannot score is left unscored and named once the rest are yielded.
- A self-reference re-scores the engine's tokens with the engine itself: it sees a decode path that
  disagrees with the engine's own prefill (stale state, a broken cache, a bad kernel on one path), never
  a wrong model. `describe()` says so: `run_test` "not applicable", `limitation` (`reference_prompt.LIMITATION`) and
  `second_pass` (`SECOND_PASS`: what makes its pass another code path, and what both passes share).
"""

from __future__ import annotations

from typing import Any, Iterator

from lpf.core.errors import LpfError
from lpf.pipeline.reference_prompt import LIMITATION, PromptReference

KINDS = ("transformers", "http", "self", "vllm")
HOW = ("auto", "field", "echo")
# what makes a self-reference's pass a second code path, and what it shares with the first
SECOND_PASS = (
    "one prefill of prompt + output per request (max_tokens 1: no decode step, no speculation), one at a time; "
    "vLLM and lpf serve never read their prefix cache for it (prompt logprobs asked); a fault in the engine's "
    "own prefill is in both passes"
)
SELF_CONCURRENCY = 1  # one request at a time: the re-score must not batch beside the engine's other work
HTTP_CONCURRENCY = 8


def reference_form(spec: str | None) -> str:
    """Which kind of reference `--reference` names: transformers (a model, or None: the engine's), http,
    self, vllm (`vllm:MODEL`: `lpf.pipeline.reference_vllm`)."""
    if spec == "self":
        return "self"
    if spec is not None and spec.lower().startswith(("http://", "https://")):
        return "http"
    if spec is not None and spec.startswith("vllm:"):
        return "vllm"
    return "transformers"


def check_settings(
    spec: str | None, served: str | None, concurrency: int | None, executor: str, options: tuple = ()
) -> None:
    """What the rescore settings must satisfy for the reference's form (one-line `LpfError`s); `options`:
    the `-R KEY=VALUE` reference knobs (a vLLM reference's)."""
    form = reference_form(spec)
    if options and form != "vllm":
        raise LpfError("-R/--reference-option goes with --reference vllm:MODEL")
    if form in ("transformers", "vllm"):
        for flag, value in (("--reference-model", served), ("--reference-concurrency", concurrency)):
            if value is not None:
                goes = "vllm:MODEL" if form == "vllm" else "a transformers model"
                raise LpfError(f"{flag} goes with --reference http(s)://... or self, not {goes}")
        if form == "vllm":
            from lpf.pipeline.reference_vllm import parse_spec, reference_options

            parse_spec(spec)
            reference_options(options)
            if executor != "local":
                raise LpfError(f"--reference {spec} is scored by vLLM in one worker: drop --executor {executor}")
        return
    if executor != "local":
        raise LpfError(f"--reference {spec} is scored by its server: drop --executor {executor}")
    if concurrency is not None and concurrency < 1:
        raise LpfError(f"--reference-concurrency must be >= 1, got {concurrency}")
    if form == "http":
        from lpf.adapters.remote import RemoteOptions

        if not served:
            raise LpfError(f"--reference {spec} needs --reference-model NAME (the name that server serves)")
        try:
            RemoteOptions(base_url=spec)
        except LpfError as e:
            raise LpfError(str(e).replace("--base-url", "--reference")) from None
    elif served:
        raise LpfError("--reference self asks the audited server for its own served model: drop --reference-model")


def for_run(manifest: dict, spec: str, served: str | None, concurrency: int | None, topk: int) -> "HttpReference":
    """The http or self reference of a run (`spec` as given to --reference), its tokenizer the run's model's."""
    from lpf.core.model_specs import resolve_model

    model = resolve_model(manifest["model"]["spec"])
    if reference_form(spec) == "self":
        from lpf.pipeline.reference_vllm_self import VLLMSelfReference, check_engine

        engine = manifest.get("engine") or {}
        opts = engine.get("options") or {}
        check_engine(engine)
        if engine.get("name") == "vllm":  # no server: the engine's own worker re-scores
            return VLLMSelfReference(manifest, model, topk, concurrency or SELF_CONCURRENCY)
        return HttpReference(
            "self",
            opts["base_url"],
            opts.get("served_model") or manifest["model"]["spec"],
            model,
            topk,
            concurrency or SELF_CONCURRENCY,
            opts.get("api_key_env") or "",
        )
    return HttpReference("http", spec, served, model, topk, concurrency or HTTP_CONCURRENCY)


def from_manifest(manifest: dict, topk: int) -> "HttpReference":
    """The reference a run was scored with (its manifest's block), for more scores of the same kind."""
    ref = manifest["reference"]
    r = for_run(manifest, ref["spec"], ref.get("served_model"), ref.get("concurrency"), topk)
    if isinstance(r, HttpReference):
        r.how = ref.get("prompt_logprobs") or "auto"
    return r


class HttpReference(PromptReference):
    """The reference behind a server (module docstring)."""

    def __init__(
        self,
        kind: str,
        url: str,
        served: str,
        model,
        topk: int,
        concurrency: int,
        api_key_env: str = "",
        how: str = "auto",
    ):
        super().__init__()
        self.kind, self.url, self.served, self.model = kind, url, served, model
        self.topk, self.concurrency, self.api_key_env, self.how = max(topk, 1), concurrency, api_key_env, how
        self.where = f"the reference at {url}"
        self.max_context = None
        self.version: str | None = None

    def describe(self) -> dict:
        d = {
            "kind": self.kind,
            "spec": "self" if self.kind == "self" else self.url,
            "url": self.url,
            "served_model": self.served,
            "prompt_logprobs": self.how,
            "concurrency": self.concurrency,
            "top_k": self.topk,
            "dtype": None,  # the server's own, not stated: its floor takes the engine's (`floors.server_pair`)
            "implementation": f"server {self.version}" if self.version else "server",
            "rank": "the server's where given, else the place in the top-k, else top-k + 1 (a lower bound)",
            "cost": dict(self.cost),
        }
        if self.kind == "self":
            d.update(run_test="not applicable", limitation=LIMITATION, second_pass=SECOND_PASS)
        return d

    # -- sending ----------------------------------------------------------------------------------------
    def _engine(self, how: str):
        from lpf.core.sampling import SamplingParams

        sampling = SamplingParams(temperature=0.0, max_tokens=1, logprobs=self.topk, prompt_logprobs=True)
        options = {
            "base_url": self.url,
            "served_model": self.served,
            "prompt_logprobs": how,
            "api": "completions",
            "prompt": "ids",
            "logprobs": "require",
            "concurrency": self.concurrency,
        }
        if self.api_key_env:
            options["api_key_env"] = self.api_key_env
        engine_class = _scoring_engine()
        engine = engine_class(self.model, sampling, engine_class.Options.parse(options))
        self.version = engine.server_version
        return engine

    @staticmethod
    def _request(it, seq: int):
        from lpf.core.workload import EngineRequest

        ids = tuple(it.prompt_token_ids) + tuple(it.output_token_ids)
        return EngineRequest(it.request_id, seq, it.request_id, 0, ids, max_tokens=1, seed=0)

    def _probe(self, item) -> tuple[Any, Any]:
        """(engine, first answer) with the first prompt-logprob route that answers (`auto`), or the one asked."""
        tried = []
        for how in ("field", "echo") if self.how == "auto" else (self.how,):
            engine = self._engine(how)
            (c,) = list(engine.generate([self._request(item, 0)]))
            if c.error is None and c.prompt_logprobs is not None:
                self.how = how
                return engine, c
            if c.error is not None and c.attempts and not any(a["sent"] for a in c.attempts):
                raise LpfError(f"the reference at {self.url} cannot be reached: {c.error}")
            tried.append(f"{how}: {c.error or c.inconsistency or 'no prompt logprobs'}")
        raise LpfError(f"the reference at {self.url} gives no prompt logprobs ({'; '.join(tried)})")

    def _answers(self, items: list) -> Iterator[tuple[Any, Any]]:
        """(item, completion) per item, the first through the probe."""
        engine, first = self._probe(items[0])
        yield items[0], first
        by_id = {it.request_id: it for it in items[1:]}
        for c in engine.generate([self._request(it, i) for i, it in enumerate(items[1:], 1)]):
            yield by_id[c.request_id], c


def _field_ranks(req, body: Any) -> list | None:
    """vLLM's own rank of each prompt token (index i: position i + 1) from `prompt_logprobs`, None where absent."""
    try:
        field = body["choices"][0].get("prompt_logprobs")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    prompt = list(req.prompt_token_ids)
    if not isinstance(field, list) or len(field) != len(prompt):
        return None
    out = []
    for tok, entry in zip(prompt[1:], field[1:]):
        got = entry.get(str(tok)) if isinstance(entry, dict) else None
        rank = got.get("rank") if isinstance(got, dict) else None
        out.append(rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1 else None)
    return out


_ENGINE = None


def _scoring_engine():
    """The `openai` adapter, reading each answer's vLLM ranks into the completion it parses."""
    global _ENGINE
    if _ENGINE is None:
        from lpf.adapters.openai import OpenAIEngine

        class ScoringEngine(OpenAIEngine):
            def parse(self, req, body):
                c = super().parse(req, body)
                c.prompt_ranks = _field_ranks(req, body)
                return c

        _ENGINE = ScoringEngine
    return _ENGINE


def findings_notes(reference: dict | None, findings: dict) -> dict:
    """What findings.json says of the reference beyond its name: its kind (`reference_kind`, absent for the
    default transformers reference), a server reference's cost (`reference_cost`: requests, tokens sent
    (prompts included), seconds), and for a self-reference the one line of what it cannot see and the
    run-level test as not applicable (it is never `same`: the engine compared with itself agrees whatever
    model it runs), with what its second pass shares with the first (`reference_second_pass`)."""
    ref = reference or {}
    kind = ref.get("kind") or "transformers"
    # a transformers reference is the default every run had before: its findings stay as they were
    notes: dict = {} if kind == "transformers" else {"reference_kind": kind}
    if kind != "transformers" and ref.get("cost"):  # a server's second pass is work it did: stated
        notes["reference_cost"] = dict(ref["cost"])
    if ref.get("limitation"):
        notes["reference_limitation"] = ref["limitation"]
    if ref.get("second_pass"):
        notes["reference_second_pass"] = ref["second_pass"]
    if ref.get("run_test") == "not applicable":
        notes["run_test"] = {
            "result": "not applicable",
            "test": None,
            "sentence": f"not applicable: {ref.get('limitation') or LIMITATION}",
        }
    return notes
