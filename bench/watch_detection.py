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
- Clean: for each `--dtypes` upstream (`lpf serve --dtype D`, `lpf watch --upstream-dtype D`), `--clients`
  concurrent clients for `--seconds`, then the scorer given time to catch up: windows judged, alarmed
  windows, scored tokens, tokens generated per second and scored per second (the scorer's rate while it
  had a backlog), and the projection to 1M clean scored tokens.
`--quick`: 4+8 swap requests, 5 s of clean float32 traffic (a smoke run; nothing asserted; no results
file). Otherwise writes bench/results/watch_detection.json.
Usage: python bench/watch_detection.py [--quick] [--seconds 240] [--dtypes float32,bfloat16] [--window 4]
"""

from __future__ import annotations

import argparse
import asyncio
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


def body(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


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


async def traffic(base: str, seconds: float, clients: int, max_tokens: int, seed: int) -> int:
    ps = prompts(4096, seed)
    sent = 0
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=300) as c:

        async def client(i):
            nonlocal sent
            while time.monotonic() < stop:
                r = await c.post(f"{base}/v1/completions", json=body(ps[(sent + i) % len(ps)], max_tokens))
                r.raise_for_status()
                sent += 1

        await asyncio.gather(*(client(i) for i in range(clients)))
    return sent


def clean_part(a, tmp: Path, dtype: str) -> dict:
    out = tmp / f"clean-{dtype}"
    args = ["--reference", MODEL, "--sample", "1", "--window", a.window, "--upstream-dtype", dtype]
    args += ["--max-lag", "1000000"]
    with served("--model", MODEL, "--cache-mb", 24, "--dtype", dtype, env=ENV) as up:
        with watched(up.base_url, out, *args, env=ENV) as proxy:
            t0 = time.time()
            sent = asyncio.run(traffic(proxy.base_url, a.seconds, a.clients, a.max_tokens, 30))
            t_traffic = time.time() - t0
            w = wait_windows(out, sent // a.window, a.catch_up)
    judged = [x for x in w if x.get("n_requests")]
    tokens = sum(x.get("n_tokens", 0) for x in judged)
    t_first, t_last = min(x["t"] for x in w), max(x["t"] for x in w)
    score_rate = tokens / max(t_last - t0, 1e-9)
    return {
        "dtype": dtype,
        "requests": sent,
        "windows": len(w),
        "alarmed_windows": sum(bool(x.get("alarm")) for x in w),
        "alarmed": [{k: x.get(k) for k in ("window", "verdicts", "run_test")} for x in w if x.get("alarm")],
        "scored_tokens": tokens,
        "traffic_seconds": t_traffic,
        "generated_tokens_per_s": tokens / t_traffic,
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
    if not a.quick:
        (ROOT / "bench" / "results" / "watch_detection.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
