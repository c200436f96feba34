"""The streamed analysis (`lpf analyze --stream`) gives the in-memory analysis' findings.json byte for
byte and the same summary.parquet: on a built-in-engine drill with flagged requests, a trace, the
crossed-wires signature and the attribution, on a sampled drill with the tempered-logprob signature
and a `systematic` run-level test, and on synthetic runs cut into many small parts and
chunks, both when the parts line up row for row (zip chunks) and when they do not (request-id
ranges), sampled, with the run-level test on every k-th token.
Its bounded memory is measured in bench/analysis.py, not here."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import lpf_main, write_prompts
from lpf.analysis.thresholds import Thresholds
from lpf.pipeline import analyze_stream, run_reads, stream_memory, stream_parts
from lpf.pipeline.analyze import analyze_run
from lpf.run.store import RunDir

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_analysis", ROOT / "bench" / "analysis.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def both_ways(src: Path, tmp: Path, monkeypatch, chunk_rows: int, attribute: bool = True):
    """(in-memory, streamed) (findings bytes, summary table, findings), each on its own copy, and
    whether the streamed one bucketed by request range."""
    monkeypatch.setattr(stream_parts, "CHUNK_ROWS", chunk_rows)
    ranged = []
    real = stream_parts.Ranges.__init__

    def spy(self, *a, **k):
        ranged.append(True)
        real(self, *a, **k)

    monkeypatch.setattr(stream_parts.Ranges, "__init__", spy)
    out = []
    for stream in (False, True):
        d = tmp / f"stream-{stream}"
        shutil.copytree(src, d)
        analyze_run(RunDir.open(d), Thresholds(), attribute=attribute, stream=stream)
        assert not list(d.glob(".tmp-analyze-*"))  # the spill folder is gone
        raw = (d / "findings.json").read_bytes()
        out.append((raw, pq.read_table(d / "summary.parquet"), json.loads(raw)))
    return out[0], out[1], bool(ranged)


@pytest.fixture(scope="module")
def swap_run(tmp_path_factory):
    """The swap-outputs drill on the built-in engine: 400 distinct prompts, 16 tokens (~9 s)."""
    from lpf.zoo import registry

    tmp = tmp_path_factory.mktemp("swap")
    items = registry.workload_items("oracle", seed=3, n=400)
    prompts = write_prompts(tmp / "p.jsonl", [{"id": i["id"], "prompt": i["prompt"]} for i in items])
    proc = lpf_main(
        "audit",
        "--engine",
        "builtin",
        "--model",
        "zoo:hybrid",
        "--workload",
        prompts,
        "--max-tokens",
        16,
        "--inject",
        "swap-outputs:5",
        "--out",
        tmp / "run",
        "--fail-on",
        "never",
    )
    assert proc.returncode == 0, proc.stderr
    return tmp / "run"


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_drill_run_streamed_is_byte_identical(swap_run, tmp_path, monkeypatch):
    (mem_raw, mem_sum, f), (st_raw, st_sum, _), ranged = both_ways(swap_run, tmp_path, monkeypatch, 500)
    assert f["flagged"] and f["hypotheses"][0]["feature"] == "crossed_wires" and f["trace"]["recorded"]
    assert f["attribution"]["n_tested"] > 0 and "run_test" in f
    assert ranged  # the reference was scored in length order: parts do not line up with the tokens
    assert st_raw == mem_raw
    assert st_sum.equals(mem_sum)


@pytest.mark.parametrize("shuffle", [False, True], ids=["zip", "ranges"])
@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_synthetic_run_in_many_parts(tmp_path, monkeypatch, shuffle):
    """60k tokens in parts of 2,000 tokens (reference parts reversed when shuffled), chunks of 777
    rows (cutting through requests' neighbourhoods), sampled at temperature 0.7 with top-5 lists,
    and the run-level test on every 7th token (MAX_TOKENS lowered)."""
    from lpf.analysis import run_test

    monkeypatch.setattr(run_test, "MAX_TOKENS", 9000)
    bench = _bench()
    run, n_bad = bench.write_synthetic_run(
        tmp_path / "run", 60_000, part_tokens=2000, topk=5, temperature=0.7, shuffle_reference=shuffle, out_tokens=24
    )
    assert n_bad > 0
    (mem_raw, mem_sum, f), (st_raw, st_sum, _), ranged = both_ways(
        run.path, tmp_path, monkeypatch, 777, attribute=False
    )
    assert ranged == shuffle
    assert f["counts"]["corrupt"] > 0 and f["run_test"]["sampled_every"] == 7
    if shuffle:
        assert f["unscored"] > 0
    assert st_raw == mem_raw
    assert st_sum.equals(mem_sum)


@pytest.mark.parametrize(
    "short,keep", [(False, True), (False, False), (True, True)], ids=["one-pass", "spilled", "rows-not-output"]
)
def test_one_pass_and_its_checks(tmp_path, monkeypatch, short, keep):
    """With an expected floor and parts that line up, one pass over the parts (its arrival order
    from the requests' output lengths), the logprob columns kept in memory or (above KEEP_TOKENS)
    spilled; a request whose rows are not its output (a token row gone on both sides) fails that
    check part way, and the two passes give the in-memory findings."""
    import pyarrow.compute as pc

    from lpf.analysis import run_test

    monkeypatch.setattr(run_test, "MAX_TOKENS", 5000)
    monkeypatch.setattr(stream_memory, "KEEP_TOKENS", stream_memory.KEEP_TOKENS if keep else 0)
    run, _ = _bench().write_synthetic_run(tmp_path / "run", 30_000, part_tokens=3000, topk=2, out_tokens=20)
    if short:  # request 700's last position dropped from its tokens and reference parts
        for table in ("tokens", "reference"):
            for part in run.parts(table):
                t = pq.read_table(part)
                keep = pc.invert(
                    pc.and_(pc.equal(t.column("request_id"), "bench-00000700-r0"), pc.equal(t.column("position"), 19))
                )
                if not pc.all(keep).as_py():
                    pq.write_table(t.filter(keep), part)
    passes = []
    real = analyze_stream._two_passes
    monkeypatch.setattr(analyze_stream, "_two_passes", lambda *a, **k: passes.append(1) or real(*a, **k))
    (mem_raw, mem_sum, f), (st_raw, st_sum, _), ranged = both_ways(
        run.path, tmp_path, monkeypatch, 1500, attribute=False
    )
    assert passes == ([1] if short else []) and not ranged and f["run_test"]["sampled_every"] == 6
    assert st_raw == mem_raw
    assert st_sum.equals(mem_sum)


@pytest.mark.parametrize("shuffle", [False, True], ids=["one-pass", "ranges"])
def test_tokens_without_a_logprob_streamed_as_in_memory(tmp_path, monkeypatch, shuffle):
    """Tokens that came back without a logprob (null, no top-k: llama-server's partial UTF-8 tokens) and
    one NaN logprob value, in parts read in one pass (greedy, expected floor) and in request ranges
    (sampled): the streamed findings and summary are the in-memory ones, the nulls judged from their
    tokens (`lpf.analysis.absent`) and counted per request, the NaN still an error."""
    import numpy as np
    import pyarrow as pa

    from lpf.analysis import run_test

    monkeypatch.setattr(run_test, "MAX_TOKENS", 5000)
    run, _ = _bench().write_synthetic_run(
        tmp_path / "run",
        30_000,
        part_tokens=3000,
        topk=3,
        out_tokens=20,
        temperature=0.7 if shuffle else 0.0,
        shuffle_reference=shuffle,
    )
    nulls = 0
    for i, part in enumerate(run.parts("tokens")):
        t = pq.read_table(part)
        gone = np.zeros(t.num_rows, bool)
        gone[(np.arange(t.num_rows) * 7 + i) % 31 == 0] = True  # ~3% of tokens, some at kept rows
        lp = t.column("engine_logprob").to_numpy().copy()
        if i == 1:
            lp[10] = np.nan  # a NaN value: never clean
            gone[10] = False
        nulls += int(gone.sum())
        t = t.set_column(t.column_names.index("engine_logprob"), "engine_logprob", pa.array(lp, mask=gone))
        for name in ("engine_topk_ids", "engine_topk_logprobs"):
            lists = t.column(name).to_pylist()
            cut = [[] if gone[j] else x for j, x in enumerate(lists)]
            t = t.set_column(t.column_names.index(name), name, pa.array(cut, t.schema.field(name).type))
        pq.write_table(t, part)
    (mem_raw, mem_sum, f), (st_raw, st_sum, _), ranged = both_ways(
        run.path, tmp_path, monkeypatch, 1500, attribute=False
    )
    assert ranged == shuffle and f["run_test"]["sampled_every"] == 6
    assert f["judged"]["logprobs"] == "some" and f["judged"]["no_logprob"] == nulls
    counted = pa.compute.sum(mem_sum.column("n_no_logprob")).as_py()  # over scored tokens (ranges: some unscored)
    assert counted == nulls if not shuffle else 0 < counted <= nulls
    assert "judged from their tokens alone" in f["judged"]["steps"]["per_request"]
    assert float("inf") in mem_sum.column("max_abs_logprob_diff").to_pylist()  # the NaN value's request
    assert st_raw == mem_raw
    assert st_sum.equals(mem_sum)


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_stream_refuses_a_calibration_run(swap_run, tmp_path, lpf_cli):
    run = tmp_path / "run"
    shutil.copytree(swap_run, run)
    m = json.loads((run / "manifest.json").read_text())
    m["calibration"] = {
        "spec": m["reference"]["spec"],
        "reference_dtype": m["reference"]["dtype"],
        "same_as_reference": True,
    }
    (run / "manifest.json").write_text(json.dumps(m))
    r = lpf_cli("analyze", str(run), "--stream", "--no-attribution")
    assert r.code == 2 and "--no-stream" in r.err


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_cli_stream_and_no_stream_write_the_same_findings(swap_run, tmp_path, lpf_cli):
    run = tmp_path / "run"
    shutil.copytree(swap_run, run)
    (run / "report.html").unlink()
    written = []
    for flag in ("--no-stream", "--stream"):
        r = lpf_cli("analyze", str(run), flag, "--fail-on", "never")
        assert r.code == 0, r.err
        written.append((run / "findings.json").read_bytes())
    assert written[0] == written[1] and json.loads(written[1])["flagged"]
    assert (run / "report.html").is_file()


@pytest.mark.slow  # its own audit, ~10 s
def test_sampled_drill_with_tempered_logprobs_is_byte_identical(tmp_path, monkeypatch):
    """The processed-logprobs drill at temperature 0.6 (500 requests, ~9 s): the tempered-logprob
    signature ranks first and the run-level test finds the run `systematic`, both ways alike."""
    proc = lpf_main(
        "audit",
        "--engine",
        "builtin",
        "--model",
        "zoo:hybrid",
        "--workload",
        "zoo:oracle",
        "--n",
        1,
        "--max-tokens",
        8,
        "--ignore-eos",
        "--temperature",
        0.6,
        "--inject",
        "processed-logprobs",
        "--no-attribution",
        "--out",
        tmp_path / "run",
        "--fail-on",
        "never",
    )
    assert proc.returncode == 0, proc.stderr
    (mem_raw, mem_sum, f), (st_raw, st_sum, _), _ = both_ways(
        tmp_path / "run", tmp_path, monkeypatch, 300, attribute=False
    )
    assert f["hypotheses"][0]["feature"] == "tempered_logprobs" and f["verdict"] == "systematic"
    assert st_raw == mem_raw
    assert st_sum.equals(mem_sum)


@pytest.mark.parametrize("shuffle", [False, True], ids=["one-pass", "ranges"])
@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_parallel_chunks_give_the_serial_findings(tmp_path, monkeypatch, shuffle):
    """Chunks scored on threads (`stream_parts.WORKERS`, here 3: more than one chunk in flight) and
    added in order give the serial path's findings.json and summary byte for byte, and the in-memory
    ones: greedy with the expected floor (one pass), and sampled with reference parts that do not
    line up with the tokens' (request ranges, chunks cutting through the parts)."""
    import threading

    from lpf.analysis import run_test
    from lpf.analysis.stream import StreamedAnalysis

    monkeypatch.setattr(run_test, "MAX_TOKENS", 6000)
    run, _ = _bench().write_synthetic_run(
        tmp_path / "run",
        40_000,
        part_tokens=3000,
        topk=3,
        temperature=0.7 if shuffle else 0.0,
        shuffle_reference=shuffle,
        out_tokens=20,
    )
    threads = []
    real = StreamedAnalysis.score_chunk

    def spy(self, *a):
        threads.append(threading.current_thread().name)
        return real(self, *a)

    monkeypatch.setattr(StreamedAnalysis, "score_chunk", spy)
    out = {}
    for workers in (1, 3):
        monkeypatch.setattr(stream_parts, "WORKERS", workers)
        threads.clear()
        (mem_raw, mem_sum, f), (st_raw, st_sum, _), ranged = both_ways(
            run.path, tmp_path / f"w{workers}", monkeypatch, 777, attribute=False
        )
        assert ranged == shuffle and len(threads) > 10
        on_pool = {name.startswith("lpf-analyze") for name in threads}
        assert on_pool == ({False} if workers == 1 else {True})
        assert st_raw == mem_raw and st_sum.equals(mem_sum)
        out[workers] = (st_raw, st_sum)
    assert out[1][0] == out[3][0] and out[1][1].equals(out[3][1])
    assert f["counts"]["corrupt"] > 0 and f["run_test"]["sampled_every"] == 7
    assert f["judged"]["top_k"] == 3  # counted from the parts the passes read


def test_ordered_map_keeps_order_and_bounds_what_is_in_flight():
    import threading
    import time

    running, most = [0], [0]
    lock = threading.Lock()

    def work(i, pause):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(pause)
        with lock:
            running[0] -= 1
        return i

    items = [(i, 0.02 if i % 2 == 0 else 0.0) for i in range(12)]  # the odd ones finish first
    assert list(stream_parts.ordered_map(work, iter(items), 3)) == list(range(12))
    assert 1 < most[0] <= 3
    assert list(stream_parts.ordered_map(work, iter(items), 1)) == list(range(12))
    gen = stream_parts.ordered_map(work, iter(items), 2)
    assert next(gen) == 0
    gen.close()  # stopping early waits for what is in flight
    assert running[0] == 0


def test_footer_counts_are_what_reading_counts(tmp_path):
    """What came back (rows, rows without a logprob) from the parts' footers, and from reading a
    part whose footer has no statistics: `returned.counts` of the parts themselves."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from lpf.analysis.returned import counts

    run, _ = _bench().write_synthetic_run(tmp_path / "run", 9000, part_tokens=3000, out_tokens=20)
    parts = run.parts("tokens")
    t = pq.read_table(parts[1])
    blank = pc.less(pa.array(range(t.num_rows)), 500)  # a part with some logprobs missing, no statistics
    t = t.set_column(
        t.column_names.index("engine_logprob"),
        "engine_logprob",
        pc.if_else(blank, pa.nulls(t.num_rows, pa.float64()), t.column("engine_logprob")),
    )
    pq.write_table(t, parts[1], write_statistics=False)
    want = counts(run.iter_parts("tokens", ["engine_logprob", "engine_topk_ids"]))
    assert want["no_logprob"] == 500
    assert run_reads.footer_counts(run) == {**want, "top_k": 0}


def _rewrite(part, fn, **kw):
    pq.write_table(fn(pq.read_table(part)), part, **kw)


@pytest.mark.parametrize("case", ["late-arrivals", "ragged-top-k", "null-top-k", "no-top-k", "older-writer"])
def test_one_pass_evidence_in_arrival_order(tmp_path, monkeypatch, case):
    """The run-level test's tokens, taken chunk by chunk and put in arrival order at the end, are
    `evidence_columns`' over the whole run: requests whose arrival order is not their token order
    (seq shuffled), top-k lists of ragged widths (Arrow lists, not matrices) beside missing
    logprobs (one at a kept row: NaN there, as in memory), every third list null, no list at all
    (an engine that returns no top-k, a reference that kept none), and parts written
    before floats were BYTE_STREAM_SPLIT (zstd with dictionaries: still read the same)."""
    import numpy as np
    import pyarrow as pa

    from lpf.analysis import run_test
    from lpf.analysis.stream_evidence import ENGINE_LISTS, REFERENCE_LISTS

    monkeypatch.setattr(run_test, "MAX_TOKENS", 4000)
    run, _ = _bench().write_synthetic_run(tmp_path / "run", 24_000, part_tokens=3000, topk=3, out_tokens=20)
    md = pq.ParquetFile(run.parts("reference")[0]).metadata.row_group(0)
    leaf = {md.column(i).path_in_schema: md.column(i).encodings for i in range(md.num_columns)}
    assert "BYTE_STREAM_SPLIT" in leaf["ref_logprob"] and "BYTE_STREAM_SPLIT" in leaf["ref_topk_logprobs.list.element"]
    rng = np.random.default_rng(5)
    if case == "late-arrivals":
        for part in run.parts("requests"):
            seq = rng.permutation(10**6)[: pq.read_metadata(part).num_rows]

            def reseq(t, seq=seq):
                return t.set_column(t.column_names.index("seq"), "seq", pa.array(seq, pa.int64()))

            _rewrite(part, reseq)
    elif case == "ragged-top-k":  # every 7th row of a tokens part keeps one of its three; two logprobs lost
        part = run.parts("tokens")[2]
        t = pq.read_table(part)
        lost = [None if i in (60, 125) else x for i, x in enumerate(t.column("engine_logprob").to_pylist())]
        t = t.set_column(t.column_names.index("engine_logprob"), "engine_logprob", pa.array(lost, pa.float64()))
        for name in ("engine_topk_ids", "engine_topk_logprobs"):
            lists = t.column(name).to_pylist()
            cut = [x[:1] if i % 7 == 0 else x for i, x in enumerate(lists)]
            t = t.set_column(t.column_names.index(name), name, pa.array(cut, t.schema.field(name).type))
        pq.write_table(t, part)
    elif case in ("null-top-k", "no-top-k"):
        for table, names in (("tokens", ENGINE_LISTS), ("reference", REFERENCE_LISTS)):
            for part in run.parts(table):
                t = pq.read_table(part)
                for name in names:
                    lists, n = t.column(name).combine_chunks(), t.num_rows
                    if case == "no-top-k":
                        offsets, values, mask = pa.array(np.zeros(n + 1, np.int32)), lists.values[:0], None
                    else:
                        offsets, values, mask = lists.offsets, lists.values, pa.array(np.arange(n) % 3 == 0)
                    lists = pa.ListArray.from_arrays(offsets, values, type=lists.type, mask=mask)
                    t = t.set_column(t.column_names.index(name), name, lists)
                pq.write_table(t, part)
    else:
        for table in ("tokens", "reference", "requests"):
            for part in run.parts(table):
                _rewrite(part, lambda t: t, compression="zstd", write_page_checksum=True)
    passes = []
    real = analyze_stream._two_passes
    monkeypatch.setattr(analyze_stream, "_two_passes", lambda *a, **k: passes.append(1) or real(*a, **k))
    (mem_raw, mem_sum, f), (st_raw, st_sum, _), ranged = both_ways(run.path, tmp_path, monkeypatch, 1100, False)
    assert not passes and not ranged and f["run_test"]["sampled_every"] == 6
    assert st_raw == mem_raw
    assert st_sum.equals(mem_sum)


def test_codes_read_any_dictionary():
    """`Codes.of`: each row's index among the ids (-1 for another id or a null), for dictionaries
    that are a run of the ids, straddle the last one found, or are in any order."""
    import numpy as np
    import pyarrow as pa

    from lpf.analysis.columns import Codes

    ids = pa.array([f"r{i}" for i in range(50)])
    codes = Codes(ids)
    rng = np.random.default_rng(1)
    for rows in (
        ["r0", "r0", "r1", "r2"],  # a run from the start
        ["r2", "r3", "r3"],  # straddles: begins with the last one found
        ["r10", "r11"],  # a run elsewhere
        ["r7", None, "x", "r3", "r7"],  # any order, a null, an id not among them
        [f"r{i}" for i in rng.permutation(50)],
    ):
        col = pa.chunked_array([pa.array(rows).dictionary_encode(), pa.array(rows[:1]).dictionary_encode()])
        want = [int(r[1:]) if r and r.startswith("r") else -1 for r in rows + rows[:1]]
        assert codes.of(col).tolist() == want


def test_kept_reads_what_spill_reads(tmp_path):
    import numpy as np

    rng = np.random.default_rng(2)
    kept, spill = stream_memory.Kept(), stream_memory.Spill(tmp_path)
    for size in (5, 1, 300, 0, 64):
        cols = {"a": rng.random(size), "b": rng.random(size)}
        kept.add(cols), spill.add(cols)
    for rows in (slice(0, 370), slice(3, 7), slice(5, 6), slice(300, 370), rng.integers(0, 370, 40), np.arange(0)):
        for name in ("a", "b"):
            assert np.array_equal(kept.rows(name, rows), spill.rows(name, rows))
