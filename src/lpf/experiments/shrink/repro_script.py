"""Standalone reproducer written by `lpf shrink` (this file is its template; `CONFIG` is filled in).

It needs only the engine and transformers: for the built-in engine, `lpf.builtin` (the engine
itself) and transformers; for vLLM, vLLM's own interpreter (vllm and transformers; with a drill on,
the lpf-vllm-trace plugin installed there, armed through a private LPF_VLLM_TRACE_DIR, exit 2 when
it is not) and nothing of lpf. It sends the minimal requests, in order, to the engine with the
minimal knobs, re-scores the target request's exact tokens with transformers (one teacher-forced
pass), prints the first output position where the two disagree with both logprobs, and exits 1 when
the lie reproduces (the target diverges in the same place as while shrinking: at its first output
token, or later), 0 when it does not, 2 when it cannot run. A position diverges as in lpf's
verdicts: |engine - reference| logprob above the divergence threshold, a greedy flip, or a token the
engine was sure of and the reference finds improbable; with the built-in engine speculating at a
temperature, also a rejection-sampler decision (a draft kept with probability min(1, p/q), or rejected)
that the reference's distribution makes improbable, alone or with the target's others (lpf's decision
test on this request: `DECISION_ALPHA`), its decisions printed as a table.

A crash's reproducer (`CONFIG["crash"]`: the shrink's signature was an exception, not a lie) sends
the same requests and exits 1 when the engine raises the same exception type from the same innermost
frame (file and function), 0 when it runs through or raises something else.

Usage: python repro.py [--model DIR]   (DIR: the model directory, if it moved)
"""

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass

CONFIG = None  # lpf shrink writes the reproducer's data here


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters the built-in engine reads (the fields of lpf.core.sampling.SamplingParams)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 32
    seed: int = 0
    ignore_eos: bool = False
    logprobs: int = 5
    prompt_logprobs: bool = False  # the reproducer judges output positions only; kept so a run's sampling loads
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# the built-in engine's sampled verify steps of the target (drafts, their q, how many were kept)
VERIFY_ROWS: list = []
DECISION_ALPHA = 1e-6  # as lpf's decision test: half for single decisions, half for them together


def generate_builtin(cfg: dict, model_dir: str):
    """(target's output ids, their logprobs, engine description) from lpf's built-in engine."""
    import torch
    from transformers import AutoTokenizer

    from lpf.builtin.config import EngineConfig
    from lpf.builtin.faults import FaultSet
    from lpf.builtin.llm_engine import LLMEngine
    from lpf.builtin.request import Request

    torch.set_num_threads(max(1, cfg.get("threads") or 1))
    engine = LLMEngine(model_dir, EngineConfig(**cfg["engine_config"]), FaultSet.parse(cfg["inject"]))
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    sampling = Sampling(**cfg["sampling"])
    done, cancelled = {}, {}  # cancelled: a first attempt the client cancels mid-prefill, then resends
    for i, r in enumerate(cfg["requests"]):
        rid = r["id"]
        if r.get("abort_after_tokens"):
            rid = f"{r['id']}~attempt0"
            cancelled[rid] = (i, r)
            engine.cancel_after(rid, r["abort_after_tokens"])
        rejected = engine.add_request(
            Request(rid, list(r["prompt_token_ids"]), sampling, r["max_tokens"], r["seed"], eos, seq=i)
        )
        if rejected is not None:
            done[rejected.request_id] = rejected
    while engine.has_unfinished():
        for req in engine.step():
            first = cancelled.pop(req.request_id, None)
            if first is not None and req.error is not None:
                i, r = first
                again = Request(r["id"], list(r["prompt_token_ids"]), sampling, r["max_tokens"], r["seed"], eos, seq=i)
                rejected = engine.add_request(again)
                if rejected is not None:
                    done[rejected.request_id] = rejected
                continue
            done[first[1]["id"] if first else req.request_id] = req
    target = done[cfg["target"]]
    if target.error:
        print(f"error: the engine could not run the target: {target.error}", file=sys.stderr)
        sys.exit(2)
    VERIFY_ROWS.extend(
        row
        for row in engine._trace
        if row.get("request_id") == cfg["target"] and row.get("spec_sampled") and row.get("draft_token_ids")
    )
    return target.output_token_ids, target.logprobs, f"lpf built-in engine, {json.dumps(engine.describe())}"


