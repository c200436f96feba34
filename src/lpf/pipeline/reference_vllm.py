"""vLLM as the reference (`--reference vllm:MODEL`): offline vLLM in lpf's worker, in a reference configuration.

For a model transformers cannot hold, or runs slowly: vLLM teacher-forces each request's prompt + output
as a prompt with `SamplingParams(prompt_logprobs=k, max_tokens=1)`, through the `vllm` engine's own worker
(`lpf.adapters.vllm`: vLLM's interpreter, a zygote-forked process on the CPU build; kept up across an
audit's stages by `kept`), and the answers become the run's `reference/` rows the way every prompt-logprob
reference's do (`lpf.pipeline.reference_prompt`: vLLM's own rank, entropy and log-sum-exp null).

Contract:
- `parse_spec(spec)`: the model spec after `vllm:` (`vllm:zoo:hybrid` -> `zoo:hybrid`); `LpfError` when empty.
- `reference_options(pairs)`: the `-R KEY=VALUE` knobs as {name: text}, checked against `KNOBS` (one-line
  `LpfError` naming the knob: unknown, fixed by the reference configuration, a bad value, or more than one
  sequence at a time without `batch_invariant=true`).
- `engine_options(dtype, knobs)`: the `vllm` engine's options of the reference configuration: `FIXED`
  (eager, no prefix caching, no chunked prefill, no speculation, no trace plugin, no drills), one sequence
  at a time (`max_num_seqs` 1) unless `batch_invariant` (VLLM_BATCH_INVARIANT=1, vLLM's batch-invariant
  kernels, where this vLLM has them: vLLM refuses at start where it does not, e.g. its CPU build's
  Mamba backends), the reference dtype (`--reference-dtype`), the rest of `KNOBS` (`tensor_parallel_size`
  passed through) as given.
- `VLLMReference(spec, model, dtype, knobs, topk)`: a `PromptReference`. vLLM starts on the first
  `score_all`/`score` and stops when it has answered them (its start is in `cost["start_seconds"]`);
  `describe()` is the manifest's `reference` block (kind "vllm", the model, dtype, the engine arguments
  vLLM ran, the batch rule, vLLM's version, the tokenizer's fingerprint, cost); `max_context` None (vLLM
  refuses what is too long: that request's error).
- `for_run(manifest, spec, dtype, pairs, topk)` / `from_manifest(manifest, topk)`: the reference of a run.
- `kept(reference)`: inside the block, a vLLM reference's engine stays up between its calls (an audit's
  rescore, then its analysis' attribution: one vLLM start, not two) and stops on exit; outside it, each
  `score_all` starts and stops its own. A reference of another form: the block does nothing.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Any, Iterator

from lpf.core.errors import LpfError, did_you_mean
from lpf.pipeline.reference_prompt import PromptReference, sent_back

PREFIX = "vllm:"
# what makes the second pass vLLM's plainest path: no cached prefix, one prefill, no drafts, nothing recorded
FIXED = {
    "enforce_eager": True,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
    "speculative_config": None,
    "trace": False,
    "inject": "",
}
# -R knobs: the `vllm` engine's, by its names
KNOBS = (
    "tensor_parallel_size",
    "batch_invariant",
    "max_num_seqs",
    "max_model_len",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "num_gpu_blocks_override",
    "cpu_kvcache_space",
    "start_timeout_s",
)
DTYPES = ("float32", "bfloat16", "float16", "auto")
CHUNK = 256  # requests per batch sent to the worker: vLLM holds one batch's answers at a time
_LIVE: dict | None = None  # (model path, options) -> (a started `vllm` engine, its top-k), while kept() is active


@contextmanager
def kept(reference: str | None):
    """Keep a vLLM reference's engine up for the block (module docstring)."""
    global _LIVE
    if _LIVE is not None or not (reference or "").startswith(PREFIX):
        yield
        return
    _LIVE = {}
    try:
        yield
    finally:
        live, _LIVE = _LIVE, None
        for engine, _ in live.values():
            engine.close(kill=False)


def parse_spec(spec: str) -> str:
    model = spec[len(PREFIX) :].strip()
    if not model:
        raise LpfError("--reference vllm:MODEL needs a model after vllm: (a directory, zoo:NAME or tiny:NAME)")
    return model


def reference_options(pairs) -> dict[str, str]:
    """{knob: value text} of `-R KEY=VALUE` pairs, checked (module docstring)."""
    out: dict[str, str] = {}
    for kv in pairs or ():
        key, sep, value = str(kv).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise LpfError(f"-R expects KEY=VALUE, got {kv!r}")
        if key in FIXED or key == "dtype":
            why = "--reference-dtype sets it" if key == "dtype" else "the vLLM reference configuration fixes it"
            raise LpfError(f"-R {key}: {why} (eager, no prefix caching, no chunked prefill, no speculation)")
        if key not in KNOBS:
            raise LpfError(f"-R: no vLLM reference knob {key!r}{did_you_mean(key, KNOBS)}; knobs: {', '.join(KNOBS)}")
        out[key] = value.strip()
    engine_options("float32", out)  # types and ranges, said now rather than after the run
    return out


