"""Benchmark: detection power of the run-level test (`lpf.analysis.run_test`) against token count.

For each substitution drill of the built-in engine and for clean runs (float32 and bfloat16 engines,
float32 reference), one greedy `lpf audit` of zoo:hybrid on zoo:stress (2,000 requests, max_tokens 16,
top-5 logprobs; `runs/bench-detection/`, reused when complete). Then, for N = 25 .. 10,000 scored
tokens, W random windows of N consecutive scored tokens (arrival order) per run, each judged alone
against the run's expected floor (the shipped table's, as `lpf analyze` picks it): score = -log10 p.
  AUC          P(score of a drill window > score of a clean window at the drill's dtype), ties half
  false alarm  share of clean windows with p < alpha (the default 1e-6), per dtype
  smallest N   the smallest N with AUC >= 0.999
Two tests side by side: the run-level test as shipped (the engine's token and its top-k), the same
with the engine's top-k withheld (only the sampled token's logprob, as a provider that returns no
alternatives), and the named baseline: the per-request verdicts under the run's own floor (what lpf
did before; score = the window's tokens flagged divergent or worse), whose AUC stays near 0.5 for a
lie that is small everywhere.
The tokens-only column (`--part tokens`, bench/results/detection_tokens.json): what a server that returns
no logprobs allows (`lpf.analysis.token_test`, the engine's logprobs never read), greedy and sampled
(temperature 1, with the seeded replay of the built-in engine's sampler, Token-DiFR's setting, and without
it), on prose the zoo model was not trained to continue (400 prompts, 16 tokens each past EOS): on its
trained tasks the 4-bit copy changes no greedy token, so tokens alone cannot see it there.
`--quick` is the smoke run `make test` does (seconds; nothing asserted of the numbers, no results
file): two configs (clean float32 and quantize-weights:4, greedy) on 40 prose prompts of 8 tokens, in a
temporary folder, 50 windows; both parts read the same two runs (two `lpf audit`s, not four: a process
start-up is most of a quick run).
`--requests N` audits the first N zoo:stress prompts (seed 17) instead of all 2,000, in --out/requests-N/
(the time a shared 2-core machine allows), written to bench/results/detection-DATE-requestsN.json.
`--only NAME` (repeated) runs those configs (of CONFIGS and HONEST) and no others, written to
bench/results/checks/detection-DATE-only[-requestsN].json (a re-check of some rows, outside the table's files:
docs/benchmarks.md's table keeps the full run's row).
Usage: python bench/detection.py [--windows 500] [--out runs/bench-detection] [--part logprobs|tokens|both] [--quick]
       [--requests N] [--only NAME ...]
(writes bench/results/detection.json and detection_tokens.json, prints the tables)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIZES = (25, 50, 100, 300, 1000, 3000, 10000)
CONFIGS = {  # name -> (engine dtype, drill or None)
    "clean float32": ("float32", None),
    "clean bfloat16": ("bfloat16", None),
    "quantize-weights:4": ("float32", "quantize-weights:4"),
    "quantize-weights:8": ("float32", "quantize-weights:8"),
    "kv-quant:8": ("float32", "kv-quant:8"),
    "kv-quant:4": ("float32", "kv-quant:4"),
    "perturb-weights:0.01": ("float32", "perturb-weights:0.01"),
    "sampling-temperature:0.8": ("float32", "sampling-temperature:0.8"),
    "bf16 + quantize-weights:4": ("bfloat16", "quantize-weights:4"),
    "bf16 + quantize-weights:8": ("bfloat16", "quantize-weights:8"),
}
# honest engines outside the reference's kernels: false alarms counted beside the clean built-in runs
# (name -> (engine dtype, engine, knobs)); skipped, and said, where the engine is not built here
HONEST = {
    "honest llama.cpp float32": ("float32", "llamacpp", ("-E", "parallel=8")),
    "honest llama.cpp float32, flash attention": ("float32", "llamacpp", ("-E", "parallel=8", "-E", "flash_attn=on")),
    "honest vllm float32": ("float32", "vllm", ("-E", "enable_prefix_caching=false")),
    "honest vllm bfloat16": ("bfloat16", "vllm", ("-E", "enable_prefix_caching=false")),
    "honest builtin float32, 2 threads": ("float32", "builtin", ("-E", "threads=2")),
}
HEAVY_LOCK = "/tmp/lpf-heavy.lock"  # the lock every vLLM / llama-server run on this machine takes (flock(1))
ROC_N = 100  # the window size of the ROC over the departure a window must reach


TOKEN_CONFIGS = {  # name -> (engine dtype, drill or None, temperature)
    "greedy clean float32": ("float32", None, 0.0),
    "greedy clean bfloat16": ("bfloat16", None, 0.0),
    "greedy quantize-weights:4": ("float32", "quantize-weights:4", 0.0),
    "sampled clean float32": ("float32", None, 1.0),
    "sampled clean bfloat16": ("bfloat16", None, 1.0),
    "sampled quantize-weights:4": ("float32", "quantize-weights:4", 1.0),
}
TOKEN_SIZES = (25, 50, 100, 300, 1000, 3000)


def audit(
    out: Path,
    dtype: str,
    drill: str | None,
    workload: str = "zoo:stress",
    extra: tuple = (),
    max_tokens: int = 16,
    engine: str = "builtin",
) -> Path | None:
    if (out / "findings.json").is_file():
        return out
    args = [
        str(Path(sys.executable).with_name("lpf")),
        "audit",
        "--engine",
        engine,
        "--model",
        "zoo:hybrid",
        "--workload",
        workload,
        "--max-tokens",
        str(max_tokens),
        "--dtype",
        dtype,
        "--out",
        str(out),
        "--fail-on",
        "never",
        *(("-E", "threads=1") if engine == "builtin" and "threads=2" not in extra else ()),
        *extra,
    ]
    if drill:
        args += ["--inject", drill]
    if engine != "builtin" and shutil.which("flock"):  # a server engine: one at a time on a shared machine
        args = ["flock", HEAVY_LOCK, *args]
    t0 = time.time()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0 and engine != "builtin":  # an engine not built here: said, not fatal
        print(f"  {out.name}: skipped ({(proc.stderr.strip().splitlines() or ['?'])[-1]})", file=sys.stderr)
        return None
    if proc.returncode != 0:
        raise SystemExit(f"{out}: audit failed:\n{proc.stderr[-2000:]}")
    print(f"  {out.name}: {time.time() - t0:.0f} s", file=sys.stderr)
    return out


def evidence(run: Path) -> dict:
    """{"shipped", "token only", "baseline"}: per-token evidence (arrival order) of one run."""
    import pyarrow.parquet as pq

    from lpf.analysis import metrics, run_test as rt
    from lpf.analysis.calibration import calibrate
    from lpf.analysis.token_evidence import evidence_columns
    from lpf.analysis.floors import expected_floor
    from lpf.analysis.thresholds import Thresholds
    from lpf.pipeline.analyze import floor_table
    from lpf.pipeline.calibrate import engine_dtype

    m = json.loads((run / "manifest.json").read_text())
    tokens, reference, requests = (pq.read_table(run / t) for t in ("tokens", "reference", "requests"))
    joined, starts = metrics.join_grouped(tokens, reference)
    cols = evidence_columns(joined, tokens, reference, requests)
    floor = expected_floor(floor_table(), engine_dtype(m), m["reference"]["dtype"], m["reference"]["spec"])
    shipped = rt.token_evidence(cols, floor, m["sampling"])
    bare = {k: v for k, v in cols.items() if not k.startswith("engine_topk")}
    token_only = rt.token_evidence(bare, floor, m["sampling"])
    # the baseline: per-request verdict machinery under the run's own floor
    ad = np.abs(joined.column("engine_logprob").to_numpy() - joined.column("ref_logprob").to_numpy())
    th, _ = calibrate(ad, starts, Thresholds())
    arr = metrics.metric_arrays(metrics.input_arrays(joined), m["sampling"]["temperature"] == 0, th)
    flagged = (arr["abs_logprob_diff"] > th.divergent_abs_diff) | arr["greedy_flip"] | arr["gibberish"]
    return {"shipped": shipped, "token only": token_only, "baseline": flagged[cols["order"]], "floor": floor}


def _dirname(name: str) -> str:
    return name.replace(" ", "-").replace(":", "-").replace("+", "p").replace(",", "")


def window_scores(ev, size: int, starts: np.ndarray, alpha: float) -> np.ndarray:
    """Per window, -log10 p of the test as shipped, where only a window it calls `different` can pass
    -log10 alpha (a significant window the departure gate calls other honest arithmetic is capped just
    under it: an alarm is a `different`, not a p-value)."""
    from lpf.analysis.run_test import decide

    if isinstance(ev, np.ndarray):  # the baseline: flagged tokens in the window
        c = np.concatenate([[0], np.cumsum(ev)])
        return (c[starts + size] - c[starts]).astype(float)
    cap = -np.log10(alpha) * (1 - 1e-9)
    out = []
    for s in starts:
        r = decide(ev, int(s), int(s) + size, alpha)
        score = -(r["log10_p_value"] or 0.0)
        out.append(score if r["result"] == "different" else min(score, cap))
    return np.array(out)


def window_departures(ev: dict, size: int, starts: np.ndarray) -> np.ndarray:
    """Per window, its largest departure over what that component needs (`floors.departure_needed`):
    >= 1 is past the gate; the ROC sweeps this threshold."""
    from lpf.analysis.floors import departure, departure_needed

    need = departure_needed(ev["floor"])
    out = []
    for s in starts:
        lo, hi = int(s), int(s) + size
        w = ev["w"][lo:hi][ev["has_topk"][lo:hi]] if "w" in ev else None
        gone = ev["absent"][lo:hi] if "absent" in ev else None  # tokens without a logprob: left out
        seen = departure(ev["d"][lo:hi], ev["s"][lo:hi], w, ev["floor"], gone)
        out.append(max((v / need[c] for c, v in seen.items() if v is not None), default=0.0))
    return np.array(out)


def roc(drills: dict, honest: dict) -> list[dict]:
    """The ROC over the departure threshold t (in units of what the gate needs): per t, the share of
    drill windows past it (detection) and of honest windows past it (false alarm)."""
    pos = np.concatenate(list(drills.values())) if drills else np.zeros(0)
    neg = np.concatenate(list(honest.values())) if honest else np.zeros(0)
    ts = np.unique(np.concatenate([[0.0, 1.0, np.inf], pos, neg]))
    return [
        {
            "t": float(t),
            "detection": float(np.mean(pos >= t)) if pos.size else None,
            "false_alarm": float(np.mean(neg >= t)) if neg.size else None,
        }
        for t in ts[:: max(1, len(ts) // 200)]
    ]


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    both = np.concatenate([pos, neg])
    ranks = np.argsort(np.argsort(both, kind="stable"), kind="stable").astype(float)
    for v in np.unique(both):  # average ranks of ties
        tie = both == v
        ranks[tie] = ranks[tie].mean()
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) - 1) / 2) / (len(pos) * len(neg)))


def prose_workload(path: Path, n: int = 400) -> Path:
    import random

    from lpf.zoo.tasks import filler_text

    rng = random.Random(5)
    path.write_text(
        "".join(
            json.dumps({"id": f"prose-{i:04d}", "prompt": filler_text(rng, rng.randint(8, 20))}) + "\n"
            for i in range(n)
        )
    )
    return path


def token_evidence(run: Path) -> dict:
    """{"seeded", "unseeded"}: tokens-only evidence (arrival order) of one run (the same without a seed
    for greedy runs), judged against the run's expected floor."""
    import pyarrow.parquet as pq

    from lpf.analysis import metrics, token_test
    from lpf.analysis.floors import expected_floor
    from lpf.analysis.token_evidence import evidence_columns
    from lpf.pipeline.analyze import floor_table
    from lpf.pipeline.calibrate import engine_dtype

    m = json.loads((run / "manifest.json").read_text())
    tokens, reference, requests = (pq.read_table(run / t) for t in ("tokens", "reference", "requests"))
    joined, _ = metrics.join_grouped(tokens, reference)
    cols = evidence_columns(joined, tokens, reference, requests)
    cols = {k: v for k, v in cols.items() if not k.startswith("engine_topk")}
    floor = expected_floor(floor_table(), engine_dtype(m), m["reference"]["dtype"], m["reference"]["spec"])
    seeded = pq.read_table(run / "seeded") if (run / "seeded").is_dir() else None
    draws = token_test.seeded_columns(seeded, joined, cols["order"])
    out = {"unseeded": token_test.token_evidence(cols, floor, m["sampling"])}
    out["seeded"] = (
        token_test.token_evidence(cols, floor, m["sampling"], draws) if draws is not None else out["unseeded"]
    )
    return out


