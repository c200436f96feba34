"""What tracing costs inside one vLLM process, measured two ways that other jobs on the machine barely move.

1. Where the cost goes: CPU seconds spent in the plugin's per-step reader and in its part writes
   (each thread's own CPU clock), as a share of the process's CPU, over the recording rounds.
2. On vs paused in the same process: rounds alternate (recording, paused, recording, ...), each
   generating the same batch; the ratio of the medians (process CPU and wall). Paused, the hooks stay
   installed and pass straight through (three Python calls a step), so this baseline is not "plugin
   off" (bench/vllm_trace.py measures that, across processes, with the machine's noise); what it
   removes is everything the trace does.
Run it with vLLM's interpreter and the plugin installed (`make vllm`):
  .venv-vllm/bin/python bench/vllm_trace_profile.py MODEL_DIR [--max-num-seqs N] [--max-num-batched-tokens N]
Prints one JSON line (`make bench-vllm` appends one per configuration to bench/results/vllm_trace_profile.jsonl).
`--quick` is the smoke run `make test` does (nothing timed is asserted): 32 requests, one round of each mode.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]  # bench/ must not shadow packages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5, help="rounds per mode")
    ap.add_argument("--quick", action="store_true", help="32 requests, one round per mode (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rounds = 32, 1
    os.environ.setdefault("LPF_VLLM_TRACE_DIR", tempfile.mkdtemp(prefix="lpf-trace-profile-"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import lpf_vllm_trace
    from lpf_vllm_trace import recorder, step_rows
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    acc = {"reader_cpu_s": 0.0, "writer_cpu_s": 0.0, "steps": 0}

    def timed(fn, key, count=False):
        def wrapper(*a, **kw):
            t = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] += time.thread_time() - t
                acc["steps"] += count

        return wrapper

    step_rows.StepReader.read = timed(step_rows.StepReader.read, "reader_cpu_s", count=True)
    recorder.Recorder.flush = timed(recorder.Recorder.flush, "writer_cpu_s")
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    rng = random.Random(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))])
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    session = lpf_vllm_trace._session  # the bench pauses it between rounds (a private handle, on purpose)
    llm.generate(prompts[:32], params, use_tqdm=False)  # warm-up
    rounds = {True: [], False: []}
    for i in range(2 * args.rounds):
        on = i % 2 == 0
        session.why = None if on else "paused by the benchmark"
        t, c = time.perf_counter(), time.process_time()
        llm.generate(prompts, params, use_tqdm=False)
        if on:
            lpf_vllm_trace.flush()
        rounds[on].append((time.perf_counter() - t, time.process_time() - c))
    session.why = None
    if not lpf_vllm_trace.status()["recording"]:
        sys.exit(f"the plugin recorded nothing: {lpf_vllm_trace.status()['why']}")
    med = {
        f"{m}_{k}": statistics.median(r[j] for r in rounds[on])
        for m, on in (("on", True), ("paused", False))
        for j, k in enumerate(("wall_s", "cpu_s"))
    }
    cpu_on = sum(r[1] for r in rounds[True])
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "model": args.model,
                **med,
                "ratio_cpu": med["on_cpu_s"] / med["paused_cpu_s"],
                "ratio_wall": med["on_wall_s"] / med["paused_wall_s"],
                **acc,
                "reader_share": acc["reader_cpu_s"] / cpu_on,
                "writer_share": acc["writer_cpu_s"] / cpu_on,
                "reader_us_per_step": 1e6 * acc["reader_cpu_s"] / acc["steps"],
                "rounds": args.rounds,
                "requests": args.requests,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
