"""Benchmark: the 2026 bug class (prefix caching of Mamba state), drill by drill, scored against ground truth.

For every built-in drill of the class (`lpf.builtin.prefix_drills`, plus stale-state in the configuration
issue 22 names), one `lpf audit` of >= 1,000 requests (`--quick`: one drill, 240 requests, no shrink;
its smoke run is in tests/test_bench_quick.py),
then, from the run directory's `faults/` (ground truth, which analysis never reads) and its findings:
  recall        flagged (divergent or corrupt) ground-truth requests / ground-truth requests (a request cancelled
                before its first output token, which nothing can judge, is counted apart: truth_without_output)
  false pos.    requests flagged, or merely `noise`, that the ground truth does not name (any role: an
                offset-wrap victim, `overwritten`, is the drill's doing; except `unchanged`: a request
                the drill touched whose output it did not change)
  named         whether the first-ranked hypothesis' feature is one the drill's `named_by` accepts
                (`lpf.builtin.drill_catalog`)
  mechanism     per flagged request: does its own mechanism (findings' flagged[].mechanism) name what the
                ground truth's role says happened to it (`lpf.builtin.drill_truth.EXPECTED`; victims of
                another request's write included): the share, matched/flagged (issue 39: >= 95% each)
  tokens        scored tokens (arrival order: request seq, then position) up to the first flagged
                request's first divergence (its whole length when it has none: a request raised by
                the localized rule, so an upper bound there), and the run-level test's `tokens_needed`
  shrink        `lpf shrink` with its defaults (budget 60 runs): runs used, the minimum's size
                (requests, tokens), whether its repro.py exits 1 (and 0 with the drill off)
prefix-cache-inert is not a verdict: its row reports the run's prefix-cache finding and hit counts.

Configurations (the features that name each drill, and the prefix drills' knobs: `drill_catalog`):
  prefix drills  tiny:jamba-longmem, zoo:shared-prefix (1,000 requests), --max-tokens 8,
                 --max-num-batched-tokens 48, --cache-mb 3, --enable-prefix-caching
  stale-state    tiny:jamba-longmem, zoo:oracle --n 4 (2,000 requests), --cache-mb 3 --max-num-seqs 16
                 --max-num-batched-tokens 32 (the configuration issue 22 reports shrink stalling on)
  offset-wrap    `make demo`'s second audit: zoo:hybrid, zoo:oracle (500 requests), --inject offset-wrap:18
                 --cache-mb 4 (wrapped prefills and the victims of their stray writes)
  kv-double-free zoo:hybrid, zoo:oracle --n 2 (1,000 requests), --max-tokens 16 --cache-mb 2
                 --max-num-batched-tokens 64 (tests/test_engine_drills.py's: a KV block held by two requests)
  speculative    spec-prefill-verify, spec-accepted-permuted, spec-no-rollback (issue 43): tiny:jamba-longmem,
                 zoo:oracle --n 2 (1,000 requests), --max-tokens 24, -E speculative=ngram:K (SPEC_DRILLS);
                 spec-checkpoint-rejected on two turns with prefix caching; spec-draft-probs-permuted sampled
                 at temperature 1 with -E speculative=draft:zoo:llama:4 and 8 sequences at a time
  recurrent      the GDN drills (issue 54): tiny:qwen35-longmem, zoo:shared-prefix (1,000 requests), 8 tokens;
                 the speculative ones on MIXED with the target as its own draft (RECURRENT_DRILLS);
                 spec-state-before-accept on the trained zoo:qwen35, zoo:oracle --n 2, 32 tokens, n-gram K = 3
vLLM drills (`--engine vllm`): the plugin's prefix drills under `lpf.adapters.vllm_options.PREFIX_DRILL_KNOBS`
(prefix caching on, a step budget below the 128-token Mamba block), on tiny:hybrid-longmem (vLLM's CPU
build runs no Jamba), scored the same way with `PREFIX_DRILL_NAMED_BY`; `clean` (the same, no drill: the
false-positive control and the hit rate) and `prefix-cache-inert` (vLLM #48401's configuration, see
INERT_MAX_MODEL_LEN). `--vllm-set KNOB=VALUE` runs them in another configuration (bugs.json's
vllm.variants). `first_try` in bugs.json: over every drill row of both engines, is the first-ranked
hypothesis (for prefix-cache-inert: the run's finding) the right mechanism.

Usage: python bench/bugs.py [--quick] [--out runs/bench-bugs] [--drill NAME ...] [--no-shrink]
       [--shrink-budget RUNS] [--engine builtin|vllm] [--vllm-set KNOB=VALUE ...]
Writes bench/results/bugs.json (built-in rows under "results", vLLM's under "vllm"; a run of some drills
replaces those rows only; with --quick: OUT/quick/bugs_quick.json, never bench/results) and prints the
table. Runs are reused when complete (delete --out to start over).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODEL = "tiny:jamba-longmem"
PREFIX_ARGS = ["--max-tokens", "8", "--max-num-batched-tokens", "48", "--cache-mb", "3"]
STALE_ARGS = [
    "--workload",
    "zoo:oracle",
    "--n",
    "4",
    "--cache-mb",
    "3",
    "--max-num-seqs",
    "16",
    "--max-num-batched-tokens",
    "32",
]
# `make demo`'s offset-wrap audit: its model and cache (after MODEL on the command line: the last --model wins)
OFFSET_WRAP_ARGS = ["--model", "zoo:hybrid", "--workload", "zoo:oracle", "--cache-mb", "4"]
# tests/test_engine_drills.py's kv-double-free configuration (1,000 requests)
KV_DOUBLE_FREE_ARGS = [
    *["--model", "zoo:hybrid", "--workload", "zoo:oracle", "--n", "2", "--max-tokens", "16"],
    *["--cache-mb", "2", "--max-num-batched-tokens", "64"],
]
# speculative decoding (issue 43; `lpf.builtin.speculative_decode`): tiny:jamba-longmem on zoo:oracle --n 2 (1,000
# requests), greedy, 24 tokens; K = 8 for spec-prefill-verify (the addition prompts are 9 = 1 + K tokens),
# K = 4 for spec-no-rollback; spec-accepted-permuted: K = 2, 48 tokens (the untrained model's outputs
# repeat, so drafts get accepted and counts differ) and 8 sequences at a time (finished rows refilled:
# the persistent batch permuted)
SPEC_ARGS = ["--workload", "zoo:oracle", "--n", "2", "--max-tokens", "24"]
SPEC_DRILLS = {
    "spec-prefill-verify": [*SPEC_ARGS, "-E", "speculative=ngram:8"],
    "spec-accepted-permuted": ["--workload", "zoo:oracle", "--n", "2", "--max-tokens", "48"]
    + ["-E", "speculative=ngram:2", "--max-num-seqs", "8"],
    "spec-no-rollback": [*SPEC_ARGS, "-E", "speculative=ngram:4"],
    # two turns (TWOTURN: 500 oracle prompts, and 32 requests later each prompt + 20 of its greedy outputs),
    # so the second turn resumes from the checkpoints the first turn's verify steps saved; 16 sequences at
    # a time (the first turn done before the second is admitted)
    "spec-checkpoint-rejected": ["--workload", "TWOTURN", "--max-tokens", "24", "--ignore-eos"]
    + ["--enable-prefix-caching", "-E", "mamba_block_size=16", "-E", "speculative=ngram:4", "--max-num-seqs", "16"],
    # sampled at temperature 1 with a draft model's probabilities (zoo:llama drafts: the zoo's tokenizer),
    # 8 sequences at a time (finished rows refilled: the persistent batch permuted)
    "spec-draft-probs-permuted": [
        *SPEC_ARGS,
        *["--temperature", "1.0", "-E", "speculative=draft:zoo:llama:4", "--max-num-seqs", "8"],
    ],
}
# the recurrent-state drills (issue 54, family `recurrent`): tiny:qwen35-longmem (Gated DeltaNet; after MODEL on
# the command line: the last --model wins), zoo:shared-prefix (1,000 requests), 8 greedy tokens; the speculative
# ones on MIXED (every other request asks for 1 token, so never speculates) with the target as its own draft
# (K = 3), but spec-state-before-accept (below). state-fp16 changes every request (noise): the run-level test's.
GDN = ["--model", "tiny:qwen35-longmem"]
GDN_CHUNKED = [*GDN, "--workload", "SHARED", "--max-tokens", "8", "--max-num-batched-tokens", "64"]
GDN_SPEC = [*GDN, "--workload", "MIXED", "-E", "speculative=draft:tiny:qwen35-longmem:3"]
RECURRENT_DRILLS = {
    "chunk-state-transposed": GDN_CHUNKED,
    "padding-updates-state": GDN_CHUNKED,
    "snapshot-never-written": [*GDN, "--workload", "SHARED", "--max-tokens", "8", "--max-num-batched-tokens", "32"]
    + ["--enable-prefix-caching", "-E", "mamba_block_size=16"],
    "spec-verify-zero-state": GDN_SPEC,
    "spec-state-block-zero": GDN_SPEC,
    # up to a request's first harm this drill keeps the state where spec-state-block-zero does (the previous count
    # at a first verify is 0: block 0), so both harm the same requests at the same step; with the target as its
    # own draft and 6 tokens nothing follows that step, and its run was block-zero's token for token. Here the
    # trained GDN model (zoo:qwen35), n-gram drafts on zoo:oracle --n 2 (1,000 requests; copy answers repeat the
    # prompt, so drafts are kept and rejected and counts vary), 32 tokens: the steps after the first harm differ.
    "spec-state-before-accept": ["--model", "zoo:qwen35", *SPEC_ARGS[:4], "--max-tokens", "32"]
    + ["-E", "speculative=ngram:3"],
}
INJECT = {"offset-wrap": "offset-wrap:18"}  # a drill's --inject spec, where it takes an argument
VLLM_MODEL = "tiny:hybrid-longmem"  # the vLLM drills' model: vLLM's CPU build runs no Jamba


def lpf(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("lpf")), *map(str, args)], capture_output=True, text=True)


def drills(quick: bool) -> dict[str, tuple[list[str], set[str]]]:
    """drill -> (its audit's arguments, the hypothesis features that name it: `drill_catalog`'s named_by)."""
    from lpf.builtin.drill_catalog import CATALOG, PREFIX_CACHING, by_family

    args = {}
    for d in by_family("prefix"):
        extra = [a for k, v in d.knobs.items() for a in ("-E", f"{k}={v}")]
        caching = ["--enable-prefix-caching"] if PREFIX_CACHING in d.needs else []
        args[d.name] = ["--workload", "SHARED", *PREFIX_ARGS, *caching, *extra]
    args |= {"stale-state": STALE_ARGS, "offset-wrap": OFFSET_WRAP_ARGS, "kv-double-free": KV_DOUBLE_FREE_ARGS}
    args |= SPEC_DRILLS
    args |= RECURRENT_DRILLS
    out = {name: (a, set(CATALOG[name].named_by)) for name, a in args.items()}
    return {"stale-conv-on-reuse": out["stale-conv-on-reuse"]} if quick else out


# prefix-cache-inert on vLLM is a configuration, not a plugin drill: vLLM #48401's condition, the hybrid's
# block (raised to the Mamba page, 128 tokens here: platforms/interface.py:1094-1103) longer than
# max_model_len, so no request fills the one unit kv_cache_utils.py hashes (958, 979). Prompts of
# zoo:shared-prefix that fit (INERT_PROMPT_MAX tokens, + 8 output tokens <= INERT_MAX_MODEL_LEN).
INERT_MAX_MODEL_LEN = 120
INERT_PROMPT_MAX = INERT_MAX_MODEL_LEN - 8


def vllm_drills(overrides: dict[str, str] | None = None) -> dict[str, tuple[list[str], set[str]]]:
    """The plugin's drills, then `clean` (caching on, no drill: the false-positive control) and
    `prefix-cache-inert` (the #48401 configuration, on INERT, the workload of prompts that fit).
    `overrides` (--vllm-set): knobs replacing PREFIX_DRILL_KNOBS' (another configuration)."""
    from lpf.adapters.vllm_options import PREFIX_DRILL_KNOBS, PREFIX_DRILL_NAMED_BY

    values = {k: str(v).lower() for k, v in PREFIX_DRILL_KNOBS.items()} | (overrides or {})
    knobs = [a for k, v in values.items() for a in ("-E", f"{k}={v}")]
    plan = {
        d: (["--workload", "SHARED", "--max-tokens", "8", *knobs], named) for d, named in PREFIX_DRILL_NAMED_BY.items()
    }
    plan["clean"] = (["--workload", "SHARED", "--max-tokens", "8", *knobs], set())
    inert = ["-E", f"max_model_len={INERT_MAX_MODEL_LEN}"]
    plan["prefix-cache-inert"] = (["--workload", "INERT", "--max-tokens", "8", *knobs, *inert], set())
    return plan


def inert_workload(out: Path, n: int) -> Path:
    """The first `n` zoo:shared-prefix items whose prompt fits INERT_MAX_MODEL_LEN (tokenized as the
    audit will: the model's tokenizer, no template)."""
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.zoo import registry

    path = out / "shared-prefix-short.jsonl"
    if not path.is_file():
        tok = load_tokenizer(resolve_model(VLLM_MODEL))
        items = registry.workload_items("shared-prefix", n=int(n * 1.25))
        fit = [i for i in items if len(tok(i["prompt"])["input_ids"]) <= INERT_PROMPT_MAX][:n]
        path.write_text("".join(json.dumps(i) + "\n" for i in fit))
    return path


TWOTURN_LAG = 32


def two_turn_workload(out: Path, n: int) -> Path:
    """TWOTURN: `n` zoo:oracle prompts and, TWOTURN_LAG requests after each, the same prompt followed by 20
    of the tokens MODEL answers it with greedily (a plain `lpf run`, 24 tokens, EOS ignored: the audit's
    greedy first turn answers the same)."""
    import pyarrow.parquet as pq

    from lpf.zoo import registry

    path = out / "two-turn.jsonl"
    if path.is_file():
        return path
    items = registry.workload_items("oracle", n=n)
    first = out / "two-turn-first.jsonl"
    first.write_text("".join(json.dumps(i) + "\n" for i in items))
    run = out / "two-turn-first"
    if not (run / "requests").is_dir():  # a finished run is reused
        shutil.rmtree(run, ignore_errors=True)
        proc = lpf(
            *["run", "--engine", "builtin", "--model", MODEL, "--workload", first, "--max-tokens", "24"],
            *["--ignore-eos", "--out", run],
        )
        if proc.returncode != 0:
            raise SystemExit(f"the two-turn workload's first run failed:\n{proc.stderr[-2000:]}")
    req = pq.read_table(run / "requests").sort_by("seq").to_pylist()
    turn2 = [
        {"id": f"{r['prompt_id']}-t2", "prompt_token_ids": [*r["prompt_token_ids"], *r["output_token_ids"][:20]]}
        for r in req
    ]
    # each second turn LAG requests after its first (16 run at a time: the first has finished, and its
    # checkpoints are still cached)
    order = []
    for i, item in enumerate(items):
        order.append(item)
        if i >= TWOTURN_LAG:
            order.append(turn2[i - TWOTURN_LAG])
    order += turn2[len(items) - TWOTURN_LAG :]
    path.write_text("".join(json.dumps(i) + "\n" for i in order))
    return path


def mixed_workload(out: Path, n: int) -> Path:
    """MIXED: `n` zoo:shared-prefix items, every other one asking for 1 token (it never decodes, so never
    speculates: the requests the speculative recurrent drills leave whole), the rest for 6."""
    from lpf.zoo import registry

    path = out / "shared-prefix-mixed.jsonl"
    if not path.is_file():
        items = registry.workload_items("shared-prefix", n=n)
        path.write_text(
            "".join(json.dumps(dict(it, max_tokens=6 if i % 2 else 1)) + "\n" for i, it in enumerate(items))
        )
    return path


def audit(out: Path, drill: str, args: list[str], workloads: dict[str, Path], engine: str) -> float:
    """`drill` "clean" (and vLLM's prefix-cache-inert, a configuration): no --inject."""
    if (out / "findings.json").is_file():
        return 0.0
    args = [str(workloads[a]) if a in workloads else a for a in args]
    inject = (
        ["--inject", INJECT.get(drill, drill)]
        if not (drill == "clean" or (engine == "vllm" and drill == "prefix-cache-inert"))
        else []
    )
    t0 = time.perf_counter()
    proc = lpf(
        "audit",
        "--engine",
        engine,
        "--model",
        VLLM_MODEL if engine == "vllm" else MODEL,
        *args,
        *inject,
        "--out",
        out,
        "--fail-on",
        "never",
    )
    if proc.returncode != 0:
        raise SystemExit(f"audit of {drill} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def score(run: Path, named_by: set[str]) -> dict:
    from lpf.builtin.drill_truth import mechanism_share
    from lpf.views.query import run_query

    def q(sql):
        return run_query(run, sql)[1]

    findings = json.loads((run / "findings.json").read_text())
    has_faults = (run / "faults").is_dir()
    truth = (
        {r[0] for r in q("SELECT DISTINCT request_id FROM faults WHERE role = 'corrupted'")} if has_faults else set()
    )
    # anything the drill did to a request (an offset-wrap victim: `overwritten`) is not a false positive;
    # a request it touched without changing its output (`unchanged`) is
    touched = (
        {r[0] for r in q("SELECT DISTINCT request_id FROM faults WHERE role <> 'unchanged'")} if has_faults else set()
    )
    rows = q("SELECT request_id, seq, verdict, first_divergence, n_scored_tokens FROM summary ORDER BY seq")
    # an attempt its client cancelled mid-prefill (zoo:shared-prefix's cancel-and-resend) ends before its first
    # token and has no summary row: whatever a drill did to its state, nothing of it can be judged (counted apart)
    silent = truth - {r[0] for r in rows}
    truth -= silent
    flagged = {r[0] for r in rows if r[2] in ("divergent", "corrupt")}
    departed = {r[0] for r in rows if r[2] not in ("clean", "error", "unscored")}
    tokens, first = 0, None
    for _rid, _, verdict, fd, n in rows:
        if verdict in ("divergent", "corrupt"):
            first = tokens + (fd + 1 if fd is not None else n)
            break
        tokens += n or 0
    top = (findings.get("hypotheses") or [None])[0]
    pc = findings.get("prefix_cache") or {}
    events = q("SELECT request_id, fault, role FROM faults") if (run / "faults").is_dir() else []
    mech = mechanism_share(findings["flagged"], events)
    mech["misses"] = mech["misses"][:5]
    return {
        "requests": findings["n_requests"],
        "truth": len(truth),
        "truth_without_output": len(silent),
        "flagged": len(flagged),
        "recall": len(flagged & truth) / len(truth) if truth else None,
        "false_positives": len(departed - touched),
        "top_feature": top and top["feature"],
        "named": bool(top and top["feature"] in named_by),
        "top_sentence": top and top["sentence"],
        "mechanism": mech,
        "mechanisms_covered": [(c["feature"], c["n"]) for c in (findings.get("mechanisms") or {}).get("covered", [])],
        "tokens_to_first_flag": first,
        "run_test_tokens_needed": (findings.get("run_test") or {}).get("tokens_needed"),
        "prefix_cache": {
            k: pc.get(k)
            for k in (
                "finding",
                "inert",
                "requests_hit",
                "hit_tokens",
                "hit_rate",
                "requests_sharing",
                "requests_sharing_below_block",
            )
        },
    }


def shrink(run: Path, out: Path, drill: str, run_it: bool = True, budget: int | None = None) -> dict:
    """`run_it=False` (--no-shrink): only read a shrink already in `out` (finished or not)."""
    if not run_it and not (out / "shrink.json").is_file():
        return {}
    if run_it and (
        not (out / "shrink.json").is_file() or json.loads((out / "shrink.json").read_text()).get("status") == "running"
    ):
        t0 = time.perf_counter()
        done = lpf("shrink", run, "--out", out, "--json", *(["--budget-runs", budget] if budget else []))
        wall = time.perf_counter() - t0
        if done.returncode not in (0, 1):  # 1: the minimum reproduces; anything else stopped the shrink
            print(f"{drill}: lpf shrink exited {done.returncode}: {done.stderr.strip()[-400:]}", flush=True)
    else:
        wall = None
    doc = json.loads((out / "shrink.json").read_text())
    best = next((c for c in doc.get("candidates", []) if c["id"] == doc.get("best")), None)
    res = {
        "status": doc.get("status"),
        "runs_used": doc.get("runs_used"),
        "wall_s": wall,
        "size": (doc.get("minimal") or {}).get("size") or (best or {}).get("size"),
        "original_size": (doc.get("original") or {}).get("size"),
    }
    repro = out / "repro.py"
    if repro.is_file():
        res["repro_exit"] = run_repro(repro)
        off = repro.with_name("repro_off.py")
        text = repro.read_text()
        # the drill travels in the built-in config's options, or in the vLLM reproducer's environment
        # for the plugin (LPF_VLLM_INJECT)
        text_off = text.replace(f'"inject": "{drill}"', '"inject": ""').replace(
            f'"LPF_VLLM_INJECT": "{drill}"', '"LPF_VLLM_INJECT": ""'
        )
        if text_off == text:  # the drill is not where this check looks: no figure rather than a false one
            res["repro_off_exit"] = None
            res["repro_off_why"] = "the drill was not found in repro.py's config to turn it off"
        else:
            off.write_text(text_off)
            res["repro_off_exit"] = run_repro(off)
    return res


def run_repro(script: Path) -> int | str:
    """repro.py's exit status under the interpreter it needs (vLLM's own for a vLLM reproducer: the
    adapter's `.venv-vllm` beside the repo, or LPF_VLLM_PYTHON). A traceback also exits 1, the code
    for "the lie reproduces": then the answer is the error's last line, never 1."""
    python = sys.executable
    if '"engine": "vllm"' in script.read_text():
        from lpf.adapters.vllm import vllm_python

        python = str(vllm_python())
    proc = subprocess.run([python, str(script)], capture_output=True, text=True)
    if "Traceback (most recent call last)" in proc.stderr:
        return "error: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
    return proc.returncode


def table(results: dict) -> str:
    lines = [
        "| drill | requests | ground truth | recall | false pos. | top hypothesis names it | per-request mechanism "
        "matches truth | tokens to first flag (run test) | shrink: runs, minimum (requests, tokens), repro exit "
        "(drill off) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d, r in results.items():
        s = r.get("shrink") or {}
        shr = (
            f"{s.get('runs_used')} runs ({s.get('status')}), {s['original_size'][0]} -> {s['size'][0]} req / {s['size'][1]} tok, "
            f"repro {s.get('repro_exit', '-')} ({s.get('repro_off_exit', '-')})"
            if s.get("size")
            else (s.get("status") or "not run")
        )
        pc = r["prefix_cache"] or {}
        if d == "prefix-cache-inert":
            sharing = pc.get("requests_sharing") or pc.get("requests_sharing_below_block")
            unit = "16-token " if not pc.get("requests_sharing") and pc.get("requests_sharing_below_block") else ""
            lines.append(
                f"| {d} | {r['requests']} | finding: {pc['finding']} | - | {r['false_positives']} | "
                f"- ({pc['requests_hit']} hit, {sharing} share a {unit}block) | - | - | - |"
            )
            continue
        if d == "clean":
            lines.append(
                f"| clean, caching on | {r['requests']} | 0 | - | {r['false_positives']} | - "
                f"({pc.get('requests_hit')} hit, {pc.get('hit_rate') or 0:.1%} of prompt tokens) | - | - | - |"
            )
            continue
        recall = "-" if r["recall"] is None else f"{r['recall']:.3f}"
        m = r.get("mechanism") or {}
        mech = "-" if m.get("share") is None else f"{m['share']:.3f} ({m['matched']}/{m['flagged']})"
        lines.append(
            f"| {d} | {r['requests']} | {r['truth']} | {recall} | {r['false_positives']} | "
            f"{'yes' if r['named'] else 'no'} ({r['top_feature']}) | {mech} | {r['tokens_to_first_flag']} "
            f"({r['run_test_tokens_needed']}) | {shr} |"
        )
    return "\n".join(lines)


def first_try(sections: dict[str, dict]) -> dict:
    """First-try root cause over the whole class: per drill row (built-in and vLLM), is the first thing
    the run states the right mechanism (the top hypothesis for a lying drill; for prefix-cache-inert,
    the run's prefix-cache finding). Clean controls are not drills and are left out."""
    rows = {}
    for engine, results in sections.items():
        for d, r in results.items():
            if d == "clean":
                continue
            right = (
                (r["prefix_cache"] or {}).get("finding") == "prefix-cache-inert"
                if d == "prefix-cache-inert"
                else r["named"]
            )
            rows[f"{engine}:{d}"] = bool(right)
    n = len(rows)
    return {"rows": rows, "right": sum(rows.values()), "of": n, "rate": sum(rows.values()) / n if n else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one drill, 240 requests, no shrink (the test's smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-bugs")
    ap.add_argument("--drill", action="append", help="only these drills")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--shrink-budget", type=int, help="lpf shrink --budget-runs [default: shrink's own]")
    ap.add_argument("--engine", default="builtin", choices=("builtin", "vllm"))
    ap.add_argument(
        "--vllm-set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="another vLLM configuration: its rows go to bugs.json's vllm.variants, the table rows stay",
    )
    ap.add_argument("--results", type=Path, help="where the JSON goes (default bench/results/bugs[_quick].json)")
    a = ap.parse_args()
    from lpf.zoo import registry

    out = a.out / ("quick" if a.quick else "full")
    out.mkdir(parents=True, exist_ok=True)
    n = 240 if a.quick else 1000
    workload = out / "shared-prefix.jsonl"
    if not workload.is_file():
        items = registry.workload_items("shared-prefix", n=n)
        workload.write_text("".join(json.dumps(i) + "\n" for i in items))
    overrides = dict(kv.split("=", 1) for kv in a.vllm_set)
    variant = ",".join(f"{k}={v}" for k, v in overrides.items())
    if variant:
        out = out / variant.replace("=", "-").replace(",", "_")
        out.mkdir(parents=True, exist_ok=True)
    plan = vllm_drills(overrides) if a.engine == "vllm" else drills(a.quick)
    plan = {d: v for d, v in plan.items() if not a.drill or d in a.drill}
    workloads = {"SHARED": workload}
    if any("INERT" in args for args, _ in plan.values()):
        workloads["INERT"] = inert_workload(out, n)
    if any("MIXED" in args for args, _ in plan.values()):
        workloads["MIXED"] = mixed_workload(out, n)
    if any("TWOTURN" in args for args, _ in plan.values()):
        workloads["TWOTURN"] = two_turn_workload(out, n // 2)
    results = {}
    for d, (args, named_by) in plan.items():
        run = out / d
        wall = audit(run, d, args, workloads, a.engine)
        results[d] = {**score(run, named_by), "audit_s": wall}
        if results[d].get("flagged") == 0 and d not in ("prefix-cache-inert", "clean"):
            results[d]["shrink"] = {"status": "nothing flagged: nothing to shrink"}
        elif not (a.quick or d in ("prefix-cache-inert", "clean")):
            results[d]["shrink"] = shrink(run, out / f"{d}-shrink", INJECT.get(d, d), not a.no_shrink, a.shrink_budget)
        print(f"{d}: {json.dumps(results[d], default=str)}", flush=True)
    dest = a.results or (out / "bugs_quick.json" if a.quick else ROOT / "bench" / "results" / "bugs.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # one file for both engines: the built-in rows under "results", vLLM's under "vllm"; a run of some
    # drills replaces those rows only
    doc = json.loads(dest.read_text()) if dest.is_file() else {}
    if a.engine == "vllm":
        section = doc.setdefault("vllm", {})
        config = {
            "model": VLLM_MODEL,
            "knobs": vllm_drills(overrides)["clean"][0][4:],
            "inert_max_model_len": INERT_MAX_MODEL_LEN,
        }
        if variant:
            section = section.setdefault("variants", {}).setdefault(variant, {})
        section["results"] = {**section.get("results", {}), **results}
        section["config"] = config
    else:
        doc["results"] = {**doc.get("results", {}), **results}
        doc["config"] = {
            "model": MODEL,
            "prefix": PREFIX_ARGS,
            "stale_state": STALE_ARGS,
            "offset_wrap": [*OFFSET_WRAP_ARGS, "--inject", INJECT["offset-wrap"]],
            "kv_double_free": KV_DOUBLE_FREE_ARGS,
            "speculative": dict(SPEC_DRILLS),
        }
    doc["first_try"] = first_try({"builtin": doc.get("results", {}), "vllm": doc.get("vllm", {}).get("results", {})})
    from provenance import stamp  # bench/provenance.py, beside this script: the commit measured

    dest.write_text(json.dumps(stamp(doc), indent=1, default=str))
    print(table(results))
    ft = doc["first_try"]
    print(f"first-try root cause over the class: {ft['right']}/{ft['of']}", flush=True)


if __name__ == "__main__":
    main()
