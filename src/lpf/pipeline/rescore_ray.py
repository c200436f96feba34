"""The rescore stage on Ray Data (`--executor ray`): an actor pool of rescorers over the run's parts.

Pipeline. This process (the driver) groups the run's requests parts into work units of about
`unit_tokens(...)` unscored tokens (`plan_units`, whole parts, consecutive). Ray Data maps each unit
through `RescoreUDF`, a class-based UDF holding one `Rescorer` per actor (a pool of `--actors`, each
with `--gpus-per-actor` GPUs and one CPU): it reads the unit's parts with the run store's reader,
keeps the unit's unscored requests, and scores them in length-sorted batches under the token budget
(`plan_batches`, the local rule: when a unit holds the whole run its batches are the local ones).
The driver commits what comes back as ordinary `reference/` parts through `RunDir.append`, and a
request's rows only once all of them have arrived, so a killed job leaves whole requests or none
and the rerun scores exactly the requests without reference rows (the local resume rule).

Parts are read by lpf's reader inside the UDF rather than `ray.data.read_parquet`: the units come
from the driver's resume state anyway, old-schema parts read as the current schema, and Ray 2.60's
parallel file listing races on fsspec's optional HTTP import (where aiohttp is absent, as with
torch's fsspec) and fails.

Ray itself: `address` None starts a local instance (`num_cpus` = this machine's cores) and stops
it after; an address connects to that cluster (every worker needs logprob-forensics with its
`[ray]` extra, and the run directory and the reference model at the same paths). A Ray already
initialised in this process (tests) is used as it is and left running.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from lpf.core.errors import LpfError
from lpf.core.model_specs import ModelRef
from lpf.pipeline.callbacks import Tick
from lpf.run import schema
from lpf.run.store import RunDir, read_part

INSTALL_HINT = "--executor ray needs Ray Data: pip install 'logprob-forensics[ray]'"


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError:
        raise LpfError(INSTALL_HINT) from None


# -- planning (pure) --------------------------------------------------------------------------------
def unit_tokens(pending_tokens: int, actors: int, token_budget: int) -> int:
    """Tokens per work unit: four units per actor keep the pool busy; at least one batch, and at
    most 64 batches, which bounds what a kill can lose."""
    return max(token_budget, min(64 * token_budget, -(-pending_tokens // (4 * actors))))


def plan(pending: pa.Table, token_budget: int, target_tokens: int) -> tuple[list[int], list[int]]:
    """(batch number of each pending request, in the table's order; the first batch number of each
    work unit after the first). Batches are `plan_batches`' (the local executor's), numbered in
    their order; units are runs of consecutive batches of about target_tokens tokens each."""
    from lpf.pipeline.batch_plan import plan_batches

    n_prompt, n_output = pending.column("n_prompt").to_pylist(), pending.column("n_output").to_pylist()
    lengths = [p + o for p, o in zip(n_prompt, n_output)]
    batch_of = [0] * len(lengths)
    starts, unit = [], 0
    for b, members in enumerate(plan_batches(lengths, pending.column("request_id").to_pylist(), token_budget)):
        if unit >= target_tokens:
            starts.append(b)
            unit = 0
        for i in members:
            batch_of[i] = b
            unit += lengths[i]
    return batch_of, starts


def read_planned(parts: pa.Table) -> pa.Table:
    """Ray Data stage 1 (tasks): each row names a requests part and its pending requests with their
    batch numbers; out come those requests' token ids and their batch."""
    out = []
    for row in parts.to_pylist():
        t = read_part(row["part"], "requests", ["request_id", "prompt_token_ids", "output_token_ids"])
        batch = dict(zip(row["request_ids"], row["batches"]))
        t = t.filter(pc.is_in(t.column("request_id"), value_set=pa.array(row["request_ids"], pa.string())))
        out.append(
            t.append_column("batch", pa.array([batch[r] for r in t.column("request_id").to_pylist()], pa.int64()))
        )
    return pa.concat_tables(out) if out else pa.table({})


# -- the actors -------------------------------------------------------------------------------------
class RescoreUDF:
    """Ray Data stage 2 (an actor pool): one `Rescorer` per actor; a call gets one work unit (whole
    planned batches) and scores each batch as the local executor would."""

    def __init__(self, model: ModelRef, dtype: str, device: str, token_budget: int, topk: int):
        from lpf.pipeline.reference import Rescorer

        self.rescorer = Rescorer(model, dtype=dtype, device=device, token_budget=token_budget, topk=topk)

    def __call__(self, unit: pa.Table) -> pa.Table:
        from lpf.pipeline.reference import ScoreItem

        batches: dict[int, list] = {}
        for r in unit.to_pylist():
            batches.setdefault(r["batch"], []).append(
                ScoreItem(r["request_id"], r["prompt_token_ids"], r["output_token_ids"])
            )
        planned = [  # each planned batch, in plan_batches' order within it
            sorted(batches[b], key=lambda it: (len(it.prompt_token_ids) + len(it.output_token_ids), it.request_id))
            for b in sorted(batches)
        ]
        # one batch ahead on the device, as the local executor scores (Rescorer.score_planned)
        out = [scored.reference for scored in self.rescorer.score_planned(planned)]
        return pa.concat_tables(out) if out else schema.REFERENCE.empty_table()


