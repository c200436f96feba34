"""The process the `vllm` adapter runs with vLLM's own interpreter (never imported by lpf itself).

Usage: PYTHON vllm_worker.py CONFIG_JSON RESULT_FD. It needs only vLLM and the standard library.
Protocol, JSON lines:
- RESULT_FD (the only channel lpf reads; vLLM logs to stdout/stderr, which lpf sends to a log file):
  {"type": "ready", "vllm_version", "logprobs_mode", "engine_args", "trace", "vllm_config", "sampling_defaults",
  "kv_scales"} once the engine is up (`configuration_of`: what vLLM runs, read from its config; `kv_scales`: the
  per-tensor scales its attention layers quantize a quantized KV cache with, `kv_scales_of`),
  then per batch {"type": "submitted", "vllm_ids": {vLLM's id: ours}} once every request is in (the
  id vLLM's runner, and so the trace plugin, knows each request by), one {"type": "completion",
  request_id, output_token_ids, logprobs, topk_ids, topk_logprobs, finish_reason, error, t_submit,
  t_first_token, t_finish, and prompt_logprobs / prompt_topk_ids / prompt_topk_logprobs / prompt_ranks when the run
  asks for prompt logprobs} per request as it finishes and {"type": "done", "trace"} (+ "spec_decode":
  the batch's speculative-decoding counts from vLLM's metrics, when the engine speculates);
  {"type": "fatal", "error"} if the engine cannot start, could not run a step (`refused`) or dies
  ("TYPE: message", and when a batch raised, "; raised at FILE:LINE in FUNC", its innermost frame: lpf
  shrink's crash signature).
  `trace` is the lpf-vllm-trace plugin's status in this process (`lpf_vllm_trace.status()`), or why
  there is none. Finished requests are held back and sent in groups, at most once a second, each
  group right after the plugin's buffered rows are flushed to its parts: lpf never sees a request
  before the trace rows that describe it.
- stdin: requests {"request_id", "prompt_token_ids", "max_tokens", "seed", optional "sampling": settings of its own
  over the config's, e.g. a re-score's temperature 0, prompt logprobs and skip_reading_prefix_cache}, a batch closed by
  {"type": "end"}; {"type": "configure", "config": {...}} drops the engine and builds a new one from
  that config (answered by "ready", or "fatal" and exit), so one process can serve several
  configurations of one model and pay vLLM's import once; {"type": "capture", "spec": PATH | null}
before a batch sets lpf locate's capture (lpf-vllm-trace's `set_capture`) for it; EOF ends the process.
The config holds `engine_args` (passed to vllm.LLM as given, `logprobs_mode` dropped where this vLLM
lacks it) and the run's `sampling` (temperature, top_p, top_k, ignore_eos, logprobs). A request that
vLLM refuses on submission (say, too long) comes back alone with its error.
"""

import json
import os
import sys
import time
import traceback

# This file sits beside lpf's own `vllm.py` adapter: the script's directory must not shadow vLLM.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]


FLUSH_EVERY_S = 1.0


def emit(out, obj) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def make_llm(engine_args: dict):
    import dataclasses

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    args = dict(engine_args)
    mode = args.pop("logprobs_mode", None)
    if mode and "logprobs_mode" in known:
        args["logprobs_mode"] = mode
    else:
        mode = None  # this vLLM has no such switch: what it reports is recorded as unknown
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"this vLLM has no engine argument(s) {', '.join(unknown)}")
    return LLM(**args), mode


def sampling_params(sampling: dict, req: dict):
    from vllm import SamplingParams

    # a re-score (`lpf.pipeline.reference_vllm_self`) never reads a cached prefix: said, not left to the default
    skip = {"skip_reading_prefix_cache": True} if sampling.get("skip_reading_prefix_cache") else {}
    return SamplingParams(
        **skip,
        n=1,
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        top_k=sampling["top_k"] or 0,
        seed=req["seed"],
        max_tokens=req["max_tokens"],
        ignore_eos=sampling["ignore_eos"],
        logprobs=sampling["logprobs"],
        prompt_logprobs=sampling["logprobs"] if sampling.get("prompt_logprobs") else None,
    )


