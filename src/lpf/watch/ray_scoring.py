"""The watch scorer's reference on Ray (`lpf watch --executor ray`): long-lived actors, one `Rescorer` each.

Contract: `RayRescorer(model, dtype, device, token_budget, topk, options)` joins the Ray cluster at
`options.address`, or starts a local Ray when it is None, as `lpf rescore --executor ray` does
(`lpf.pipeline.rescore_ray`: a Ray already initialised in this process is used as it is), checks that the
cluster holds `options.actors` actors of one CPU and `options.gpus_per_actor` GPUs each, and starts them;
each loads the reference once and keeps it for the life of the watch (a batch job's actor pool would load
it again every scoring cycle). `describe()` is the reference's description as an actor loaded it;
`score_all(items)` yields the `Scored` batches the local `Rescorer.score_all` yields for the same items:
the batches are the local plan (`plan_batches` under the token budget), spread over the actors and
returned in plan order. An actor that dies fails the call (`max_restarts=0`): the scorer process exits
and `lpf watch` restarts it, which resumes without rescoring anything committed. `close()` stops the
actors, and Ray when this object started it.
"""

from __future__ import annotations

from typing import Iterable

from lpf.core.model_specs import ModelRef
from lpf.pipeline.rescore import RayOptions


class _Worker:
    def __init__(self, model: ModelRef, dtype: str, device: str, token_budget: int, topk: int):
        from lpf.pipeline.reference import Rescorer

        self.rescorer = Rescorer(model, dtype=dtype, device=device, token_budget=token_budget, topk=topk)

    def describe(self) -> dict:
        return self.rescorer.describe()

    def score(self, batch: list):
        return self.rescorer.score_batch_all(batch)


class RayRescorer:
    def __init__(self, model: ModelRef, dtype: str, device: str, token_budget: int, topk: int, options: RayOptions):
        from lpf.pipeline.rescore_ray import _check_capacity, _connect, require_ray

        require_ray()
        import ray

        self.token_budget = token_budget
        self.started = _connect(options.address)
        try:
            _check_capacity(options.actors, options.gpus_per_actor)
            actor = ray.remote(num_cpus=1, num_gpus=options.gpus_per_actor or 0, max_restarts=0)(_Worker)
            self.actors = [actor.remote(model, dtype, device, token_budget, topk) for _ in range(options.actors)]
            self._describe = ray.get(self.actors[0].describe.remote())
        except BaseException:
            self.close()
            raise

    def describe(self) -> dict:
        return dict(self._describe)

    def score_all(self, items: list) -> Iterable:
        import ray

        from lpf.pipeline.reference import plan_batches

        items = [it for it in items if it.output_token_ids]
        plan = plan_batches(
            [len(it.prompt_token_ids) + len(it.output_token_ids) for it in items],
            [it.request_id for it in items],
            self.token_budget,
        )
        # every batch in flight at once, round robin over the actors; taken back in plan order
        futures = [self.actors[i % len(self.actors)].score.remote([items[j] for j in b]) for i, b in enumerate(plan)]
        for f in futures:
            yield ray.get(f)

    def close(self) -> None:
        import ray

        for a in getattr(self, "actors", ()):
            ray.kill(a)
        self.actors = []
        if self.started and ray.is_initialized():
            ray.shutdown()
            self.started = False