def token_scores(ev: dict, size: int, starts: np.ndarray, alpha: float) -> np.ndarray:
    from lpf.analysis.token_test import decide

    return np.array([-(decide(ev, int(s), int(s) + size, alpha)["log10_p_value"] or 0.0) for s in starts])


def token_run(a, name: str, workload: Path) -> Path:
    """The tokens part's run of TOKEN_CONFIGS[name] on the prose workload (audited unless complete)."""
    dtype, drill, temp = TOKEN_CONFIGS[name]
    extra = ("--ignore-eos", "--temperature", str(temp), "--seed", "3")
    out = a.out / "tokens-only" / name.replace(" ", "-").replace(":", "-")
    return audit(out, dtype, drill, str(workload), extra, 8 if a.quick else 16)


def tokens_part(a, alpha: float, rng) -> None:
    out = a.out / "tokens-only"
    out.mkdir(parents=True, exist_ok=True)
    workload = prose_workload(out / "prose400.jsonl", 40 if a.quick else 400)
    configs = (
        {k: TOKEN_CONFIGS[k] for k in ("greedy clean float32", "greedy quantize-weights:4")}
        if a.quick
        else TOKEN_CONFIGS
    )
    ev = {name: token_evidence(token_run(a, name, workload)) for name in configs}
    n_min = min(e["unseeded"]["n"] for e in ev.values())
    sizes = [s for s in TOKEN_SIZES if s <= n_min]
    starts = {s: rng.integers(0, n_min - s + 1, a.windows) for s in sizes}
    methods = ("unseeded", "seeded")
    scores = {
        name: {meth: {s: token_scores(e[meth], s, starts[s], alpha) for s in sizes} for meth in methods}
        for name, e in ev.items()
    }
    result = {
        "measured": time.strftime("%Y-%m-%d"),
        "alpha": alpha,
        "windows": a.windows,
        "sizes": sizes,
        "workload": "400 prose prompts (zoo filler text), 16 tokens each (--ignore-eos), zoo:hybrid, built-in engine",
        "n_tokens": {k: e["unseeded"]["n"] for k, e in ev.items()},
        "false_alarm": {},
        "auc": {},
        "smallest_n": {},
    }
    for name, (dtype, drill, temp) in configs.items():
        kind = "greedy" if temp == 0 else "sampled"
        if drill is None:
            result["false_alarm"][name] = {
                m: {s: float(np.mean(scores[name][m][s] > -np.log10(alpha))) for s in sizes} for m in methods
            }
            continue
        clean = f"{kind} clean {dtype}"
        result["auc"][name] = {m: {s: auc(scores[name][m][s], scores[clean][m][s]) for s in sizes} for m in methods}
        result["smallest_n"][name] = {
            m: next((s for s in sizes if result["auc"][name][m][s] >= 0.999), None) for m in methods
        }
    if not a.quick:
        (ROOT / "bench" / "results").mkdir(exist_ok=True)
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        (ROOT / "bench" / "results" / "detection_tokens.json").write_text(json.dumps(stamp(result), indent=1) + "\n")
    head = "| run | " + " | ".join(f"N={s}" for s in sizes) + " | smallest N (AUC >= 0.999) |"
    for meth in methods:
        print(f"\ntokens only, AUC, {meth}:\n{head}\n|" + "---|" * (len(sizes) + 2))
        for name, by in result["auc"].items():
            print(
                f"| {name} | "
                + " | ".join(f"{by[meth][s]:.3f}" for s in sizes)
                + f" | {result['smallest_n'][name][meth] or '-'} |"
            )
    print(
        f"\ntokens only, false alarms at p < {alpha:g}: "
        + "; ".join(
            f"{k} {m}: " + ", ".join(f"{v:.3f}" for v in fa[m].values())
            for k, fa in result["false_alarm"].items()
            for m in methods
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=500)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-detection")
    ap.add_argument("--alpha", type=float, default=None)
    ap.add_argument("--part", choices=("logprobs", "tokens", "both"), default="both")
    ap.add_argument("--requests", type=int, default=None, help="audit the first N zoo:stress prompts (default all)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="two configs, 40 short prose requests, both parts on the same runs, a temporary folder (a smoke run)",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=None,
        help="a config name (of CONFIGS and HONEST) to run, the rest skipped; repeat it for several: a re-check of "
        "some rows (written to bench/results/checks/)",
    )
    a = ap.parse_args()
    from lpf.analysis.run_test import DEFAULT_ALPHA

    alpha = a.alpha or DEFAULT_ALPHA
    configs, workload, max_tokens = CONFIGS, "zoo:stress", 16
    if a.quick:  # the logprobs part reads the tokens part's greedy runs (logprobs_part says why)
        import tempfile

        configs = {k: CONFIGS[k] for k in ("clean float32", "quantize-weights:4")}
        a.out, a.windows = Path(tempfile.mkdtemp(prefix="lpf-bench-detection-")), 50
    if a.requests:  # a subset of zoo:stress, in its own folder (complete runs of another size are not reused)
        from lpf.zoo import registry

        a.out = a.out / f"requests-{a.requests}"
        a.out.mkdir(parents=True, exist_ok=True)
        items = registry.workload_items("stress", seed=17, n=a.requests)[: a.requests]
        workload = a.out / f"stress-{a.requests}.jsonl"
        workload.write_text("".join(json.dumps({"id": i["id"], "prompt": i["prompt"]}) + "\n" for i in items))
        workload = str(workload)
    if a.only:
        wanted = [n.strip() for n in a.only]  # names hold commas ("..., flash attention"): one name per --only
        unknown = [n for n in wanted if n not in CONFIGS and n not in HONEST]
        if unknown:
            sys.exit(f"--only: unknown config(s) {', '.join(unknown)}; known: {', '.join([*CONFIGS, *HONEST])}")
        configs = {k: v for k, v in configs.items() if k in wanted}
        for k in [k for k in HONEST if k not in wanted]:
            del HONEST[k]
    a.out.mkdir(parents=True, exist_ok=True)
    try:
        if a.part in ("tokens", "both"):
            tokens_part(a, alpha, np.random.default_rng(1))
        if a.part != "tokens":
            logprobs_part(a, alpha, configs, workload, max_tokens)
    finally:
        if a.quick:
            shutil.rmtree(a.out, ignore_errors=True)


def logprobs_part(a, alpha: float, configs: dict, workload: str, max_tokens: int) -> None:
    rng = np.random.default_rng(0)
    ev = {}
    for name, (dtype, drill) in configs.items():
        if a.quick:  # the tokens part's greedy run of the same config: one `lpf audit` serves both parts
            prose = a.out / "tokens-only" / "prose400.jsonl"
            if not prose.is_file():  # --part logprobs
                prose.parent.mkdir(parents=True, exist_ok=True)
                prose_workload(prose, 40)
            ev[name] = evidence(token_run(a, f"greedy {name}", prose))
            continue
        ev[name] = evidence(
            audit(
                a.out / _dirname(name),
                dtype,
                drill,
                workload,
                (),
                max_tokens,
            )
        )
    honest = {}
    if not a.quick:
        for name, (dtype, engine, knobs) in HONEST.items():
            run = audit(a.out / _dirname(name), dtype, None, workload, knobs, max_tokens, engine)
            if run is not None:
                honest[name] = evidence(run)
    ev.update(honest)
    n_min = min(e["shipped"]["n"] for e in ev.values())
    sizes = [s for s in SIZES if s <= n_min]
    starts = {s: rng.integers(0, n_min - s + 1, a.windows) for s in sizes}
    methods = ("shipped", "token only", "baseline")
    scores = {
        name: {meth: {s: window_scores(e[meth], s, starts[s], alpha) for s in sizes} for meth in methods}
        for name, e in ev.items()
    }
    result = {
        "measured": time.strftime("%Y-%m-%d"),
        "alpha": alpha,
        "windows": a.windows,
        "sizes": sizes,
        "n_tokens": {k: e["shipped"]["n"] for k, e in ev.items()},
        "workload": workload if a.requests is None else f"the first {a.requests} zoo:stress prompts (seed 17)",
        "floors": {k: e["floor"]["pair"] + " (" + e["floor"]["detail"] + ")" for k, e in ev.items()},
        "false_alarm": {},
        "auc": {},
        "smallest_n": {},
    }
    for name in [c for c in ("clean float32", "clean bfloat16") if c in configs] + list(honest):
        result["false_alarm"][name] = {
            m: {s: float(np.mean(scores[name][m][s] > -np.log10(alpha))) for s in sizes}
            for m in ("shipped", "token only")
        }
    for name, (dtype, drill) in configs.items():
        if drill is None:
            continue
        clean = "clean float32" if dtype == "float32" else "clean bfloat16"
        result["auc"][name] = {m: {s: auc(scores[name][m][s], scores[clean][m][s]) for s in sizes} for m in methods}
        result["smallest_n"][name] = {
            m: next((s for s in sizes if result["auc"][name][m][s] >= 0.999), None) for m in methods
        }
    if ROC_N in sizes:  # one ROC per engine dtype over the departure threshold, drills against honest runs
        dep = {k: window_departures(e["shipped"], ROC_N, starts[ROC_N]) for k, e in ev.items()}
        dtypes = {k: (configs.get(k) or HONEST.get(k))[0] for k in ev}
        result["roc"] = {"n": ROC_N, "by_dtype": {}}
        for dtype in sorted(set(dtypes.values())):
            drills = {k: dep[k] for k in configs if dtypes[k] == dtype and configs[k][1]}
            clean = {k: dep[k] for k in ev if dtypes[k] == dtype and k not in drills}
            result["roc"]["by_dtype"][dtype] = {
                "drills": sorted(drills),
                "honest": sorted(clean),
                "departure_p50": {k: float(np.median(v)) for k, v in {**drills, **clean}.items()},
                "curve": roc(drills, clean),
            }
    if not a.quick:
        (ROOT / "bench" / "results").mkdir(exist_ok=True)
        # a subset run is its own dated file of the `detection` family (the full run's detection.json kept)
        name = f"detection-{result['measured']}-requests{a.requests}.json" if a.requests else "detection.json"
        if a.only:  # some rows only: a check kept beside the table's files (bench/results/checks/), never a row of it
            name = "checks/" + f"detection-{result['measured']}-only" + (f"-requests{a.requests}" * bool(a.requests))
            name += ".json"
            (ROOT / "bench" / "results" / "checks").mkdir(exist_ok=True)
        from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

        (ROOT / "bench" / "results" / name).write_text(json.dumps(stamp(result), indent=1) + "\n")
    head = "| run | " + " | ".join(f"N={s}" for s in sizes) + " | smallest N (AUC >= 0.999) |"
    for meth in methods:
        print(f"\nAUC, {meth}:\n{head}\n|" + "---|" * (len(sizes) + 2))
        for name, by in result["auc"].items():
            print(
                f"| {name} | "
                + " | ".join(f"{by[meth][s]:.3f}" for s in sizes)
                + f" | {result['smallest_n'][name][meth] or '-'} |"
            )
    for dtype, r in (result.get("roc") or {}).get("by_dtype", {}).items():
        med = ", ".join(f"{k} {v:.3g}" for k, v in r["departure_p50"].items())
        print(f"\n{dtype}: median departure over what the gate needs, N={ROC_N} windows: {med}")
    for meth in ("shipped", "token only"):
        print(
            f"\nfalse alarms at p < {alpha:g}, {meth}: "
            + "; ".join(
                f"{k}: " + ", ".join(f"{v:.3f}" for v in fa[meth].values()) for k, fa in result["false_alarm"].items()
            )
        )


if __name__ == "__main__":
    main()
