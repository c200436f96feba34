"""`lpf watch --retain`: the rolling run directory keeps under a size or an age, oldest commits first.

A real `Recorder` (the zoo's tokenizer, a run directory made by `lpf.watch.service.prepare`) commits one part
per sample under a size limit; `Retention.prune` on a run whose parts' times are set deletes whole commits
(requests, tokens, watch) and the scorer's reference parts that hold only deleted requests, never the newest
part; and what is left reads back as a run. A few seconds.
"""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pytest

from lpf.core.errors import LpfError
from lpf.run import schema
from lpf.run.store import RunDir
from lpf.watch import wire
from lpf.watch.evidence import Sample
from lpf.watch.retention import Retention, parse_retain


@pytest.fixture(scope="module")
def tok():
    from lpf.core.model_specs import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("zoo:hybrid"))


def _run(tmp_path):
    from lpf.watch.service import Settings, prepare

    run, _, _ = prepare(Settings(upstream="http://127.0.0.1:1", reference="zoo:hybrid", out=tmp_path / "run"))
    return run


def _sample(seq: int) -> Sample:
    c = wire.Collected(wire.COMPLETIONS)
    c.add_answer({"id": "x", "choices": [{"index": 0, "text": "ab", "token_ids": [7, 8], "finish_reason": "length"}]})
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    return Sample(seq, wire.COMPLETIONS, body, wire.Added(), False, time.time(), 0, c, status=200)


def test_retain_values_are_a_size_or_an_age_and_anything_else_is_one_line():
    r = parse_retain(["20GB", "7d"])
    assert (r.max_bytes, r.max_age) == (20 * 10**9, 7 * 86400.0)
    assert parse_retain(["512MiB"]).max_bytes == 512 * 2**20 and not parse_retain([])
    for bad in ("5XB", "-3d", "0MB", "12"):
        with pytest.raises(LpfError, match="--retain"):
            parse_retain([bad])


def test_the_recorder_keeps_the_run_under_its_size_newest_commits_kept(tmp_path, tok):
    from lpf.watch.record import Recording
    from lpf.watch.recorder import Recorder

    run = _run(tmp_path)
    limit = 40_000  # a commit of one sample is ~8 KB of Parquet (requests, tokens, watch)
    rec = Recorder(run, Recording(tok, len(tok)), part_rows=1, part_seconds=0.05, retention=Retention(limit))
    for seq in range(40):
        assert rec.offer(_sample(seq))
        time.sleep(0.01)
    rec.close()
    assert rec.recorded == 40 and rec.pruned_parts > 0
    size = sum(p.stat().st_size for t in ("requests", "tokens", "watch") for p in run.parts(t))
    assert size <= limit
    kept = RunDir.open(run.path).read("requests", ["request_id", "seq"])
    seqs = sorted(kept.column("seq").to_pylist())
    assert seqs[-1] == 39 and seqs == list(range(seqs[0], 40))  # the newest, contiguous: the oldest went
    tokens = RunDir.open(run.path).read("tokens", ["request_id"])
    assert set(tokens.column("request_id").to_pylist()) == set(kept.column("request_id").to_pylist())


def _commit(run: RunDir, seq: int, when: float) -> list:
    rid = f"w{seq:09d}"
    req = {"request_id": [rid], "seq": [seq], "rollout": [0], "prompt_token_ids": [[1, 2]], "output_token_ids": [[3]]}
    tok = {"request_id": [rid], "position": [0], "token_id": [3], "engine_logprob": [-0.1]}
    run.append("watch", pa.table({"request_id": [rid]}))
    run.append_requests(schema.table(schema.REQUESTS, req), schema.table(schema.TOKENS, tok))
    new = [run.parts(t)[-1] for t in ("watch", "tokens", "requests")]
    for p in new:
        os.utime(p, (when, when))
    return new


def _reference(run: RunDir, seqs: list[int], when: float):
    ids = [f"w{s:09d}" for s in seqs]
    ref = {"request_id": ids, "position": [0] * len(ids), "ref_logprob": [-0.1] * len(ids)}
    run.append_reference(schema.table(schema.REFERENCE, ref))
    p = run.parts("reference")[-1]
    os.utime(p, (when, when))
    return p


def test_prune_deletes_whole_old_commits_and_the_reference_parts_that_only_they_hold(tmp_path):
    run = _run(tmp_path)
    now = 1_000_000.0
    commits = [_commit(run, s, now - 3600 * (10 - s)) for s in range(10)]  # commit s is 10-s hours old
    ref_old = _reference(run, [0, 1, 2], now - 3600 * 7 + 60)  # scored after commit 2 (7 h ago), before 3
    ref_new = _reference(run, [3, 4, 5], now - 3600 * 4 + 60)
    deleted, freed = Retention(max_age=5.5 * 3600).prune(run.path, now)
    gone = [c for c in commits if not c[-1].exists()]
    assert len(gone) == 5 and all(not p.exists() for c in gone for p in c)  # commits 0..4: older than 5.5 h
    assert all(p.exists() for c in commits[5:] for p in c)
    assert not ref_old.exists() and ref_new.exists()  # ref_new holds 5, still recorded
    assert deleted == 5 * 3 + 1 and freed > 0
    seqs = RunDir.open(run.path).read("requests", ["seq"]).column("seq").to_pylist()
    assert sorted(seqs) == list(range(5, 10))
    # a size limit smaller than one commit still keeps the newest
    Retention(max_bytes=1).prune(run.path, now)
    assert [p.name for p in run.parts("requests")] == [commits[-1][-1].name]
    assert RunDir.open(run.path).read("requests", ["seq"]).column("seq").to_pylist() == [9]
