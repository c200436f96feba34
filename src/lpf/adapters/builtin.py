"""`builtin` engine: lpf's own continuous-batching hybrid engine (`lpf.builtin`), with fault drills.

Knobs keep vLLM's names (max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, block_size)
plus `cache_mb` (the gpu_memory_utilization analogue) and `inject` (comma-separated drills). Besides
completions it hands the pipeline two side tables: the per-step `trace` and the fault ground truth.
"""

from __future__ import annotations

from typing import Iterator

from pydantic import field_validator

import lpf
from lpf.adapters.base import Completion, Engine, Options
from lpf.builtin.config import EngineConfig
from lpf.builtin.faults import DRILLS
from lpf.core.knobs import knob
from lpf.core.workload import EngineRequest


class BuiltinOptions(Options, EngineConfig):
    """The engine's own config (validated on parse, before a run starts) plus what the adapter adds."""

    inject: str = knob("", help="Fault drill (repeatable): built-in engine " + ", ".join(DRILLS) + "; vllm engine "
                       "stale-state, offset-wrap[:BITS] (through lpf-vllm-trace).", flag=True, repeatable=True,
                       metavar="FAULT[:ARG]")  # comma-separated in the options: "stale-state,offset-wrap:18"
    threads: int = knob(1, ge=0, help="torch intra-op threads while generating (0: leave torch's).")

    @field_validator("inject")
    @classmethod
    def _known_drills(cls, value: str) -> str:
        from lpf.builtin.faults import FaultSet

        FaultSet.parse(value)  # an unknown drill is refused before anything is written (LpfError)
        return value


class BuiltinEngine(Engine):
    name = "builtin"
    Options = BuiltinOptions
    supports_prompt_logprobs = True

    def __init__(self, model, sampling, options: BuiltinOptions):
        super().__init__(model, sampling, options)
        from lpf.builtin.llm_engine import LLMEngine
        from lpf.core.model_specs import load_tokenizer

        self.engine = LLMEngine.from_options(model.path, options)
        self.eos_id = load_tokenizer(model).eos_token_id

    @classmethod
    def check_model(cls, config: dict) -> None:
        from lpf.builtin.config import SUPPORTED_ARCHITECTURES
        from lpf.core.errors import LpfError

        arch = (config.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise LpfError(f"the built-in engine runs GraniteMoeHybrid and Jamba models; {arch} is not supported "
                           f"(use --engine hf)")

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
            return never_runs_reason(len(r.prompt_token_ids) + r.max_tokens, num_blocks, config,
                                     len(r.prompt_token_ids), context)

        smallest = min(requests, key=lambda r: len(r.prompt_token_ids) + r.max_tokens)
        reason = why(smallest)
        if reason is not None and all(why(r) is not None for r in requests):
            raise LpfError(f"these engine knobs can hold no request of the workload: even the smallest "
                           f"({smallest.request_id}) {reason}")

    def describe(self) -> dict:
        return {"name": self.name, "version": lpf.__version__, "options": self.options.to_dict(),
                "cache": self.engine.describe()}

    def generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        import torch

        before = torch.get_num_threads()
        if self.options.threads > 0:
            torch.set_num_threads(self.options.threads)
        try:
            yield from self._generate(requests)
        finally:
            torch.set_num_threads(before)  # the rescorer that may follow in this process wants them all

    def _generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        from lpf.builtin.request import Request

        for r in requests:
            req = Request(r.request_id, list(r.prompt_token_ids), self.sampling, r.max_tokens, r.seed,
                          self.eos_id, seq=r.seq)
            rejected = self.engine.add_request(req)
            if rejected is not None:
                yield self._completion(rejected)
        while self.engine.has_unfinished():
            for req in self.engine.step():
                yield self._completion(req)

    def side_tables(self) -> dict:
        return {"trace": self.engine.drain_trace(), "faults": self.engine.truth.drain()}

    @staticmethod
    def _completion(req) -> Completion:
        prompt = req.prompt_rows() if req.error is None else None
        return Completion(request_id=req.request_id, output_token_ids=req.output_token_ids, logprobs=req.logprobs,
                          topk_ids=req.topk_ids, topk_logprobs=req.topk_logprobs, finish_reason=req.finish_reason,
                          error=req.error, t_submit=req.t_arrival, t_first_token=req.t_first_token,
                          t_finish=req.t_finish, prompt_logprobs=None if prompt is None else [r[0] for r in prompt],
                          prompt_topk_ids=[r[2] for r in prompt or []],
                          prompt_topk_logprobs=[r[3] for r in prompt or []])