def prompt_part(output, k: int) -> dict:
    """{prompt_logprobs, prompt_topk_ids, prompt_topk_logprobs, prompt_ranks} of positions 1..P-1 from
    vLLM's `RequestOutput.prompt_logprobs` (None first, then {token id: Logprob}; a rank is vLLM's own,
    None where it gives none); {} when not asked."""
    rows = getattr(output, "prompt_logprobs", None)
    if rows is None:
        return {}
    ids = list(output.prompt_token_ids or [])
    lps, top_ids, top_lps, ranks = [], [], [], []
    for tid, entry in zip(ids[1:], rows[1:]):
        entry = entry or {}
        lps.append(float(entry[tid].logprob) if tid in entry else float("nan"))  # NaN: never clean, analysed as such
        rank = getattr(entry[tid], "rank", None) if tid in entry else None
        ranks.append(int(rank) if isinstance(rank, int) and rank >= 1 else None)
        items = sorted(((float(lp.logprob), int(t)) for t, lp in entry.items()), key=lambda p: -p[0])[:k]
        top_ids.append([t for _, t in items])
        top_lps.append([v for v, _ in items])
    return {"prompt_logprobs": lps, "prompt_topk_ids": top_ids, "prompt_topk_logprobs": top_lps, "prompt_ranks": ranks}


def _failed(req_id: str, t_submit: float, error: str) -> dict:
    """The completion message of a request whose answer cannot be read (no tokens, `error` says why)."""
    return {
        "type": "completion",
        "request_id": req_id,
        "output_token_ids": [],
        "logprobs": [],
        "finish_reason": "error",
        "t_submit": t_submit,
        "t_finish": time.time(),
        "error": error,
    }


def completion(req_id: str, output, t_submit: float, t_first: float | None, k: int) -> dict:
    out = output.outputs[0]
    ids = [int(t) for t in out.token_ids]
    lps, topk_ids, topk_lps = [], [], []
    per_pos = out.logprobs if out.logprobs is not None else []
    if len(per_pos) != len(ids):
        return _failed(req_id, t_submit, f"vLLM returned {len(per_pos)} logprob positions for {len(ids)} tokens")
    for pos, tid in enumerate(ids):
        entry = per_pos[pos]
        items = sorted(((float(lp.logprob), int(t)) for t, lp in entry.items()), key=lambda p: -p[0])
        sampled = entry[tid] if tid in entry else None
        if sampled is None:
            return _failed(req_id, t_submit, f"vLLM gave no logprob for the sampled token at position {pos}")
        lps.append(float(sampled.logprob))
        topk_ids.append([t for _, t in items[:k]])
        topk_lps.append([v for v, _ in items[:k]])
    finish = out.finish_reason if out.finish_reason in ("stop", "length") else (out.finish_reason or "length")
    error = None if finish in ("stop", "length") else f"vLLM finished the request with reason {finish!r}"
    return {
        "type": "completion",
        "request_id": req_id,
        **(prompt_part(output, k) if error is None else {}),
        "output_token_ids": ids if error is None else [],
        "logprobs": lps if error is None else [],
        "topk_ids": topk_ids if error is None else [],
        "topk_logprobs": topk_lps if error is None else [],
        "finish_reason": "error" if error else finish,
        "error": error,
        "t_submit": t_submit,
        "t_first_token": t_first,
        "t_finish": time.time(),
    }


def trace_status() -> dict:
    try:
        import lpf_vllm_trace
    except ImportError:
        return {
            "recording": False,
            "why": "lpf-vllm-trace is not installed in vLLM's Python "
            "(`make vllm` installs it; see docs/real-engines.md)",
        }
    return lpf_vllm_trace.status()


