"""`builtin` engine: lpf's own continuous-batching hybrid engine (`lpf.builtin`), with fault drills.

Knobs keep vLLM's names (max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, block_size,
enable_prefix_caching, mamba_block_size, mamba_cache_mode) plus `cache_mb` (the gpu_memory_utilization analogue) and `inject` (comma-separated drills). Besides
completions it hands the pipeline two side tables: the per-step `trace` and the fault ground truth.

A request with `abort_after_tokens` is a client that cancels it once the engine has scheduled it
past that many prompt tokens (the cancel lands while that step is in flight) and then resends it:
the first attempt runs as `ID~attempt0` (its trace rows keep that id), the resend as `ID`, and both
are kept in the completion's `attempts` (the cancelled one with its error).

An exception raised by the engine mid-run (an engine bug, a drill's rule that stalls the scheduler)
fails every request of the batch it has not answered, as a crashed vLLM engine fails its batch:
"built-in engine failed mid-run: TYPE: message; raised at FILE:LINE in FUNC" (the form lpf
shrink reads as a crash signature); answers already given are kept, and the engine, whose state is
no longer trustworthy, fails every later request with the same error.
"""

from __future__ import annotations

from typing import Iterator

from pydantic import field_validator, model_validator

import lpf
from lpf.adapters.base import Completion, Engine, Options
from lpf.builtin.config import EngineConfig
from lpf.builtin.faults import DRILLS
from lpf.core.errors import raised_at
from lpf.core.knobs import knob
from lpf.core.workload import EngineRequest


class BuiltinOptions(Options, EngineConfig):
    """The engine's own config (validated on parse, before a run starts) plus what the adapter adds."""

    inject: str = knob(
        "",
        help="Fault drill (repeatable): built-in engine " + ", ".join(DRILLS) + "; vllm engine "
        "stale-state, offset-wrap[:BITS] (through lpf-vllm-trace).",
        flag=True,
        repeatable=True,
        metavar="FAULT[:ARG]",
    )  # comma-separated in the options: "stale-state,offset-wrap:18"
    threads: int = knob(1, ge=0, help="torch intra-op threads while generating (0: leave torch's).")

    @field_validator("inject")
    @classmethod
    def _known_drills(cls, value: str) -> str:
        from lpf.builtin.faults import FaultSet

        FaultSet.parse(value)  # an unknown drill is refused before anything is written (LpfError)
        return value

    @model_validator(mode="after")
    def _drills_fit_the_cache(self) -> "BuiltinOptions":
        """A drill needs the engine configured the way its bug needed (one line each)."""
        from lpf.builtin.faults import FaultSet

        need = FaultSet.parse(self.inject).refusals(self)  # each drill's preconditions: `drill_catalog`
        if need:
            raise ValueError("; ".join(need))
        return self


