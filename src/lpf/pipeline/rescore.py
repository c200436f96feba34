"""The rescore stage: the reference teacher-forced over every completed, not-yet-scored request.

Resumable (a request is scored iff it has reference rows; an answer whose tokens could not be recovered
from its text, `retokenized` in its inconsistency, is never scored: the ids are not the server's, and
it stays `unscored` with its reason), scores the prompt positions of every request
whose engine returned prompt logprobs in the same pass (`prompt_reference/`, committed with its
reference part), refuses a reference with another tokenizer
(ids would not mean the same text) and a silent switch of reference (`--redo` replaces the scores).
The reference is the one `--reference` names (`lpf.pipeline.reference_http.reference_form`): a model,
scored by transformers here, a server (a trusted deployment `http(s)://...`, or the audited server
itself, `self`), scored by `lpf.pipeline.reference_http` in this process, or vLLM in its reference
configuration (`vllm:MODEL`, `-R` knobs: `lpf.pipeline.reference_vllm`), output and prompt positions
alike; the manifest's `reference` block says which (`kind`) and how. For transformers,
two executors write the same `reference/` parts through `RunDir.append`: `local` (one `Rescorer` in
this process) and `ray` (`lpf.pipeline.rescore_ray`: an actor pool of rescorers on Ray Data, the
parts committed by this process). Both pack batches with `lpf.pipeline.batch_plan.plan_batches`. Prompt
positions are scored by the local executor only (a run with prompt logprobs is refused by `ray`), and so
is the seeded replay (`lpf.pipeline.replay`: sampled runs of an engine whose sampler lpf knows), committed in
`seeded/` with its reference part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from lpf.core.errors import LpfError
from lpf.core.model_specs import load_tokenizer, resolve_model
from lpf.pipeline.callbacks import OnStart, Tick, no_start, no_tick
from lpf.pipeline.reference_http import reference_form
from lpf.run.store import RunDir, read_part


EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide the Ray executor runs: `address` None starts a local Ray instance."""

    address: str | None = None
    actors: int = 1
    gpus_per_actor: float = 0.0


@dataclass(frozen=True)
class RescoreSettings:
    """How a run is rescored (the `lpf rescore` / `lpf audit` options)."""

    reference: str | None = None
    dtype: str = "float32"
    token_budget: int = 16384
    device: str = "cpu"
    executor: str = "local"
    ray: RayOptions = field(default_factory=RayOptions)
    # an http(s):// or self reference (`lpf.pipeline.reference_http`): the served name, requests in flight
    reference_model: str | None = None
    reference_concurrency: int | None = None
    # a vllm:MODEL reference (`lpf.pipeline.reference_vllm`): its -R KEY=VALUE knobs
    reference_option: tuple[str, ...] = ()

    def validate(self) -> None:
        from lpf.pipeline.reference_http import check_settings

        check_settings(
            self.reference, self.reference_model, self.reference_concurrency, self.executor, self.reference_option
        )
        if reference_form(self.reference) == "vllm":  # its dtype too, before the run
            from lpf.pipeline.reference_vllm import engine_options, reference_options

            engine_options(self.dtype, reference_options(self.reference_option))
        if self.executor not in EXECUTORS:
            raise LpfError(f"unknown executor {self.executor!r}; choose from {', '.join(EXECUTORS)}")
        if self.token_budget < 1:
            raise LpfError(f"--token-budget must be >= 1, got {self.token_budget}")
        if self.ray.actors < 1:
            raise LpfError(f"--actors must be >= 1, got {self.ray.actors}")
        if self.ray.gpus_per_actor < 0:
            raise LpfError(f"--gpus-per-actor must be >= 0, got {self.ray.gpus_per_actor}")
        if self.executor == "local" and (self.ray != RayOptions()):
            raise LpfError("--ray-address, --actors and --gpus-per-actor need --executor ray")
        if self.executor == "ray":
            from lpf.pipeline.rescore_ray import require_ray

            require_ray()
        if self.executor == "ray" and self.device.startswith("cuda") and not self.ray.gpus_per_actor:
            raise LpfError(
                f"--reference-device {self.device} with --executor ray needs --gpus-per-actor "
                f"(Ray hides GPUs from actors that did not ask for one)"
            )