def set_capture(spec) -> str | None:
    """lpf locate's capture for the next batch (None: none), through the plugin; why not, when it cannot."""
    try:
        import lpf_vllm_trace
    except ImportError:
        return None if spec is None else "lpf-vllm-trace is not installed in vLLM's Python"
    if not hasattr(lpf_vllm_trace, "set_capture"):
        return None if spec is None else "this lpf-vllm-trace has no capture (reinstall it: `make vllm`)"
    return lpf_vllm_trace.set_capture(spec)


def flush_trace() -> None:
    try:
        import lpf_vllm_trace
    except ImportError:
        return
    lpf_vllm_trace.flush()


SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def spec_counters(llm) -> dict | None:
    """vLLM's speculative-decoding counters so far ({drafts, draft_tokens, accepted_tokens,
    accepted_per_position}), None without speculative decoding or stats. Prometheus counters live for
    the process (a kept worker's rebuilt engine adds to them): callers take differences."""
    if llm.llm_engine.vllm_config.speculative_config is None:
        return None
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - stats off or an older vLLM: the counts are unknown, not zero
        return None
    found: dict = {}
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            found[SPEC_COUNTERS[m.name]] = found.get(SPEC_COUNTERS[m.name], 0) + int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["accepted_per_position"] = [int(v) for v in m.values]
    return found or None


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    if after is None:
        return None
    before = before or {}
    delta = {k: v - before.get(k, 0) for k, v in after.items() if k != "accepted_per_position"}
    per_pos, old = after.get("accepted_per_position"), before.get("accepted_per_position") or []
    if per_pos is not None:
        delta["accepted_per_position"] = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(per_pos)]
    return delta


def run_batch(llm, sampling: dict, requests: list[dict], out) -> None:
    from vllm.inputs import TokensPrompt

    k = sampling["logprobs"]
    ours: dict[str, str] = {}  # vLLM's request id -> ours
    ks: dict[str, int] = {}  # vLLM's request id -> its top-k (a request's own `sampling` may set it)
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    for req in requests:
        t = time.time()
        own = {**sampling, **(req.get("sampling") or {})}  # a request's own settings over the run's
        try:
            vid = llm.llm_engine.add_request(
                req["request_id"],
                TokensPrompt(prompt_token_ids=req["prompt_token_ids"]),
                sampling_params(own, req),
            )
        except Exception as e:  # noqa: BLE001 - vLLM refused this request alone
            emit(
                out,
                {
                    "type": "completion",
                    "request_id": req["request_id"],
                    "output_token_ids": [],
                    "logprobs": [],
                    "finish_reason": "error",
                    "t_submit": t,
                    "t_finish": time.time(),
                    "error": f"vLLM refused the request: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
                },
            )
            continue
        # outputs carry the id we passed; some versions return an internal one with a suffix
        for key in {req["request_id"], vid if isinstance(vid, str) else req["request_id"]}:
            ours[key] = req["request_id"]
            submitted[key] = t
            ks[key] = own["logprobs"]
    emit(out, {"type": "submitted", "vllm_ids": ours})
    engine = llm.llm_engine
    finished: list[dict] = []  # completions whose trace rows may not be on disk yet
    last_flush = time.monotonic()

    def send() -> None:
        flush_trace()
        for c in finished:
            emit(out, c)
        finished.clear()

    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                vid = output.request_id
                if vid not in first and output.outputs and len(output.outputs[0].token_ids):
                    first[vid] = time.time()
                if output.finished and vid in ours:
                    finished.append(completion(ours[vid], output, submitted[vid], first.get(vid), ks.get(vid, k)))
                elif output.finished:
                    print(f"lpf worker: output for unknown request id {vid!r}", file=sys.stderr)
            # one flush a second at most (a part per finished request would cost the engine more than
            # the trace itself); completions go out right after the rows that describe them
            if finished and time.monotonic() - last_flush >= FLUSH_EVERY_S:
                send()
                last_flush = time.monotonic()
    finally:
        send()  # the rest, and whatever finished before an engine error: answers are never dropped


