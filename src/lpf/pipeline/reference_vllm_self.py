"""`--reference self` on the in-process `vllm` engine: the audited vLLM re-scores its own outputs.

A self-reference through a server (`--engine openai`) asks that server (`lpf.pipeline.reference_http`); an
engine lpf runs in its own worker (`--engine vllm`) has no server to ask, so the worker is asked instead:
each request's prompt + output goes back as a prompt with `SamplingParams(prompt_logprobs=k, max_tokens=1,
temperature=0, skip_reading_prefix_cache=True)` (the worker's per-request `sampling`), and the answers become
the run's `reference/` rows the way every prompt-logprob reference's do (`lpf.pipeline.reference_prompt`:
vLLM's own rank; entropy and log-sum-exp null).

Contract:
- `held(reference)`: inside the block (an audit: its run, rescore and analysis), with `reference == "self"`,
  the run's `vllm` engine is not stopped when the run ends (`hold(engine)`, called by the run stage instead
  of `close`): the self-reference re-scores in that same process (its weights, its state pools, its drills),
  and one engine answers the rescore and the attribution; it stops on exit. Outside it, or when the run
  ended earlier (`lpf rescore RUN --reference self`), the reference starts the engine anew from the run's
  manifest: the same knobs and drills (`inject`), its trace kept private (a `trace_dir` is the run's).
- `VLLMSelfReference(manifest, model, topk, concurrency)`: a `PromptReference`; `concurrency` requests per
  batch sent to the engine (1, the default: one at a time, so no neighbour shares a step with a re-score;
  more: a batch shape of the user's choosing). `describe()` is the manifest's `reference` block: kind
  "self", what scored it (`engine`: the audited process or a new start of its configuration), the
  engine arguments, the run-level test "not applicable" with the one-line `LIMITATION`, and `second_pass`
  (`SECOND_PASS`): what makes the pass another code path and what both passes share.
- A failed engine is never reused; an engine that fails mid-way leaves the rest unscored (named once).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

from lpf.core.errors import LpfError
from lpf.pipeline.reference_prompt import LIMITATION, PromptReference, sent_back

# what makes the re-score another code path in vLLM, and what it cannot be trusted to differ in
SECOND_PASS = (
    "one prefill of prompt + output per request in vLLM (SamplingParams(prompt_logprobs=k, max_tokens=1, "
    "skip_reading_prefix_cache=True)): no decode step, no cached prefix read, no draft verified (vLLM 0.32 has "
    "no per-request switch for speculation; with max_tokens 1 no draft of the re-score is ever verified), "
    "{batch}; it shares the weights, the dtype, the kernels and the engine's prefill path (chunked "
    "when the run's step budget splits prompt + output) and its drills: a fault in the weights, the model "
    "served or the engine's own prefill is in both passes"
)
_HELD: dict | None = None  # "engine" -> the run's live engine, while held() is active


@contextmanager
def held(reference: str | None):
    """Keep the run's vLLM engine up for the self-reference (module docstring)."""
    global _HELD
    if _HELD is not None or reference != "self":
        yield
        return
    _HELD = {}
    try:
        yield
    finally:
        live, _HELD = _HELD, None
        engine = live.get("engine")
        if engine is not None:
            engine.close(kill=bool(getattr(engine, "_failed", False)))


def hold(engine) -> bool:
    """Keep a run's finished engine for its self-reference inside `held()` (True: kept, the caller does not
    close it): a `vllm` engine that did not fail and writes its trace nowhere the run reads again."""
    if _HELD is None or getattr(engine, "name", None) != "vllm" or getattr(engine, "_failed", False):
        return False
    if getattr(engine, "proc", None) is None or engine.proc.poll() is not None or engine.options.trace_dir:
        return False
    old = _HELD.pop("engine", None)
    if old is not None:
        old.close()
    _HELD["engine"] = engine
    return True