def engine_options(dtype: str, knobs: dict[str, str]):
    """The `vllm` engine's `VLLMOptions` of the reference configuration (module docstring)."""
    from lpf.adapters.vllm_options import VLLMOptions

    if dtype not in DTYPES:
        raise LpfError(f"--reference-dtype {dtype}: vLLM's dtype is one of {', '.join(DTYPES)}")
    raw: dict[str, Any] = {**FIXED, "max_num_seqs": 1, **knobs, "dtype": dtype}
    try:
        options = VLLMOptions.parse(raw)
    except LpfError as e:
        raise LpfError(f"-R {str(e).removeprefix('engine option ')}") from None
    if options.max_num_seqs != 1 and not options.batch_invariant:
        raise LpfError(
            f"-R max_num_seqs={options.max_num_seqs}: the vLLM reference scores one sequence at a time unless "
            f"-R batch_invariant=true (a batch's neighbours move a request's logprobs otherwise)"
        )
    return options


def for_run(manifest: dict, spec: str, dtype: str, pairs, topk: int) -> "VLLMReference":
    from lpf.core.model_specs import resolve_model

    model = resolve_model(parse_spec(spec))
    return VLLMReference(spec, model, dtype, reference_options(pairs), topk)


def from_manifest(manifest: dict, topk: int) -> "VLLMReference":
    """The reference a run was scored with (its manifest's block), for more scores of the same kind."""
    ref = manifest["reference"]
    pairs = [f"{k}={v}" for k, v in (ref.get("options") or {}).items()]
    return for_run(manifest, ref["spec"], ref.get("dtype") or "float32", pairs, topk)


class VLLMReference(PromptReference):
    """vLLM teacher-forcing prompt + output in its reference configuration (module docstring)."""

    def __init__(self, spec: str, model, dtype: str, knobs: dict[str, str], topk: int):
        from lpf.adapters.vllm import VLLMEngine

        super().__init__()
        self.spec, self.model, self.dtype, self.knobs = spec, model, dtype, dict(knobs)
        self.topk = max(topk, 1)
        self.where = f"the vLLM reference {spec}"
        self.max_context = None
        self.options = engine_options(dtype, self.knobs)
        VLLMEngine.check_model(_config(model))  # a model vLLM cannot run here: one line, before anything
        self.ready: dict = {}
        self.engine_args: dict | None = None
        self.cost["start_seconds"] = 0.0
        self._tokenizer_sha: str | None = None

    def tokenizer_sha256(self) -> str:
        if self._tokenizer_sha is None:
            from lpf.core.model_specs import load_tokenizer, tokenizer_fingerprint

            self._tokenizer_sha = tokenizer_fingerprint(load_tokenizer(self.model))
        return self._tokenizer_sha

    def describe(self) -> dict:
        batch = (
            f"batch-invariant mode (VLLM_BATCH_INVARIANT=1), max_num_seqs={self.options.max_num_seqs}"
            if self.options.batch_invariant
            else "one sequence at a time (max_num_seqs=1)"
        )
        version = self.ready.get("vllm_version")
        return {
            "kind": "vllm",
            **self.model.describe(),
            "spec": self.spec,
            "model": self.model.spec,
            "dtype": self.dtype,
            "implementation": f"vLLM {version}" if version else "vLLM",
            "configuration": "eager, no prefix caching, no chunked prefill, no speculation; " + batch,
            "options": dict(self.knobs),
            "engine_args": self.engine_args,
            "prompt_logprobs": "SamplingParams(prompt_logprobs=k, max_tokens=1)",
            "top_k": self.topk,
            "rank": "vLLM's own",
            "tokenizer_sha256": self.tokenizer_sha256(),
            "cost": dict(self.cost),
        }

    def _key(self) -> tuple[str, str]:
        return str(self.model.path), json.dumps(self.options.to_dict(), sort_keys=True)

    def _engine(self):
        """A started engine: the live one `kept()` holds for this model and configuration (asked for at least
        this top-k), else a new one (kept for the next call inside `kept()`)."""
        from lpf.adapters.vllm import VLLMEngine
        from lpf.core.sampling import SamplingParams

        key = self._key()
        if _LIVE is not None and key in _LIVE:
            engine, k = _LIVE.pop(key)
            if k >= self.topk and engine.proc is not None and engine.proc.poll() is None:
                _LIVE[key] = (engine, k)
                return engine
            engine.close(kill=True)
        sampling = SamplingParams(temperature=0.0, max_tokens=1, logprobs=self.topk, prompt_logprobs=True)
        t0 = time.monotonic()
        engine = VLLMEngine(self.model, sampling, self.options)
        self.cost["start_seconds"] = round(self.cost["start_seconds"] + time.monotonic() - t0, 3)
        if _LIVE is not None:
            _LIVE[key] = (engine, self.topk)
        return engine

    def _answers(self, items: list) -> Iterator[tuple[Any, Any]]:
        engine = self._engine()
        self.ready, self.engine_args = engine.ready, engine.engine_args
        done = False
        try:
            yield from sent_back(engine, items, CHUNK)
            done = not getattr(engine, "_failed", False)
        finally:
            if not done:  # it failed, or was abandoned mid-batch: never reused
                if _LIVE is not None:
                    _LIVE.pop(self._key(), None)
                engine.close(kill=True)
            elif _LIVE is None:  # outside kept(): this call's own engine (inside, kept() stops it)
                engine.close()


def _config(model) -> dict:
    """The model's config.json (what `check_model` reads: its architectures)."""
    try:
        return json.loads((model.path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LpfError(f"model {model.spec}: unreadable config.json ({e})") from None