def raised_at(e: BaseException) -> str:
    """'; raised at FILE:LINE in FUNC', the innermost frame: with the type, a crash's signature (lpf shrink)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"; raised at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


def refused(llm) -> str | None:
    """Why this engine would fail its first step, known once it is built (None: nothing known). vLLM's
    CPU build accepts speculative decoding with prefix caching on a hybrid, then fails the first step:
    align mode on a hybrid that speculates pre-copies Mamba state with a Triton kernel
    (v1/worker/gpu_model_runner.py `_get_mamba_bufs`, v1/worker/mamba_utils.py `run_fused_precopy`) that
    the CPU platform gives no override (`register_triton_kernel_overrides`): without Triton it is a plain
    function, and launching it raises `TypeError: 'function' object is not subscriptable`."""
    cfg = llm.llm_engine.vllm_config
    if (
        cfg.speculative_config is None
        or getattr(cfg.cache_config, "mamba_cache_mode", None) != "align"
        or not cfg.model_config.is_hybrid
    ):
        return None
    try:
        from vllm.v1.worker import mamba_utils
    except ImportError:
        return None
    kernel = getattr(mamba_utils, "precopy_mamba_align_fused_kernel", None)
    if kernel is None or hasattr(kernel, "__getitem__"):  # a Triton kernel or a registered override: it launches
        return None
    return (
        "this vLLM cannot run speculative decoding with prefix caching on a hybrid model: its Mamba align-mode "
        "pre-copy (vllm/v1/worker/mamba_utils.py, run_fused_precopy) is a Triton kernel this build has no "
        "CPU implementation of; add -E enable_prefix_caching=false"
    )


def refused_seeded(llm, sampling: dict) -> str | None:
    """Why a sampled run would fail mid-run (None: nothing known). lpf gives every request a seed, and
    vLLM builds a per-request generator for a seeded sampled request on the device, a CPU generator on
    the CPU build; after a step whose sampled token it discards (a prompt prefilled in chunks: any run
    whose queue outgrows the step's token budget) the runner rewinds that generator by 4 offsets
    (`GPUModelRunner._bookkeeping_sync`, written for CUDA's Philox generators), and a CPU generator has
    none: `RuntimeError: CPU Generator does not use offset` kills the engine (docs/bugs.md 24)."""
    import inspect

    import torch

    if not sampling.get("temperature"):  # greedy requests get no generator
        return None
    cfg = llm.llm_engine.vllm_config
    if cfg.device_config.device_type != "cpu" or not getattr(cfg.scheduler_config, "enable_chunked_prefill", False):
        return None
    try:
        torch.Generator().get_offset()
        return None  # this torch's CPU generator has an offset: the rewind works
    except RuntimeError:
        pass
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        body = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    # the rewind, unguarded (a fixed runner would skip generators without an offset: a device check or a try)
    if "gen.set_offset(gen.get_offset() - 4)" not in body or "device.type" in body or "try:" in body:
        return None
    return (
        "this vLLM cannot sample seeded requests with chunked prefill on its CPU build: it rewinds a CPU "
        "generator's offset, which CPU generators do not have (vllm/v1/worker/gpu_model_runner.py, "
        "_bookkeeping_sync; docs/bugs.md 24); add -E enable_chunked_prefill=false"
    )


def start(config: dict, out):
    """vllm.LLM for `config`, announced as ready; None (announced as fatal) when it cannot be built."""
    try:
        import vllm

        llm, mode = make_llm(config["engine_args"])
    except Exception as e:  # noqa: BLE001 - reported to lpf as one line, full trace in the log
        traceback.print_exc()
        emit(out, {"type": "fatal", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"})
        return None
    why = refused(llm) or refused_seeded(llm, config.get("sampling") or {})
    if why is not None:  # said before any request, instead of every request failing at the first step
        emit(out, {"type": "fatal", "error": why})
        return None
    emit(
        out,
        {
            "type": "ready",
            "vllm_version": vllm.__version__,
            "logprobs_mode": mode,
            "engine_args": config["engine_args"],
            "trace": trace_status(),
            **configuration_of(llm),
        },
    )
    return llm


def configuration_of(llm) -> dict:
    """What vLLM runs, read from its config in-process, in the shape of `/server_info`'s `vllm_config`
    (`lpf.adapters.engine_config.from_vllm_config` reads either): {"vllm_config": {model_config: {dtype,
    quantization}, cache_config: {cache_dtype}, attention_config: {backend}}, "sampling_defaults": the
    model's generation-config defaults vLLM applies}. Empty where this vLLM keeps them elsewhere."""
    try:
        cfg = llm.llm_engine.vllm_config
        model, cache = cfg.model_config, cfg.cache_config
        attention = getattr(cfg, "attention_config", None)
        backend = getattr(attention, "backend", None)
        out = {
            "model_config": {
                "dtype": str(model.dtype).removeprefix("torch."),
                "quantization": getattr(model, "quantization", None),
            },
            "cache_config": {"cache_dtype": str(getattr(cache, "cache_dtype", "") or "") or None},
            "attention_config": {"backend": None if backend is None else str(getattr(backend, "name", backend))},
        }
        defaults = model.get_diff_sampling_param() if hasattr(model, "get_diff_sampling_param") else None
    except AttributeError:
        return {}
    return {"vllm_config": out, "sampling_defaults": defaults, "kv_scales": kv_scales_of(llm, out)}


def kv_scales_of(llm, config: dict) -> dict | None:
    """{"k": [...], "v": [...]}: the distinct per-tensor scales (`_k_scale_float`, `_v_scale_float`) the model's
    attention layers quantize K and V with, read from the layers themselves, when the KV cache is quantized
    (None otherwise, or where this vLLM keeps them elsewhere). vLLM sets them from a checkpoint's k_scale /
    v_scale, else 1.0 (model_executor/layers/quantization/kv_cache.py): a cache quantized at scale 1.0 loses
    small K/V values to fp8's subnormal range, which a cache scaled from the values' own range does not."""
    if not str((config.get("cache_config") or {}).get("cache_dtype") or "").startswith("fp8"):
        return None

    def scales(model):
        k, v = set(), set()
        for module in model.modules():
            if hasattr(module, "_k_scale_float") and hasattr(module, "_v_scale_float"):
                k.add(float(module._k_scale_float))
                v.add(float(module._v_scale_float))
        return {"k": sorted(k), "v": sorted(v)}

    try:
        got = llm.apply_model(scales)
    except Exception as e:  # noqa: BLE001 - a vLLM without apply_model in-process: the scales stay unread
        print(f"lpf worker: KV scales not read: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return got[0] if got and (got[0]["k"] or got[0]["v"]) else None


def main() -> int:
    import gc

    config_path, fd = sys.argv[1], int(sys.argv[2])
    out = os.fdopen(fd, "w", buffering=1)
    config = json.loads(open(config_path).read())
    llm = start(config, out)
    if llm is None:
        return 1
    batch: list[dict] = []
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("type") == "configure":
            llm, batch, config = None, [], msg["config"]
            gc.collect()  # the old engine's caches go before the new one sizes its own
            llm = start(config, out)
            if llm is None:  # a failed build may leave vLLM's process state half made: never reused
                return 1
            continue
        if msg.get("type") == "capture":  # before a batch: whose activations the plugin captures in it
            why = set_capture(msg.get("spec"))
            if why is not None:
                print(f"lpf worker: no capture: {why}", file=sys.stderr)
            continue
        if msg.get("type") != "end":
            batch.append(msg)
            continue
        spec_before = spec_counters(llm)
        try:
            run_batch(llm, config["sampling"], batch, out)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            emit(out, {"type": "fatal", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}{raised_at(e)}"})
            return 1
        done = {"type": "done", "trace": trace_status()}
        spec = spec_delta(spec_before, spec_counters(llm))
        if spec is not None:
            done["spec_decode"] = spec
        emit(out, done)
        batch = []
    return 0


if __name__ == "__main__":  # vLLM may spawn processes that re-import this file: work only under the guard
    sys.exit(main())