def unscored_requests(run: RunDir) -> tuple[pa.Table, int, int]:
    """(request_id, part (index into run.parts("requests")), n_prompt, n_output of every completed
    request with outputs and no reference rows yet; total output tokens of the run's scorable
    requests; how many of them are scored), read part by part without keeping any token ids."""
    done = run.read("reference", ["request_id"]).column("request_id").unique()
    pieces, total = [], 0
    for i, path in enumerate(run.parts("requests")):
        t = read_part(
            path, "requests", ["request_id", "prompt_token_ids", "output_token_ids", "error", "inconsistency"]
        )
        n_out = pc.list_value_length(t.column("output_token_ids")).fill_null(0)
        recovered = pc.invert(pc.fill_null(pc.match_substring(t.column("inconsistency"), "retokenized:"), False))
        no_error = pc.and_(pc.is_null(t.column("error")), recovered)
        total += pc.sum(pc.if_else(no_error, n_out, 0)).as_py() or 0
        keep = pc.and_(
            pc.and_(no_error, pc.greater(n_out, 0)), pc.invert(pc.is_in(t.column("request_id"), value_set=done))
        )
        n = pc.sum(keep.cast(pa.int64())).as_py() or 0
        pieces.append(
            pa.table(
                {
                    "request_id": t.column("request_id").filter(keep),
                    "part": pa.array([i] * n, pa.int32()),
                    "n_prompt": pc.list_value_length(t.column("prompt_token_ids"))
                    .fill_null(0)
                    .filter(keep)
                    .cast(pa.int32()),
                    "n_output": n_out.filter(keep).cast(pa.int32()),
                }
            )
        )
    pending = (
        pa.concat_tables(pieces)
        if pieces
        else pa.table(
            {
                "request_id": pa.array([], pa.string()),
                "part": pa.array([], pa.int32()),
                "n_prompt": pa.array([], pa.int32()),
                "n_output": pa.array([], pa.int32()),
            }
        )
    )
    return pending, total, total - (pc.sum(pending.column("n_output")).as_py() or 0)


def rescore_run(
    run: RunDir,
    reference: str | None = None,
    dtype: str = "float32",
    token_budget: int = 16384,
    redo: bool = False,
    on_start: OnStart = no_start,
    tick: Tick = no_tick,
    settings: RescoreSettings | None = None,
) -> None:
    """Teacher-force the reference over every completed, not-yet-scored request. `settings`, when
    given, replaces reference/dtype/token_budget (and adds the device and the executor)."""
    s = settings or RescoreSettings(reference=reference, dtype=dtype, token_budget=token_budget)
    s.validate()
    with run.writer():  # one writer at a time: a second rescore of the same run waits or is refused
        _rescore(run, s, redo, on_start, tick)


