"""Re-create the seed's RL lever table and write it into docs/benchmarks.md between the lever-table markers.

The seed: with the 32-bit state offset overflow, logprob spikes between rollouts and trainer came
every 12 steps with 8 rollouts per prompt, at step 1 with 128, and vanished with a smaller cache.
Here, on the built-in engine (zoo:hybrid, state slot stride 14,880 elements) with
`offset-wrap:20`, slots >= ceil(2^20 / 14880) = 71 wrap. A 9 MB cache holds 79 state slots, so
8 of them (71..78) are poisoned, and every step consumes P * N slots of the upward sweep: the sweep
reaches them every K ~ 79 / (P * N) steps, and at step 1 once P * N >= 72. An 8 MB cache holds 70
slots: no slot id ever wraps, so no spike at any rollout count.

Each row runs `lpf rl simulate` then `lpf rl analyze` in their own processes and reads the
findings; ground truth (requests a drill corrupted, from the simulator's faults file, which analysis
never reads) is shown only for comparison. Usage: python scripts/lever_table.py [--quick] [--no-readme]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
LPF = Path(sys.executable).with_name("lpf")
START, END = "<!-- lever-table:start -->", "<!-- lever-table:end -->"
BITS, PROMPTS = 20, 1
# (cache MB, rollouts per prompt, steps): enough steps for >= 3 sweeps of the slot pool where one is
# long, fewer where every step already spikes
ROWS = [(9, 8, 40), (9, 16, 24), (9, 32, 16), (9, 64, 12), (9, 128, 8), (8, 8, 40), (8, 128, 8)]


def run(*args) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    p = subprocess.run([str(LPF), *map(str, args)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"lpf {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return p.stdout


def one(tmp: Path, cache: float, n: int, steps: int) -> dict:
    dump = tmp / f"c{cache}-n{n}.parquet"
    t0 = time.time()
    run(
        "rl",
        "simulate",
        "--steps",
        steps,
        "--prompts",
        PROMPTS,
        "--rollouts",
        n,
        "--cache-mb",
        cache,
        "--inject",
        f"offset-wrap:{BITS}",
        "--out",
        dump,
    )
    f = json.loads(run("rl", "analyze", dump, "--out", tmp / f"c{cache}-n{n}.rl", "--json"))
    eng = f["simulation"]["engine"]
    slots, stride = eng["num_state_slots"], eng["state_slot_stride"]
    faults = dump.with_name(dump.stem + ".faults.parquet")
    truth = pq.read_table(faults).to_pylist() if faults.exists() else []
    wrapped = {r["request_id"] for r in truth if r["role"] == "corrupted"}
    victims = {r["request_id"] for r in truth if r["role"] == "overwritten"} - wrapped
    length = {r["request_id"]: len(r["response_token_ids"]) for r in pq.read_table(dump).to_pylist()}
    decoded = {w for w in wrapped if length.get(w, 0) >= 2}  # a 1-token response never reads its state
    found = {rid for s in f["spikes"] for rid in s["requests"]}
    top = f["hypotheses"][0] if f["hypotheses"] else None
    return {
        "cache_mb": cache,
        "rollouts": n,
        "prompts": PROMPTS,
        "steps": steps,
        "slots": slots,
        "wrap_slot": math.ceil(2**BITS / stride),
        "expected_K": slots / (PROMPTS * n),
        "spike_steps": f["spike_steps"],
        "first_spike": f["first_spike_step"],
        "period": f["period"]["period"],
        "confidence": f["period"]["confidence"],
        "implicated": f["implicated"]["n"],
        "first_off": f["implicated"]["first_divergence"]["median"],
        "wrapped": len(wrapped),
        "wrapped_decoded": len(decoded),
        "wrapped_found": len(decoded & found),
        "victims": len(victims),
        "victims_found": len(victims & found),
        "outside_truth": len(found - wrapped - victims),
        "top_hypothesis": top["feature"] if top else None,
        "top_sentence": top["sentence"] if top else None,
        "seconds": round(time.time() - t0, 1),
    }


def table(rows: list[dict]) -> str:
    head = (
        "| cache | slots (wrap from) | rollouts / prompt | steps | spike steps | first spike | period (conf.) "
        "| expected K = slots / (P·N) | implicated | drill truth: wrapped and decoded (found) | victims (found) "
        "| implicated outside truth | top hypothesis |\n|" + "---|" * 13 + "\n"
    )
    lines = []
    for r in rows:
        sp = r["spike_steps"]
        spikes = ", ".join(map(str, sp[:10])) + (" ..." if len(sp) > 10 else "")
        every = bool(sp) and sp == list(range(sp[0], r["steps"] + 1))
        per = (
            f"{r['period']:.3g} ({r['confidence']:.2f})"
            if r["period"] is not None
            else f"every step from {sp[0]}"
            if every
            else "-"
        )
        lines.append(
            f"| {r['cache_mb']:g} MB | {r['slots']} ({r['wrap_slot']}) | {r['rollouts']} | {r['steps']} | "
            f"{spikes or 'none'} | {r['first_spike'] if r['first_spike'] is not None else '-'} | {per} | "
            f"{r['expected_K']:.2f} | {r['implicated']} | {r['wrapped_decoded']} ({r['wrapped_found']}) | "
            f"{r['victims']} ({r['victims_found']}) | {r['outside_truth']} | "
            f"{('`' + r['top_hypothesis'] + '`') if r['top_hypothesis'] else '-'} |"
        )
    return head + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-readme", action="store_true", help="Print the table only.")
    ap.add_argument("--json", type=Path, default=None, help="Also write the raw rows here.")
    args = ap.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        rows = []
        for cache, n, steps in ROWS:
            rows.append(one(Path(d), cache, n, steps))
            print(json.dumps(rows[-1]), file=sys.stderr)
    md = table(rows)
    big = next((r for r in rows if r["top_sentence"]), None)
    note = (
        f"\n\nOffset-wrap:{BITS}, {PROMPTS} prompt per step, zoo:hybrid, max 16 tokens, temperature 1; "
        f"{time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s on this machine. "
        + (
            f'Top hypothesis in words ({big["cache_mb"]:g} MB, {big["rollouts"]} rollouts): "{big["top_sentence"]}"'
            if big
            else ""
        )
    )
    print(md + note)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if not args.no_readme:
        readme = ROOT / "docs" / "benchmarks.md"
        text = readme.read_text()
        if START not in text or END not in text:
            sys.exit(f"docs/benchmarks.md has no {START} ... {END} markers")
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        readme.write_text(head + START + "\n" + md + note + "\n" + END + tail)
        print("docs/benchmarks.md updated", file=sys.stderr)


if __name__ == "__main__":
    main()