class BuiltinEngine(Engine):
    name = "builtin"
    Options = BuiltinOptions
    supports_prompt_logprobs = True
    trace_source = "own"
    state_slots = True
    locate_replay = "lpf.locate.replays:builtin"
    seeded_replay = True  # lpf.builtin.sampler: a seeded multinomial lpf redraws exactly
    discovers_architectures = True
    repro_script = True
    kept_worker = True

    def __init__(self, model, sampling, options: BuiltinOptions):
        super().__init__(model, sampling, options)
        from lpf.builtin.llm_engine import LLMEngine
        from lpf.core.model_specs import load_tokenizer

        self.engine = LLMEngine.from_options(model.path, options)
        self.eos_id = load_tokenizer(model).eos_token_id
        self.failure: str | None = None  # why the engine failed mid-run: it takes no more requests

    @classmethod
    def check_model(cls, config: dict) -> None:
        from lpf.builtin.config import SUPPORTED_ARCHITECTURES
        from lpf.core.errors import LpfError

        arch = (config.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise LpfError(
                f"the built-in engine runs GraniteMoeHybrid, Jamba, Qwen3.5 and Kimi Linear (KDA) models; {arch} is not supported "
                "(use --engine hf)"
            )

    @classmethod
    def check_capacity(cls, model, options: BuiltinOptions, requests: list[EngineRequest]) -> None:
        """The cache these knobs buy (layer shapes only, no weights) must hold at least one request."""
        from lpf.builtin.llm_engine import cache_sizes, max_context
        from lpf.builtin.models import model_shape
        from lpf.builtin.scheduler import never_runs_reason
        from lpf.core.errors import LpfError

        if not requests:
            return
        config = EngineConfig.of(options)
        shape = model_shape(model.path)
        _, num_blocks = cache_sizes(shape, config)
        context = max_context(getattr(shape.config, "max_position_embeddings", None), config)

        def why(r: EngineRequest) -> str | None:
            return never_runs_reason(
                len(r.prompt_token_ids) + r.max_tokens, num_blocks, config, len(r.prompt_token_ids), context
            )

        smallest = min(requests, key=lambda r: len(r.prompt_token_ids) + r.max_tokens)
        reason = why(smallest)
        if reason is not None and all(why(r) is not None for r in requests):
            raise LpfError(
                f"these engine knobs can hold no request of the workload: even the smallest "
                f"({smallest.request_id}) {reason}"
            )

    def describe(self) -> dict:
        return {
            "name": self.name,
            "version": lpf.__version__,
            "options": self.options.to_dict(),
            "cache": self.engine.describe(),
        }

    def configuration(self) -> dict:
        from lpf.adapters import engine_config

        said = engine_config.builtin(self.options.dtype, kv_cache_dtype=self.options.kv_quantized)
        return engine_config.read(said, "the built-in engine's EngineConfig")

    def generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        import torch

        before = torch.get_num_threads()
        if self.options.threads > 0:
            torch.set_num_threads(self.options.threads)
        try:
            if self.failure is not None:
                for r in requests:
                    yield Completion.failed(r.request_id, self.failure)
                return
            answered: set[str] = set()
            try:
                for c in self._generate(requests):
                    answered.add(c.request_id)
                    yield c
            except Exception as e:  # noqa: BLE001 - the audited engine crashed: its requests say how
                self.failure = f"built-in engine failed mid-run: {type(e).__name__}: {e}{raised_at(e)}"
                for r in requests:
                    if r.request_id not in answered:
                        yield Completion.failed(r.request_id, self.failure)
        finally:
            torch.set_num_threads(before)  # the rescorer that may follow in this process wants them all

    def _generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        from lpf.builtin.request import Request

        cancelled: dict[str, EngineRequest] = {}  # first attempt's id -> the request it is an attempt of
        attempts: dict[str, list[dict]] = {}

        def submit(r: EngineRequest, rid: str) -> Completion | None:
            req = Request(rid, list(r.prompt_token_ids), self.sampling, r.max_tokens, r.seed, self.eos_id, seq=r.seq)
            rejected = self.engine.add_request(req)
            return (
                None if rejected is None else self._completion(rejected, r.request_id, attempts.pop(r.request_id, []))
            )

        for r in requests:
            rid = r.request_id
            if r.abort_after_tokens is not None:
                rid = f"{r.request_id}~attempt0"
                cancelled[rid] = r
                self.engine.cancel_after(rid, r.abort_after_tokens)
            rejected = submit(r, rid)
            if rejected is not None:
                cancelled.pop(rid, None)
                yield rejected
        while self.engine.has_unfinished():
            for req in self.engine.step():
                r = cancelled.pop(req.request_id, None)
                if r is not None and req.error is not None:  # the client gave up: it resends at once
                    attempts[r.request_id] = [_attempt(0, req, req.error)]
                    rejected = submit(r, r.request_id)
                    if rejected is not None:
                        yield rejected
                    continue
                rid = r.request_id if r is not None else req.request_id
                yield self._completion(req, rid, attempts.pop(rid, []))

    def side_tables(self) -> dict:
        return {"trace": self.engine.drain_trace(), "faults": self.engine.truth.drain()}

    @staticmethod
    def _completion(req, request_id: str | None = None, attempts: list[dict] = ()) -> Completion:
        prompt = req.prompt_rows() if req.error is None else None
        attempts = [*attempts, _attempt(len(attempts), req, req.error)] if attempts else []
        return Completion(
            request_id=request_id or req.request_id,
            output_token_ids=req.output_token_ids,
            logprobs=req.logprobs,
            attempts=attempts,
            topk_ids=req.topk_ids,
            topk_logprobs=req.topk_logprobs,
            finish_reason=req.finish_reason,
            error=req.error,
            t_submit=req.t_arrival,
            t_first_token=req.t_first_token,
            t_finish=req.t_finish,
            prompt_logprobs=None if prompt is None else [r[0] for r in prompt],
            prompt_topk_ids=[r[2] for r in prompt or []],
            prompt_topk_logprobs=[r[3] for r in prompt or []],
        )


def _attempt(i: int, req, error: str | None) -> dict:
    """One attempt as `lpf.run.schema.ATTEMPT` (an in-process engine: sent, no HTTP status)."""
    import time

    return {
        "attempt": i,
        "sent": True,
        "status": None,
        "error": error,
        "t_start": req.t_arrival,
        "t_end": req.t_finish or time.time(),
    }