def _rescore(run: RunDir, s: RescoreSettings, redo: bool, on_start: OnStart, tick: Tick) -> None:
    m = run.manifest
    if s.executor == "ray" and run.has("prompt_tokens"):  # the actors score output positions only
        raise LpfError(
            f"{run.path} has prompt logprobs (--prompt-logprobs): rescore it with "
            f"--executor local, which scores prompt positions in the same pass"
        )
    spec = s.reference or m["model"]["spec"]
    form = reference_form(spec)
    dtype = s.dtype if form in ("transformers", "vllm") else None  # a server computes in its own dtype
    prev = m.get("reference")
    if run.has("reference") and prev and (prev.get("spec"), prev.get("dtype")) != (spec, dtype) and not redo:
        raise LpfError(
            f"{run.path} was rescored with {prev.get('spec')} ({prev.get('dtype')}); "
            f"pass --redo to replace those scores"
        )
    topk = m["sampling"].get("logprobs", 5)
    if form != "transformers":
        rescorer = prompt_reference(m, spec, s, topk)
        _start(run, redo, rescorer.describe())
        try:
            _score_local(run, rescorer, on_start, tick)
        finally:  # what it cost, failed requests included
            m["reference"] = {**rescorer.describe(), "executor": "local"}
            run.save_manifest()
        return
    model = resolve_model(spec)
    if s.executor == "local":
        from lpf.pipeline.reference import Rescorer

        from lpf.pipeline.replay import replay_for

        replay = replay_for(m["engine"]["name"], m["sampling"])
        rescorer = Rescorer(
            model, dtype=s.dtype, device=s.device, token_budget=s.token_budget, topk=topk, replay=replay
        )
        desc = rescorer.describe()
    else:  # the weights load on the actors, not here
        from lpf.pipeline.reference import describe_reference

        desc = {**describe_reference(model, s.dtype, load_tokenizer(model)), "device": s.device}
    _same_tokenizer(m, spec, desc["tokenizer_sha256"])
    desc = {"kind": "transformers", **desc, "executor": s.executor}
    if s.executor == "local" and rescorer.replay is not None:
        desc["seeded_replay"] = rescorer.replay.kind
    _start(run, redo, desc)
    if s.executor == "ray":
        pending, total, done = unscored_requests(run)
        on_start(total, done)
        from lpf.pipeline.rescore_ray import rescore_on_ray

        rescore_on_ray(run, pending, model, s, topk, tick)
        return
    _score_local(run, rescorer, on_start, tick)


def prompt_reference(m: dict, spec: str, s: RescoreSettings, topk: int):
    """The reference a server or vLLM scores (`self`, `http(s)://...`, `vllm:MODEL`; `s` validated) for the run
    whose manifest is `m` (its model is the local copy: tokenizer and vocabulary; a self-reference reads the
    audited server from its engine section): the one construction `lpf audit` / `lpf rescore`, `lpf.compare`
    and `lpf rl rescore` share. A vLLM reference with another tokenizer than the run's is refused."""
    if reference_form(spec) == "vllm":
        from lpf.pipeline.reference_vllm import for_run as vllm_for_run

        rescorer = vllm_for_run(m, spec, s.dtype, s.reference_option, topk)
        _same_tokenizer(m, spec, rescorer.tokenizer_sha256())
        return rescorer
    from lpf.pipeline.reference_http import for_run

    return for_run(m, spec, s.reference_model, s.reference_concurrency, topk)


def _same_tokenizer(m: dict, spec: str, sha: str) -> None:
    if sha != m["tokenizer_sha256"]:
        raise LpfError(
            f"reference {spec} uses a different tokenizer from the engine's model "
            f"{m['model']['spec']}: token ids would not mean the same text"
        )


def _start(run: RunDir, redo: bool, desc: dict) -> None:
    """The manifest names the reference about to score (`--redo`: the old reference's scores dropped)."""
    m = run.manifest
    if redo:
        # a calibration run, like the prompt scores, belongs to the old reference
        for p in (
            run.parts("prompt_reference") + run.parts("seeded") + run.parts("reference") + run.parts("calibration")
        ):
            p.unlink()
        m.pop("calibration", None)
    m["reference"] = desc
    run.save_manifest()


def _score_local(run: RunDir, rescorer, on_start: OnStart, tick: Tick) -> None:
    """Every unscored request through `rescorer` (transformers or `reference_http`), in this process."""
    from lpf.pipeline.reference import ScoreItem

    m = run.manifest
    pending, total, done = unscored_requests(run)
    on_start(total, done)
    with_prompt = set(run.read("prompt_tokens", ["request_id"]).column("request_id").unique().to_pylist())
    todo = set(pending.column("request_id").to_pylist())
    from lpf.core.sampling import request_seed

    req = run.read("requests", ["request_id", "seq", "prompt_token_ids", "output_token_ids"]).to_pylist()
    run_seed = m["sampling"].get("seed", 0)
    items = [
        ScoreItem(
            r["request_id"],
            r["prompt_token_ids"],
            r["output_token_ids"],
            r["request_id"] in with_prompt,
            request_seed(run_seed, r["seq"]),
        )
        for r in req
        if r["request_id"] in todo
    ]
    for scored in rescorer.score_all(items, tick):
        run.append_reference(scored.reference, scored.prompt_reference, scored.seeded)
