"""A reference that runs behind an OpenAI-compatible server: a trusted deployment, or the audited server itself.

`--reference` says where the reference runs (`reference_form`): a model path or `zoo:`/`tiny:` name is
transformers in this process (`lpf.pipeline.reference`); `http(s)://HOST:PORT/v1` is a trusted deployment
of the same model, asked for the served name `--reference-model`; `self` is the audited server
(`--engine openai`: its `--base-url`, served name and API key variable, from the run's manifest).

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
- Rows (schema.REFERENCE): output position j (the row's `position`) of an item with P prompt tokens is
  the answer's prompt position P + j: `ref_logprob` of the engine's token; `ref_top1_*` and `ref_topk_*` from the returned
  top-k; `ref_rank` the server's own rank where the answer gives one (vLLM's `prompt_logprobs` entries),
  else the token's place in the top-k, else len(top-k) + 1 (a lower bound: it is outside the top-k);
  `ref_entropy` and `ref_logsumexp` null (a top-k does not give them).
- A request the reference cannot score (no answer, no prompt logprobs, a position without a finite
  logprob or without top-k, a server that saw other prompt tokens) is left unscored; once the rest are
  yielded, `LpfError` names how many and the first reason (`lpf rescore` scores what is left).
- A self-reference re-scores the engine's tokens with the engine itself: it sees a decode path that
  disagrees with the engine's own prefill (stale state, a broken cache, a bad kernel on one path), never
  a wrong model. `describe()` says so: `run_test` "not applicable" and `limitation` (`LIMITATION`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa

from lpf.core.errors import LpfError
from lpf.run import schema

KINDS = ("transformers", "http", "self")
HOW = ("auto", "field", "echo")
LIMITATION = "a self-reference cannot tell a wrong model: add a transformers or trusted reference"
SELF_CONCURRENCY = 1  # one request at a time: the re-score must not batch beside the engine's other work
HTTP_CONCURRENCY = 8
BATCH_REQUESTS = 32  # requests per yielded batch (one reference part each): a crash loses at most these


def reference_form(spec: str | None) -> str:
    """Which kind of reference `--reference` names: transformers (a model, or None: the engine's), http, self."""
    if spec == "self":
        return "self"
    if spec is not None and spec.lower().startswith(("http://", "https://")):
        return "http"
    return "transformers"


def check_settings(spec: str | None, served: str | None, concurrency: int | None, executor: str) -> None:
    """What the rescore settings must satisfy for the reference's form (one-line `LpfError`s)."""
    form = reference_form(spec)
    if form == "transformers":
        for flag, value in (("--reference-model", served), ("--reference-concurrency", concurrency)):
            if value is not None:
                raise LpfError(f"{flag} goes with --reference http(s)://... or self, not a transformers model")
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
        engine = manifest.get("engine") or {}
        opts = engine.get("options") or {}
        if engine.get("name") != "openai" or not opts.get("base_url"):
            raise LpfError(
                f"--reference self re-scores through the audited server's OpenAI API: it needs --engine openai "
                f"(this run's engine is {engine.get('name')}); pass a model or an http(s):// reference"
            )
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
    r.how = ref.get("prompt_logprobs") or "auto"
    return r


class HttpReference:
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
        self.kind, self.url, self.served, self.model = kind, url, served, model
        self.topk, self.concurrency, self.api_key_env, self.how = max(topk, 1), concurrency, api_key_env, how
        self.max_context = None
        self.version: str | None = None
        self.cost = {"requests": 0, "tokens": 0, "seconds": 0.0}

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
            d.update(run_test="not applicable", limitation=LIMITATION)
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

    def _answers(self, items: list) -> Iterator[tuple[Any, Any, Any]]:
        """(item, completion, engine) per item, the first through the probe."""
        engine, first = self._probe(items[0])
        yield items[0], first, engine
        by_id = {it.request_id: it for it in items[1:]}
        for c in engine.generate([self._request(it, i) for i, it in enumerate(items[1:], 1)]):
            yield by_id[c.request_id], c, engine

    # -- scoring ----------------------------------------------------------------------------------------
    def score_all(self, items: list, on_tokens: Callable[[int], None] | None = None) -> Iterable:
        from lpf.pipeline.reference import Scored

        if not items:
            return
        failed: list[tuple[str, str]] = []
        out, prompt = _Rows(), _Rows()
        n_done, t0 = 0, time.monotonic()
        for it, c, engine in self._answers(items):
            p, o = len(it.prompt_token_ids), len(it.output_token_ids)
            try:
                lps, ids, tlps, ranks = _read(c, engine.ranks.pop(c.request_id, None), p + o)
                out.add(it.request_id, range(o), it.output_token_ids, lps, ids, tlps, ranks, self.topk, p - 1)
                if it.score_prompt:
                    prompt.add(it.request_id, range(1, p), it.prompt_token_ids[1:], lps, ids, tlps, ranks, self.topk, 0)
            except _Unscored as e:
                failed.append((it.request_id, str(e)))
                out.drop(it.request_id)
                prompt.drop(it.request_id)
            self.cost["requests"] += 1
            self.cost["tokens"] += p + o
            self.cost["seconds"] = round(time.monotonic() - t0, 3)
            n_done += 1
            if on_tokens is not None:
                on_tokens(o)
            if n_done % BATCH_REQUESTS == 0 and out.n:
                yield Scored(out.table(), prompt.table() if prompt.n else None)
                out, prompt = _Rows(), _Rows()
        if out.n:
            yield Scored(out.table(), prompt.table() if prompt.n else None)
        if failed:
            rid, why = failed[0]
            raise LpfError(
                f"the reference at {self.url} could not score {len(failed)} of {len(items)} requests "
                f"(first: {rid}: {why}); the others are scored, `lpf rescore RUN` tries the rest again"
            )

    def score(self, items: list, on_tokens: Callable[[int], None] | None = None) -> Iterable[pa.Table]:
        for scored in self.score_all(items, on_tokens):
            yield scored.reference


class _Unscored(Exception):
    """Why one request's answer cannot be the reference's scores."""


def _read(c, ranks: list | None, n: int) -> tuple[list, list, list, list | None]:
    """The answer's prompt logprobs, top-k ids and logprobs, and ranks (index i: position i + 1), checked."""
    if c.error is not None:
        raise _Unscored(c.error)
    if c.inconsistency and "prompt_tokens:" in c.inconsistency:
        raise _Unscored(c.inconsistency)
    if c.prompt_logprobs is None or len(c.prompt_logprobs) != n - 1:
        raise _Unscored(c.inconsistency or "the answer has no prompt logprobs for every position")
    if len(c.prompt_topk_ids) != n - 1:
        raise _Unscored("the answer has no top-k for every prompt position")
    return c.prompt_logprobs, c.prompt_topk_ids, c.prompt_topk_logprobs, ranks


class _Rows:
    """Reference rows gathered request by request, as one schema.REFERENCE table."""

    def __init__(self):
        self.cols: dict[str, list] = {name: [] for name in schema.REFERENCE.names}
        self.n = 0

    def add(self, rid, positions, targets, lps, ids, tlps, ranks, k, at) -> None:
        """Rows at `positions` (target tokens `targets`) from answer index `at` on (index i: the answer's
        prompt position i + 1)."""
        rows = []
        for j, (pos, tok) in enumerate(zip(positions, targets)):
            i = at + j
            lp, top_ids, top_lps = lps[i], list(ids[i])[:k], list(tlps[i])[:k]
            if not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-6:
                raise _Unscored(f"the logprob of position {pos} is {lp!r}")
            if not top_ids:
                raise _Unscored(f"no top-k at position {pos}")
            rank = (
                ranks[i] if ranks is not None and ranks[i] is not None else _rank(tok, min(lp, 0.0), top_ids, top_lps)
            )
            rows.append((rid, pos, min(lp, 0.0), rank, top_ids[0], top_lps[0], top_ids, top_lps))
        for rid_, pos, lp, rank, t1, l1, top_ids, top_lps in rows:
            c = self.cols
            c["request_id"].append(rid_)
            c["position"].append(pos)
            c["ref_logprob"].append(lp)
            c["ref_rank"].append(rank)
            c["ref_entropy"].append(None)
            c["ref_top1_id"].append(t1)
            c["ref_top1_logprob"].append(l1)
            c["ref_topk_ids"].append(top_ids)
            c["ref_topk_logprobs"].append(top_lps)
            c["ref_logsumexp"].append(None)
        self.n += len(rows)

    def drop(self, rid: str) -> None:
        keep = [i for i, r in enumerate(self.cols["request_id"]) if r != rid]
        if len(keep) != self.n:
            self.cols = {name: [v[i] for i in keep] for name, v in self.cols.items()}
            self.n = len(keep)

    def table(self) -> pa.Table:
        return pa.table(self.cols, schema=schema.REFERENCE)


def _rank(tok: int, lp: float, top_ids: list, top_lps: list) -> int:
    """1 + the alternatives above the token where it is in the top-k; else len(top-k) + 1 (a lower bound)."""
    if tok in top_ids:
        return 1 + sum(1 for v in top_lps if v > lp)
    return len(top_ids) + 1


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
    """The `openai` adapter, keeping each answer's vLLM ranks beside the completion it parses."""
    global _ENGINE
    if _ENGINE is None:
        from lpf.adapters.openai import OpenAIEngine

        class ScoringEngine(OpenAIEngine):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.ranks: dict[str, list | None] = {}

            def parse(self, req, body):
                c = super().parse(req, body)
                self.ranks[req.request_id] = _field_ranks(req, body)
                return c

        _ENGINE = ScoringEngine
    return _ENGINE


def findings_notes(reference: dict | None, findings: dict) -> dict:
    """What findings.json says of the reference beyond its name: its kind (`reference_kind`, absent for the
    default transformers reference), a server reference's cost (`reference_cost`: requests, tokens sent
    (prompts included), seconds), and for a self-reference the one line of what it cannot see and the
    run-level test as not applicable (it is never `same`: the engine compared with itself agrees whatever
    model it runs)."""
    ref = reference or {}
    kind = ref.get("kind") or "transformers"
    # a transformers reference is the default every run had before: its findings stay as they were
    notes: dict = {} if kind == "transformers" else {"reference_kind": kind}
    if kind != "transformers" and ref.get("cost"):  # a server's second pass is work it did: stated
        notes["reference_cost"] = dict(ref["cost"])
    if ref.get("limitation"):
        notes["reference_limitation"] = ref["limitation"]
    if ref.get("run_test") == "not applicable":
        notes["run_test"] = {
            "result": "not applicable",
            "test": None,
            "sentence": f"not applicable: {ref.get('limitation') or LIMITATION}",
        }
    return notes