# -- the driver -------------------------------------------------------------------------------------
class _Committer:
    """Appends reference rows as parts, each request only once all its rows have arrived (Ray may
    cut a UDF's output into several blocks)."""

    def __init__(self, run: RunDir, expected: dict[str, int], tick: Tick):
        self.run, self.expected, self.tick = run, expected, tick
        self.carry = schema.REFERENCE.empty_table()

    def add(self, block: pa.Table) -> None:
        table = pa.concat_tables([self.carry, block.select(schema.REFERENCE.names).cast(schema.REFERENCE)])
        if not table.num_rows:
            return
        counts = table.group_by("request_id").aggregate([("position", "count")])
        have = counts.column("position_count").to_pylist()
        ids = counts.column("request_id").to_pylist()
        complete = pa.array([r for r, n in zip(ids, have) if n == self.expected.get(r)], pa.string())
        whole = pc.is_in(table.column("request_id"), value_set=complete)
        ready, self.carry = table.filter(whole), table.filter(pc.invert(whole))
        if ready.num_rows:
            self.run.append("reference", ready)
            self.tick(ready.num_rows)

    def finish(self) -> None:
        if self.carry.num_rows:  # every unit's output is whole requests: this would be a bug
            raise RuntimeError(f"{self.carry.num_rows} reference rows of incomplete requests came back from Ray")


def _user_error(e: BaseException) -> LpfError | None:
    """The LpfError an actor raised, out of Ray's wrappers (RayTaskError, UserCodeException)."""
    seen = 0
    while e is not None and seen < 16:
        cause = getattr(e, "cause", None)
        if isinstance(e, LpfError) and not isinstance(cause, BaseException):
            return LpfError(str(e).strip().splitlines()[-1] if "\n" in str(e) else str(e))
        e = cause if isinstance(cause, BaseException) else (e.__cause__ or e.__context__)
        seen += 1
    return None


def _connect(address: str | None) -> bool:
    """Start or join Ray; True when this call started it (and so must stop it)."""
    import ray
    import ray.data  # noqa: F401 - configures its loggers on import; quieted below

    for name in ("ray", "ray.data"):  # lpf draws its own progress; errors still raise
        logging.getLogger(name).setLevel(logging.ERROR)
    if ray.is_initialized():
        return False
    try:
        if address:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        else:
            ray.init(
                address="local",
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                logging_level=logging.ERROR,
                log_to_driver=False,
            )
    except (ConnectionError, ValueError, RuntimeError) as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LpfError(f"cannot start {where}: {why}") from None
    return True


def _check_capacity(actors: int, gpus_per_actor: float) -> None:
    import ray

    res = ray.cluster_resources()
    cpus, gpus = res.get("CPU", 0), res.get("GPU", 0)
    if actors > cpus:
        raise LpfError(f"--actors {actors}: the Ray cluster has {cpus:g} CPUs and each actor takes one")
    if actors * gpus_per_actor > gpus:
        raise LpfError(f"--actors {actors} x --gpus-per-actor {gpus_per_actor:g}: the Ray cluster has {gpus:g} GPUs")


def _blocks(
    run: RunDir, pending: pa.Table, batch_of: list[int], starts: list[int], model: ModelRef, settings, topk: int
) -> Iterator[pa.Table]:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    paths = [str(p) for p in run.parts("requests")]
    per_part: dict[int, tuple[list, list]] = {}
    for part, rid, b in zip(pending.column("part").to_pylist(), pending.column("request_id").to_pylist(), batch_of):
        ids, bs = per_part.setdefault(part, ([], []))
        ids.append(rid)
        bs.append(b)
    rows = [{"part": paths[p], "request_ids": ids, "batches": bs} for p, (ids, bs) in sorted(per_part.items())]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        read_planned, batch_size=None, batch_format="pyarrow"
    )
    # the shuffle that brings each planned batch together; one block per unit. Materialised before the
    # actors start: an actor pool holding every CPU would leave the sort's tasks none
    ds = ds.sort("batch", boundaries=starts or None).materialize()
    with warnings.catch_warnings():
        # max_restarts=0: an actor that dies fails the job (a rerun resumes it). Ray 2.60 takes it
        # only through its deprecated **ray_remote_args; with restarts allowed its core worker prints
        # an error-level line on every run (constructor arguments held in the object store)
        warnings.simplefilter("ignore")
        ds = ds.map_batches(
            RescoreUDF,
            batch_size=None,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=settings.ray.actors),
            num_cpus=1,
            num_gpus=settings.ray.gpus_per_actor or None,
            max_restarts=0,
            fn_constructor_kwargs=dict(
                model=model, dtype=settings.dtype, device=settings.device, token_budget=settings.token_budget, topk=topk
            ),
        )
    yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")


def rescore_on_ray(run: RunDir, pending: pa.Table, model: ModelRef, settings, topk: int, tick: Tick) -> None:
    """Score the `pending` requests (`unscored_requests`) on Ray and commit their reference parts."""
    if not pending.num_rows:
        return
    require_ray()
    import ray

    tokens = pc.sum(pc.add(pending.column("n_prompt"), pending.column("n_output"))).as_py()
    target = unit_tokens(tokens, settings.ray.actors, settings.token_budget)
    batch_of, starts = plan(pending, settings.token_budget, target)
    expected = dict(zip(pending.column("request_id").to_pylist(), pending.column("n_output").to_pylist()))
    started = _connect(settings.ray.address)
    try:
        _check_capacity(settings.ray.actors, settings.ray.gpus_per_actor)
        committer = _Committer(run, expected, tick)
        try:
            for block in _blocks(run, pending, batch_of, starts, model, settings, topk):
                committer.add(block)
        except Exception as e:  # noqa: BLE001 - Ray wraps what the actors raised
            user = _user_error(e)
            if user is not None:
                raise user from None
            raise
        committer.finish()
    finally:
        if started:
            ray.shutdown()
