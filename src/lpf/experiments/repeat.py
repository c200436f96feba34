"""`lpf repeat`: the determinism probe (the batch-invariance experiment).

Contract: the same prompt is generated `times` times at temperature 0, each copy under a different
batch composition: copy 0 runs alone, every other copy is submitted among a different number of
filler requests (random prompts of varied lengths and output budgets) at a different arrival
position, and, when the engine has a concurrency knob the user did not fix (`max_num_seqs`, or
`batch_size` for `hf`), under a different value of it. A server the user started (`--base-url`: the
`openai` route, or `llamacpp` reaching one) is varied only from the client side: the requests in flight
(`concurrency`, when not fixed), the requests co-batched with the probe and its place among them; its
own batch settings stay as the user set them, and the report says so (`varied`). A copy sent with one
request in flight runs alone as copy 0 does. A batch-invariant engine gives every copy the
same token ids AND bit-identical logprobs; anything else is reported as the number of unique
completions (token sequences; logprob vectors bit for bit and within a tolerance, since float32 GEMMs
already round differently for different row counts) and where the copies first diverge. The probe asks
for logprobs with one alternative (llama-server answers `logprobs: 0` with none); an answer without
logprobs (null or missing) makes the comparison tokens only (`compared`: "tokens"), never an error.

The conclusion (`batch_shape`, pure; the report's `batch_shape`): when copies sent among other
requests differ from the copy sent alone beyond the tolerance (or in their tokens) while copies sent
alone agree, the engine has a batch-shape dependence (its logprobs depend on what else is in the
batch), named with the server's knob that controls it where lpf knows one (`BATCH_SHAPE_KNOBS`:
llama-server's flash attention; recognised for `--engine llamacpp`, and behind an OpenAI-compatible
URL by its GET /props answer).

`plan_copies` is pure, as are `compare` and `batch_shape` (`lpf.experiments.repeat_verdict`); `run_repeat` drives the engine adapter in this process (one
engine per concurrency value) and writes `DIR/repeat.json`. It never writes a run directory and
never overwrites an earlier `repeat.json`.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lpf.core.errors import LpfError
from lpf.core.knobs import knob_with_role
from lpf.core.sampling import SamplingParams, request_seed
from lpf.core.workload import EngineRequest, load_prompts
from lpf.experiments.repeat_verdict import DEFAULT_TOLERANCE, batch_shape, compare

CONCURRENCY_CYCLE = (1, 2, 4, 8, 16, 32, 64)
FILLER_CYCLE = (3, 7, 12, 5, 15, 9, 2, 11)  # fillers per copy after copy 0 (which runs alone)


@dataclass(frozen=True)
class CopyPlan:
    copy: int
    concurrency: int | None  # value of the varied knob, None when the engine has none to vary
    n_fillers: int
    arrival: int  # index of the probe among the requests submitted with it


@dataclass
class CopyResult:
    copy: int
    request_id: str
    concurrency: int | None
    n_fillers: int
    arrival: int
    output_token_ids: list[int]
    logprobs: list[float] | None  # None: the server returned none (a tokens-only comparison)
    batch_sizes: list[int] | None = None  # batch size at every step the probe was scheduled (traced engines)
    alone: bool = False  # nothing else was in flight with the probe (no fillers, or one request at a time)
    tokens_group: int = 0
    logprobs_group: int = 0
    tolerance_group: int = 0
    max_abs_diff_vs_copy0: float | None = None


@dataclass
class RepeatSpec:
    engine: str
    model: str
    times: int
    max_tokens: int = 16
    seed: int = 0
    ignore_eos: bool = False
    engine_options: dict = field(default_factory=dict)
    prompt: str | None = None
    workload: str | None = None
    index: int = 0
    tolerance: float = DEFAULT_TOLERANCE


def concurrency_knob(options_cls, fixed: set[str]) -> str | None:
    """The engine knob varied across copies: the one whose role is concurrency (lpf.core.knobs), when
    the user left it free."""
    name = knob_with_role(options_cls, "concurrency")
    return name if name is not None and name not in fixed else None


def user_server(options) -> bool:
    """Whether the engine talks to a server the user started (its batch settings are not lpf's to vary)."""
    return bool(getattr(options, "base_url", ""))


def varied(options_cls, options, fixed: set[str]) -> dict:
    """What the copies vary: {knob, side ("engine": a knob of the engine lpf starts; "client": what a
    client of a server the user started can vary), sentence}."""
    if user_server(options):
        knob = "concurrency" if "concurrency" in options_cls.model_fields and "concurrency" not in fixed else None
        what = ("requests in flight (concurrency), " if knob else "") + "the requests sent with the probe and its place"
        return {
            "knob": knob,
            "side": "client",
            "sentence": f"a server you started: lpf varies only what a client can ({what} among them); the "
            f"server's own batch settings (slots, batch sizes, its KV cache) stay as you set them",
        }
    knob = concurrency_knob(options_cls, fixed)
    extra = f", and the engine's {knob}" if knob else ""
    return {
        "knob": knob,
        "side": "engine",
        "sentence": f"the requests sent with the probe, its place among them{extra}",
    }


def plan_copies(times: int, vary: bool) -> list[CopyPlan]:
    """Copy 0 alone; copy i > 0 among FILLER_CYCLE fillers, at a rotating arrival position, under a
    rotating concurrency, so no two copies share a batch history."""
    plans = []
    for i in range(times):
        n_fill = 0 if i == 0 else FILLER_CYCLE[(i - 1) % len(FILLER_CYCLE)] + (i - 1) // len(FILLER_CYCLE)
        arrival = 0 if i == 0 else (i * 5) % (n_fill + 1)
        conc = CONCURRENCY_CYCLE[i % len(CONCURRENCY_CYCLE)] if vary else None
        plans.append(CopyPlan(i, conc, n_fill, arrival))
    return plans


def server_kind(engine: str, options) -> str | None:
    """The server behind the engine, where lpf can tell: llama-server for `llamacpp`, or for an
    OpenAI-compatible URL whose GET /props answers with llama-server's `build_info`."""
    if engine == "llamacpp":
        return "llama-server"
    base = getattr(options, "base_url", None)
    if not base:
        return None
    import httpx

    try:
        props = httpx.get(base.rstrip("/").removesuffix("/v1") + "/props", timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        return None
    return "llama-server" if isinstance(props, dict) and "build_info" in props else None


def _fillers(copy: int, n: int, seed: int, vocab: list[int], max_tokens: int, context: int | None):
    """n filler (prompt ids, max_tokens) pairs: varied lengths so batches differ in shape too."""
    rng = random.Random(f"{seed}:{copy}")
    out = []
    for _ in range(n):
        length = rng.randint(2, 48)
        budget = rng.randint(1, 2 * max_tokens)
        if context is not None:
            length = max(1, min(length, context - budget - 1))
        out.append(([rng.choice(vocab) for _ in range(length)], budget))
    return out


def _prompt_ids(spec: RepeatSpec, tokenizer, cfg: dict) -> tuple[tuple[int, ...], str | None]:
    if (spec.prompt is None) == (spec.workload is None):
        raise LpfError("give exactly one of --prompt TEXT or --workload FILE (with --index I)")
    context = cfg.get("max_position_embeddings")
    if spec.prompt is not None:
        if not spec.prompt:
            raise LpfError("--prompt is empty")
        ids = tuple(tokenizer.encode(spec.prompt))
        if context is not None and len(ids) + spec.max_tokens > context:
            raise LpfError(f"prompt of {len(ids)} tokens + max_tokens {spec.max_tokens} exceeds the context {context}")
        return ids, spec.prompt

    prompts, _ = load_prompts(spec.workload, tokenizer, cfg.get("vocab_size", len(tokenizer)), context)
    if not 0 <= spec.index < len(prompts):
        raise LpfError(
            f"--index {spec.index} is out of range: {spec.workload} has {len(prompts)} prompts (0..{len(prompts) - 1})"
        )
    return prompts[spec.index].prompt_token_ids, None


def run_repeat(spec: RepeatSpec, out: Path, on_start=lambda total: None, tick=lambda n: None) -> dict:
    """Generate the copies, compare them, write `out/repeat.json`; returns what it wrote."""
    from lpf.adapters import get_engine_class
    from lpf.core.model_specs import load_tokenizer, resolve_model
    from lpf.pipeline import model_config

    if spec.times < 2:
        raise LpfError(f"--times must be >= 2 (copies to compare), got {spec.times}")
    target = Path(out) / "repeat.json"
    if target.exists():
        raise LpfError(f"{target} already exists: choose another --out")
    engine_cls = get_engine_class(spec.engine)
    base_opts = engine_cls.Options.parse(spec.engine_options)  # unknown knobs refused before any work
    vary = varied(engine_cls.Options, base_opts, {k.replace("-", "_") for k in spec.engine_options})
    knob = vary["knob"]
    model = resolve_model(spec.model)
    cfg = model_config(model)
    engine_cls.check_model(cfg)
    tokenizer = load_tokenizer(model)
    prompt_ids, prompt_text = _prompt_ids(spec, tokenizer, cfg)
    sampling = SamplingParams(
        temperature=0.0, max_tokens=spec.max_tokens, seed=spec.seed, ignore_eos=spec.ignore_eos, logprobs=1
    )
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(cfg.get("vocab_size", len(tokenizer))) if i not in special]
    plans = plan_copies(spec.times, knob is not None)

    on_start(spec.times)
    results: list[CopyResult] = []
    by_conc: dict[int | None, list[CopyPlan]] = {}
    for p in plans:
        by_conc.setdefault(p.concurrency, []).append(p)
    describe = None
    for conc, group in by_conc.items():
        opts = base_opts if conc is None else engine_cls.Options.parse({**spec.engine_options, knob: conc})
        engine = engine_cls(model, sampling, opts)
        describe = describe or engine.describe()
        try:
            for p in group:
                r = _run_copy(engine, p, prompt_ids, spec, vocab, cfg)
                r.alone = p.n_fillers == 0 or (vary["side"] == "client" and p.concurrency == 1)
                results.append(r)
                tick(1)
        finally:
            engine.close()
    results.sort(key=lambda r: r.copy)
    cmp = compare([(r.output_token_ids, r.logprobs) for r in results], spec.tolerance)
    ref_toks, ref_lps = results[0].output_token_ids, results[0].logprobs
    for r, tg, lg, og in zip(results, cmp["tokens_group"], cmp["logprobs_group"], cmp["tolerance_group"]):
        r.tokens_group, r.logprobs_group, r.tolerance_group = tg, lg, og
        shared = 0
        while shared < min(len(r.output_token_ids), len(ref_toks)) and r.output_token_ids[shared] == ref_toks[shared]:
            shared += 1
        if cmp["compared"] == "tokens and logprobs":
            pairs = zip(r.logprobs[:shared], ref_lps[:shared])
            r.max_abs_diff_vs_copy0 = max((abs(a - b) for a, b in pairs), default=0.0)
    copies = [asdict(r) for r in results]
    report = {
        "kind": "repeat",
        "engine": spec.engine,
        "engine_describe": describe,
        "model": spec.model,
        "varied_knob": knob,
        "varied": vary,
        "compared": cmp["compared"],
        "times": spec.times,
        "max_tokens": spec.max_tokens,
        "seed": spec.seed,
        "ignore_eos": spec.ignore_eos,
        "prompt_text": prompt_text,
        "prompt_token_ids": list(prompt_ids),
        "workload": spec.workload,
        "index": spec.index if spec.workload else None,
        "unique_token_sequences": cmp["unique_token_sequences"],
        "unique_logprob_vectors": cmp["unique_logprob_vectors"],
        "unique_logprob_vectors_at_tolerance": cmp["unique_logprob_vectors_at_tolerance"],
        "tolerance": spec.tolerance,
        "bitwise_identical": None if cmp["unique_logprob_vectors"] is None else cmp["unique_logprob_vectors"] == 1,
        "first_divergence": cmp["first_divergence"],
        "max_logprob_spread": cmp["max_logprob_spread"],
        "batch_shape": batch_shape(copies, spec.tolerance, server_kind(spec.engine, base_opts)),
        "copies": copies,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(".tmp-repeat.json")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(target)
    return report


def _run_copy(engine, plan: CopyPlan, prompt_ids, spec: RepeatSpec, vocab: list[int], cfg: dict) -> CopyResult:
    probe_id = f"probe-{plan.copy}"
    fillers = _fillers(plan.copy, plan.n_fillers, spec.seed, vocab, spec.max_tokens, cfg.get("max_position_embeddings"))
    reqs = [
        EngineRequest(
            f"filler-{plan.copy}-{j}", 0, f"filler-{j}", 0, tuple(ids), budget, request_seed(spec.seed, 1 + j)
        )
        for j, (ids, budget) in enumerate(fillers)
    ]
    # every copy gets the same per-request seed: only the batch around it changes
    reqs.insert(
        plan.arrival,
        EngineRequest(probe_id, 0, "probe", 0, tuple(prompt_ids), spec.max_tokens, request_seed(spec.seed, 0)),
    )
    reqs = [
        EngineRequest(r.request_id, k, r.prompt_id, 0, r.prompt_token_ids, r.max_tokens, r.seed)
        for k, r in enumerate(reqs)
    ]
    probe = None
    for c in engine.generate(reqs):
        if c.request_id == probe_id:
            probe = c
    if probe is None or probe.error is not None:
        raise LpfError(
            f"copy {plan.copy}: the engine did not complete the probe "
            f"({probe.error if probe is not None else 'no completion'})"
        )
    batch_sizes = None
    trace = engine.side_tables().get("trace")
    if trace is not None:
        rows = [r for r in trace.to_pylist() if r["request_id"] == probe_id and not r["preempted"]]
        batch_sizes = [r["batch_size"] for r in sorted(rows, key=lambda r: r["step"]) if r["batch_size"] is not None]
        batch_sizes = batch_sizes or None  # a server that does not say its batch sizes (llama-server)
    return CopyResult(
        plan.copy,
        probe_id,
        plan.concurrency,
        plan.n_fillers,
        plan.arrival,
        list(probe.output_token_ids),
        _logprobs(probe.logprobs),
        batch_sizes,
    )


def _logprobs(values) -> list[float] | None:
    """The probe's logprobs, None when the server returned none for some token (a tokens-only comparison)."""
    if values is None or any(v is None for v in values):
        return None
    return [float(v) for v in values]