def generate_vllm(cfg: dict, model_dir: str):
    """(target's output ids, their logprobs, engine description) from vllm.LLM."""
    drill = cfg["env"].get("LPF_VLLM_INJECT")
    # exactly this reproducer's settings: a caller's own LPF_VLLM_* must not switch a drill on or off
    for key in ("LPF_VLLM_INJECT", "LPF_VLLM_TRACE_DIR"):
        os.environ.pop(key, None)
    os.environ.update(cfg["env"])
    if drill:
        # lpf-vllm-trace arms its drills only while it records (LPF_VLLM_TRACE_DIR): a private directory
        trace_dir = tempfile.mkdtemp(prefix="repro-vllm-trace-")
        atexit.register(shutil.rmtree, trace_dir, True)  # registered first, so it runs after the plugin's flush
        os.environ["LPF_VLLM_TRACE_DIR"] = trace_dir
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = dict(cfg["engine_args"], model=model_dir)
    llm = LLM(**args)
    if drill:
        check_drill(drill)
    s = cfg["sampling"]
    params = [
        SamplingParams(
            n=1,
            temperature=s["temperature"],
            top_p=s["top_p"],
            top_k=s["top_k"] or 0,
            seed=r["seed"],
            max_tokens=r["max_tokens"],
            ignore_eos=s["ignore_eos"],
            logprobs=max(1, s["logprobs"]),
        )
        for r in cfg["requests"]
    ]
    prompts = [TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])) for r in cfg["requests"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    index = [r["id"] for r in cfg["requests"]].index(cfg["target"])
    out = outs[index].outputs[0]
    ids = [int(t) for t in out.token_ids]
    lps = [float(out.logprobs[p][t].logprob) for p, t in enumerate(ids)]
    return ids, lps, f"vLLM {vllm.__version__}, engine args {json.dumps(args)}"


def check_drill(drill: str) -> None:
    """Exit 2 unless lpf-vllm-trace armed the drill in this process (vLLM runs in-process here): without
    it the engine runs its fixed code and a clean result would say nothing about the lie."""
    try:
        import lpf_vllm_trace
    except ImportError:
        print(
            f"error: the {drill} drill lives in lpf-vllm-trace, which is not installed in this Python "
            f"(from an lpf checkout: {sys.executable} -m pip install ./plugins/vllm-trace)",
            file=sys.stderr,
        )
        sys.exit(2)
    status = lpf_vllm_trace.status()
    if not status.get("recording"):
        print(f"error: lpf-vllm-trace did not arm the {drill} drill: {status.get('why')}", file=sys.stderr)
        sys.exit(2)


def rescore(model_dir: str, dtype: str, prompt: list, output: list):
    """Per output position: the reference's logprob of the engine's token, its argmax and that logprob."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    top = rows.argmax(dim=-1)
    RAW_LOGITS.append(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)])
    return (
        [float(rows[p, t]) for p, t in enumerate(output)],
        [int(t) for t in top],
        [float(rows[p, t]) for p, t in enumerate(top)],
    )


RAW_LOGITS: list = []  # the reference's raw logits at the target's output positions (rescore's)


def decisions(cfg: dict, prompt_len: int) -> list[tuple[int, str, int, float, float]]:
    """The target's rejection-sampler decisions under the reference's distribution (after the run's
    temperature, top-k and top-p): (output position, kept|rejected, draft, q, the decision's probability
    min(1, p/q) or 1 - min(1, p/q)). Empty unless the built-in engine speculated with sampling."""
    if not VERIFY_ROWS or not RAW_LOGITS:
        return []
    from lpf.builtin.sampler import processed_logits

    s, z = cfg["sampling"], RAW_LOGITS[0]
    out = []
    for row in VERIFY_ROWS:
        drafts, kept = row["draft_token_ids"], row["num_accepted_tokens"]
        q = row.get("draft_token_probs") or [1.0] * len(drafts)
        start = row["num_computed_tokens"] + row["num_scheduled_tokens"] - len(drafts) - prompt_len
        for i, d in enumerate(drafts[: kept + 1]):
            pos = start + i
            if kept is None or pos < 0 or pos >= z.shape[0]:
                break
            p = float(processed_logits(z[pos], s["temperature"], s["top_k"], s["top_p"]).softmax(-1)[d])
            a = min(1.0, p / q[i]) if q[i] > 0 else 0.0
            out.append((pos, "kept" if i < kept else "rejected", d, q[i], a if i < kept else 1.0 - a))
    return out


def decision_lie(found: list) -> int | None:
    """The output position of the lie the decisions show (lpf's rule on this request alone: one
    decision at most DECISION_ALPHA / 2 / their count, or Fisher over those under 1/2 at most
    DECISION_ALPHA / 2), None when they show none."""
    import math

    if not found:
        return None
    worst = min(found, key=lambda f: f[4])
    if worst[4] <= DECISION_ALPHA / 2 / len(found):
        return worst[0]
    x = -sum(math.log(max(f[4], 1e-300)) for f in found if f[4] < 0.5)
    terms = [i * math.log(x) - math.lgamma(i + 1) - x for i in range(len(found))] if x > 0 else [0.0]
    top = max(terms)
    p = math.exp(top) * sum(math.exp(v - top) for v in terms)
    return worst[0] if p <= DECISION_ALPHA / 2 else None


def first_divergence(cfg: dict, output, engine_lps, ref_lps, top_ids, top_lps):
    th, greedy = cfg["thresholds"], cfg["sampling"]["temperature"] == 0
    for p, tok in enumerate(output):
        eng, ref = engine_lps[p], ref_lps[p]
        flip = greedy and top_ids[p] != tok and top_lps[p] - ref > th["tie_margin"]
        lie = eng >= th["confident_logprob"] and ref <= th["improbable_logprob"]
        if abs(eng - ref) > th["divergent_abs_diff"] or flip or lie:
            return p
    return None


def innermost(e: BaseException):
    """(exception type name, innermost frame's file relative to its package, function, line)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return type(e).__name__, None, None, None
    f = frames[-1]
    path = f.filename
    for root in ("site-packages/", "dist-packages/", "/src/"):
        if root in path:
            path = path.rsplit(root, 1)[1]
    return type(e).__name__, path.lstrip("/"), f.name, f.lineno


def crash_main(cfg: dict, generate, model_dir: str) -> int:
    want = cfg["crash"]
    words = f"{want['exception']} raised at {want['file']}:{want['line']} in {want['function']}"
    print(f"{len(cfg['requests'])} requests; expecting the crash {words}")
    try:
        generate(cfg, model_dir)
    except Exception as e:  # noqa: BLE001 - the crash is what this reproducer looks for
        chain, seen = [], e
        while seen is not None and len(chain) < 8:  # the exception and what it was raised from
            chain.append(innermost(seen))
            seen = seen.__cause__ or seen.__context__
        for exc, path, func, line in chain:
            same_type = exc == want["exception"].rsplit(".", 1)[-1]
            if same_type and (want["file"] is None or (path == want["file"] and func == want["function"])):
                print(f"the crash reproduces: {exc}: {' '.join(str(e).split())[:300]} at {path}:{line} in {func}")
                return 1
        exc, path, func, line = chain[0]
        print(f"the engine raised another error: {exc} at {path}:{line} in {func}: not the same crash")
        return 0
    print("no crash: the engine ran every request")
    return 0


def main() -> int:
    cfg = CONFIG
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=cfg["model_dir"], help="the model directory [default: %(default)s]")
    model_dir = ap.parse_args().model
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        print(f"error: {model_dir} is not a model directory (no config.json): pass --model DIR", file=sys.stderr)
        return 2
    generate = generate_builtin if cfg["engine"] == "builtin" else generate_vllm
    if cfg.get("crash"):
        return crash_main(cfg, generate, model_dir)
    output, engine_lps, engine_words = generate(cfg, model_dir)
    request = next(r for r in cfg["requests"] if r["id"] == cfg["target"])
    prompt = list(request["prompt_token_ids"])
    ref_lps, top_ids, top_lps = rescore(model_dir, cfg["reference_dtype"], prompt, output)
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = lambda t: json.dumps(tok.decode([t]))  # noqa: E731
    print(f"engine: {engine_words}")
    print(f"reference: transformers {transformers.__version__}, torch {torch.__version__}, {cfg['reference_dtype']}")
    print(
        f"{len(cfg['requests'])} requests; target {cfg['target']}: {len(prompt)} prompt tokens, "
        f"{len(output)} output tokens"
    )
    print(f"{'pos':>4}  {'token':<16} {'engine lp':>10} {'reference lp':>13} {'|diff|':>8}  reference top-1")
    for p, t in enumerate(output):
        print(
            f"{p:>4}  {text(t) + ' #' + str(t):<16} {engine_lps[p]:>10.4f} {ref_lps[p]:>13.4f} "
            f"{abs(engine_lps[p] - ref_lps[p]):>8.4f}  {text(top_ids[p])} #{top_ids[p]} ({top_lps[p]:.4f})"
        )
    p = first_divergence(cfg, output, engine_lps, ref_lps, top_ids, top_lps)
    found = decisions(cfg, len(prompt))
    if found:
        print(f"{'pos':>4}  {'decision':<9} {'draft':>6} {'q(draft)':>9} {'its probability':>16}")
        for pos, what, d, q, b in found:
            print(f"{pos:>4}  {what:<9} {d:>6} {q:>9.4g} {b:>16.4g}")
        at = decision_lie(found)
        if at is not None and (p is None or at < p):
            print(f"the rejection sampler's decisions are a lie at output position {at} (see above)")
            p = at
    want = cfg["position_class"]
    if p is None:
        print("no divergence: the lie does not reproduce")
        return 0
    print(
        f"first divergence at output position {p}: engine logprob {engine_lps[p]:.4f}, reference logprob "
        f"{ref_lps[p]:.4f} (|diff| {abs(engine_lps[p] - ref_lps[p]):.4f}) for token {text(output[p])} #{output[p]}"
    )
    got = "first-token" if p == 0 else "later"
    if got != want:
        print(
            f"it diverges, but the lie began {'at the first output token' if want == 'first-token' else 'later'} "
            f"while shrinking: not the same lie"
        )
        return 0
    print("the lie reproduces")
    return 1


if __name__ == "__main__":  # vLLM may spawn processes that re-import this file: work only under the guard
    if CONFIG is None:
        print(
            "error: this is lpf shrink's template; `lpf shrink` writes a filled-in copy as DIR/repro.py",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(main())