class VLLMSelfReference(PromptReference):
    """The run's vLLM engine re-scoring its own outputs (module docstring)."""

    def __init__(self, manifest: dict, model, topk: int, concurrency: int):
        super().__init__()
        from lpf.adapters.vllm_options import VLLMOptions

        engine = manifest.get("engine") or {}
        self.manifest_engine = engine
        self.model, self.topk, self.concurrency = model, max(topk, 1), concurrency
        self.where = "the audited vLLM engine (self)"
        self.max_context = None
        # a new start runs the run's configuration, drills included; its trace stays private
        self.options = VLLMOptions.parse({**(engine.get("options") or {}), "trace_dir": None, "capture": None})
        self.cost["start_seconds"] = 0.0
        self.scored_by: str | None = None
        self.engine_args = engine.get("engine_args")
        self.version = engine.get("version")
        self._engine_now = None

    def describe(self) -> dict:
        batch = (
            "one request at a time"
            if self.concurrency == 1
            else f"{self.concurrency} requests per batch (--reference-concurrency)"
        )
        return {
            "kind": "self",
            "spec": "self",
            "engine": "vllm",
            "scored_by": self.scored_by,
            "concurrency": self.concurrency,
            "top_k": self.topk,
            "dtype": None,  # the engine's own: its floor is the engine against itself (`floors.server_pair`)
            "implementation": f"vLLM {self.version}" if self.version else "vLLM",
            "engine_args": self.engine_args,
            "prompt_logprobs": "SamplingParams(prompt_logprobs=k, max_tokens=1, skip_reading_prefix_cache=True)",
            "rank": "vLLM's own",
            "cost": dict(self.cost),
            "run_test": "not applicable",
            "limitation": LIMITATION,
            "second_pass": SECOND_PASS.format(batch=batch),
        }

    def _engine(self):
        """The run's held engine, else a new start of its configuration (kept inside `held()`)."""
        from lpf.adapters.vllm import VLLMEngine
        from lpf.core.sampling import SamplingParams

        live = (_HELD or {}).get("engine")
        if live is not None and not getattr(live, "_failed", False) and live.proc.poll() is None:
            if self.scored_by is None:
                self.scored_by = "the audited engine's own process (kept up after the run)"
            return live
        sampling = SamplingParams(temperature=0.0, max_tokens=1, logprobs=self.topk, prompt_logprobs=True)
        t0 = time.monotonic()
        engine = VLLMEngine(self.model, sampling, self.options)
        self.cost["start_seconds"] = round(self.cost["start_seconds"] + time.monotonic() - t0, 3)
        self.scored_by = "a new start of the audited engine's configuration (the run's knobs and drills)"
        self.engine_args, self.version = engine.engine_args, engine.ready.get("vllm_version")
        if _HELD is not None:
            _HELD["engine"] = engine
        return engine

    def _answers(self, items: list) -> Iterator[tuple[Any, Any]]:
        engine = self._engine()
        own = _HELD is not None and _HELD.get("engine") is engine
        # every request's settings for the re-score, over the run's (the worker's per-request `sampling`)
        engine.request_sampling = {
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
            "ignore_eos": False,
            "logprobs": self.topk,
            "prompt_logprobs": True,
            "skip_reading_prefix_cache": True,
        }
        try:
            yield from sent_back(engine, items, self.concurrency)
        finally:
            engine.request_sampling = None
            if not own:  # outside held(): this call's own engine
                engine.close(kill=bool(getattr(engine, "_failed", False)))


def check_engine(engine: dict) -> None:
    """A self-reference needs an engine that can re-score: a server's (`--engine openai`) or vLLM in-process."""
    if engine.get("name") == "vllm":
        return
    opts = engine.get("options") or {}
    if engine.get("name") != "openai" or not opts.get("base_url"):
        raise LpfError(
            f"--reference self re-scores with the audited engine itself: it needs --engine openai (its server) "
            f"or --engine vllm (this run's engine is {engine.get('name')}); pass a model or an http(s):// reference"
        )
