"""`lpf watch --executor ray`: the background scorer rescores through Ray actors (real Ray, local mode: the
session's `ray_cluster`), each holding the reference, and writes what the local scorer writes.

A recorded watch run (12 requests, their "engine" logprobs -0.1 everywhere) is scored twice from the same
state: by the local scorer, and by the Ray scorer with two actors and a token budget small enough that
the batches spread over both. The reference rows are equal bit for bit, the judged windows equal (their
times aside), the manifest names the executor; then the Ray scorer's actors are gone after close().
~22 s here (Ray's start, 7 s, is the session fixture's, shared with test_rescore_ray)."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest

KEY = [("request_id", "ascending"), ("position", "ascending")]


def _recorded(path):
    from test_watch_units import recorded_run

    return recorded_run(path, 12, lambda seq: f" {seq} plus {seq} is {2 * seq}.").path


def _windows(path):
    return [
        {k: v for k, v in json.loads(x).items() if k != "t"}
        for x in (path / "live/windows.jsonl").read_text().splitlines()
    ]


@pytest.mark.slow  # ~22 s here (Ray's start 7 s, two actors loading the reference): make test-fast's budget
def test_the_watch_scorer_on_ray_actors_writes_what_the_local_scorer_writes(tmp_path, ray_cluster):
    import ray

    from lpf.pipeline.rescore import RayOptions
    from lpf.watch.scorer import Scorer

    local = _recorded(tmp_path / "local")
    on_ray = tmp_path / "ray"
    shutil.copytree(local, on_ray)
    sl = Scorer(local, "zoo:hybrid", "float32", "cpu", window=4, token_budget=64)
    sl.cycle()
    sr = Scorer(
        on_ray,
        "zoo:hybrid",
        "float32",
        "cpu",
        window=4,
        token_budget=64,
        executor="ray",
        ray=RayOptions(address=ray_cluster, actors=2),
    )
    actors = list(sr.rescorer.actors)
    assert len(actors) == 2
    sr.cycle()
    a = pq.read_table(local / "reference").sort_by(KEY)
    b = pq.read_table(on_ray / "reference").sort_by(KEY)
    assert a.num_rows > 12 * 5 and a.equals(b)  # every output position, bit for bit
    assert len(list((on_ray / "reference").glob("*.parquet"))) >= 2  # several batches came back
    assert _windows(on_ray) == _windows(local) and len(_windows(local)) == 3
    assert json.loads((on_ray / "manifest.json").read_text())["reference"]["executor"] == "ray"
    sr.close()
    assert ray.is_initialized()  # the session's Ray was joined, not started: it is left running
    for actor in actors:  # the actors are gone
        try:
            ray.get(actor.describe.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            continue
        raise AssertionError("an actor outlived close()")
