"""`lpf rl explain` on simulated RL runs whose causes are known: the real built-in engine, the real
float32 trainer, the real rescorer, each RL drill of `lpf rl simulate` alone and two at a time, scored
against the simulator's per-token ground truth (<stem>.causes.parquet, which analysis never reads).

Configuration A (the one the tests were tuned on): tiny:hybrid-longmem (Mamba2 + attention, slow
state decay), seed 0. Configuration B (checked, not tuned): tiny:jamba-longmem (Mamba1 + attention
+ MoE), seed 1. Both: 4 steps x 2 prompts x 4 rollouts, 32 tokens each (ignore-eos), the trainer's
micro-batches under 160 padded tokens. Shares are of sum |d| (d = trainer - rollout logprob); the
ground truth splits each token's |d| in proportion to the magnitudes of its true components, the
convention the explainer uses with its estimated ones.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

import rl_sim_native as native

DRILLS = ("processed-logprobs", "micro-batch", "state-dtype", "stale-policy")
CAUSE_OF = {
    "processed-logprobs": "processed_logprobs",
    "micro-batch": "batch_shape",
    "state-dtype": "position_growth",
    "stale-policy": "stale_weights",
}
TRUTH = {
    "processed_logprobs": "processed_logprobs",
    "batch_shape": "batch_shape",
    "position_growth": "position_growth",
    "stale_weights": "stale_weights",
    "floor": "dtype_floor",
}
SIZE = dict(steps=4, prompts=2, rollouts=4, max_tokens=32, ignore_eos=True, micro_batch_tokens=160)
CONFIGS = {"A": dict(model="tiny:hybrid-longmem", seed=0), "B": dict(model="tiny:jamba-longmem", seed=1)}
PAIRS = list(itertools.combinations(DRILLS, 2))


class Sims(dict):
    """(config, drills) -> the simulated dump, rescored (lag 1 too when the policy drifts); made on
    first use, in this process (the engine and the rescorer are the ones the commands run)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, key):
        from lpf.rl import reference_scores as rs
        from lpf.rl.formats import read_dump
        from lpf.rl.simulate import SimSpec, simulate

        config, drills, *extra = key
        extra = dict(extra[0]) if extra else {}
        name = "+".join(drills) or "clean"
        name += "".join(f"-{k}{v}" for k, v in sorted(extra.items()))
        path = self.root / config / f"{name}.parquet"
        simulate(SimSpec(**CONFIGS[config], **SIZE, drills=drills, **extra), path)
        d = read_dump(path)
        policy = d.metadata.get("policy")
        reference = policy["checkpoints"] if policy else d.metadata["spec"]["model"]
        for lag in (0, 1) if policy else (0,):
            rs.write(
                path.with_name(path.stem + ".rl"), rs.score(d, reference, sampling=d.metadata["sampling"], lag=lag), lag
            )
        self[key] = path
        return path


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    return Sims(tmp_path_factory.mktemp("causes"))


def explain(lpf_cli, dump, *args) -> dict:
    r = lpf_cli("rl", "explain", dump, "--json", *args)
    assert r.code == 0, r.err
    return json.loads(r.out)


def truth(dump) -> tuple[dict, dict, dict]:
    """(shares over the dump, per step, per (step, request_id)) of the true causes, in explain's names."""
    from lpf.rl.formats import read_dump

    d = read_dump(dump)
    rows = {
        (r["step"], r["request_id"]): r
        for r in pq.read_table(dump.with_name(dump.stem + ".causes.parquet")).to_pylist()
    }
    keys = list(zip(d.responses.column("step").to_pylist(), d.responses.column("request_id").to_pylist()))
    comps = np.abs(np.concatenate([np.stack([np.asarray(rows[k][c]) for c in TRUTH], 1) for k in keys]))
    a = np.abs(d.tok_trainer - d.tok_rollout)
    w = comps / np.maximum(comps.sum(1, keepdims=True), 1e-300) * a[:, None]
    per_resp = np.stack([np.bincount(d.tok_resp, weights=w[:, j], minlength=len(keys)) for j in range(len(TRUTH))], 1)
    names = list(TRUTH.values())
    total = dict(zip(names, per_resp.sum(0) / a.sum()))
    by_step, by_resp = {}, {}
    for k, row in zip(keys, per_resp):
        by_step.setdefault(k[0], np.zeros(len(TRUTH)))
        by_step[k[0]] += row
        by_resp[k] = row
    norm = lambda v: dict(zip(names, v / max(v.sum(), 1e-300)))  # noqa: E731
    return total, {s: norm(v) for s, v in by_step.items()}, {k: (v.sum(), norm(v)) for k, v in by_resp.items()}


def _per_step_and_sequence(dump, out_dir, step_truth, resp_truth, tol_step=0.10, tol_resp=0.05):
    steps = pq.read_table(out_dir / "rl_cause_steps.parquet").to_pylist()
    for s in steps:
        for c, v in step_truth[s["step"]].items():
            assert abs(s[f"share_{c}"] - v) <= tol_step, (s["step"], c, s[f"share_{c}"], v)
    resp = pq.read_table(out_dir / "rl_causes.parquet").to_pylist()
    err = mass = 0.0
    for r in resp:
        m, t = resp_truth[(r["step"], r["request_id"])]
        err += m * max(abs(r[f"share_{c}"] - v) for c, v in t.items())
        mass += m
    assert err / mass <= tol_resp, err / mass  # mass-weighted, over every response


@pytest.mark.slow
@pytest.mark.parametrize("drill", DRILLS)
def test_each_drill_alone_goes_to_its_cause(sims, lpf_cli, drill):
    dump = sims[("A", (drill,))]
    b = explain(lpf_cli, dump)
    cause = CAUSE_OF[drill]
    assert b["named"] == [cause] and b["verdict"] == "causes", b["summary"]
    assert b["shares"][cause] >= 0.95, b["shares"]
    assert all(v < 0.05 for c, v in b["shares"].items() if c != cause), b["shares"]
    total, by_step, by_resp = truth(dump)
    assert abs(b["shares"][cause] - total[cause]) <= 0.02
    _per_step_and_sequence(dump, dump.with_name(dump.stem + ".rl"), by_step, by_resp)
    named = next(c for c in b["causes"] if c["cause"] == cause)
    assert named["fix"]["fix"] and named["fix"]["wasted"] and named["share_metric"] >= 0.95


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_two_drills_mixed_each_found_within_ten_points(sims, lpf_cli, pair):
    dump = sims[("A", pair)]
    b = explain(lpf_cli, dump)
    total, by_step, by_resp = truth(dump)
    causes = {CAUSE_OF[d] for d in pair}
    assert set(b["named"]) == causes, (b["named"], b["summary"])
    for c in causes:
        assert abs(b["shares"][c] - total[c]) <= 0.10, (c, b["shares"][c], total[c])
    assert b["shares"]["unexplained"] < 0.05
    _per_step_and_sequence(dump, dump.with_name(dump.stem + ".rl"), by_step, by_resp)


@pytest.mark.slow
def test_raw_logprobs_at_top_p_are_not_called_processed(sims, lpf_cli):
    """The control: sampled at top-p 0.9 but reporting raw logprobs (vLLM's default), with a state
    error on top: the kept mass exists in the reference, the dump does not carry it."""
    dump = sims[("A", ("state-dtype",), (("top_p", 0.9),))]
    b = explain(lpf_cli, dump)
    by = {c["cause"]: c for c in b["causes"]}
    assert (
        by["processed_logprobs"]["status"] == "not found" and abs(by["processed_logprobs"]["test"]["fit"]["beta"]) < 0.1
    )
    assert b["named"] == ["position_growth"] and b["shares"]["position_growth"] >= 0.95


@pytest.mark.slow
def test_a_clean_run_is_inside_the_floor_and_names_nothing(sims, lpf_cli):
    dump = sims[("A", ())]
    r = lpf_cli("rl", "explain", dump, "--fail-on-cause")
    assert r.code == 0 and "inside the dtype floor" in r.err, r.err
    b = json.loads((dump.with_name(dump.stem + ".rl") / "rl_causes.json").read_text())
    assert b["verdict"] == "inside-floor" and b["named"] == [] and b["shares"]["dtype_floor"] >= 0.95
    assert {c["cause"]: c["status"] for c in b["causes"]}["dtype_floor"] == "inside"
    # and a drilled run fails the same gate
    assert lpf_cli("rl", "explain", sims[("A", ("micro-batch",))], "--fail-on-cause").code == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "drills",
    [*((d,) for d in DRILLS), (), ("processed-logprobs", "state-dtype"), ("micro-batch", "stale-policy")],
    ids=lambda d: "+".join(d) or "clean",
)
def test_the_attribution_holds_on_a_second_configuration(sims, lpf_cli, drills):
    """tiny:jamba-longmem, seed 1: another architecture (Mamba1, MoE) and other tokens; not tuned on."""
    dump = sims[("B", drills)]
    b = explain(lpf_cli, dump)
    total, _, _ = truth(dump)
    if not drills:
        assert b["verdict"] == "inside-floor" and b["shares"]["dtype_floor"] >= 0.95
        return
    causes = {CAUSE_OF[d] for d in drills}
    assert set(b["named"]) == causes, b["summary"]
    for c in causes:
        assert abs(b["shares"][c] - total[c]) <= (0.05 if len(drills) == 1 else 0.10), (c, b["shares"], total)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", native.FORMATS)
def test_native_dumps_give_the_same_under_their_own_names(sims, lpf_cli, tmp_path, fmt):
    """The same runs written as prime-rl / NeMo-RL / slime write their dumps, rescored and explained
    from those files: the same causes and shares, the framework's response names and metric."""
    metric = {
        "prime-rl": "mismatch_kl/all/mean",
        "nemo-rl": "token_mult_prob_error",
        "slime": "train_rollout_logprob_abs_diff",
    }[fmt]
    for pair in (("processed-logprobs", "micro-batch"), ("state-dtype", "stale-policy")):
        dump = sims[("A", pair)]
        ours = explain(lpf_cli, dump)
        table = pq.read_table(dump)
        meta = json.loads(table.schema.metadata[b"lpf"])
        root = native.write(fmt, table.to_pylist(), tmp_path / fmt / "+".join(pair), vocab=256)
        policy = meta.get("policy")
        args = [
            "--reference",
            policy["checkpoints"] if policy else meta["spec"]["model"],
            "--top-p",
            meta["sampling"]["top_p"],
        ] + (["--lags", "0,1"] if policy else [])
        r = lpf_cli("rl", "rescore", root, *args)
        assert r.code == 0, r.err
        b = explain(lpf_cli, root, "--rollout-dtype", "float32", "--trainer-dtype", "float32")
        assert b["format"] == fmt and b["framework_metric"]["name"] == metric
        status = {c["cause"]: c["status"] for c in b["causes"]}
        if fmt == "nemo-rl" and "micro-batch" in pair:
            # NeMo-RL's train_data jsonl records no micro-batches: untested, said so, its mass unexplained
            assert status["batch_shape"] == "untested"
            assert "NeMo-RL" in next(c for c in b["causes"] if c["cause"] == "batch_shape")["missing"]
            assert b["named"] == ["processed_logprobs"]
            assert abs(b["shares"]["unexplained"] - ours["shares"]["batch_shape"]) <= 0.02
        else:
            assert b["named"] == ours["named"], (b["named"], ours["named"])
            for c in b["shares"]:
                assert abs(b["shares"][c] - ours["shares"][c]) <= 0.02, (c, b["shares"][c], ours["shares"][c])
        # the framework's identifiers, step by step, as its reader names them
        rows = native.by_step(table.to_pylist())
        want = {(s, native.native_id(fmt, row, i)) for s, rs in rows.items() for i, row in enumerate(rs)}
        got = pq.read_table(root.with_name(root.name + ".rl") / "rl_causes.parquet")
        assert set(zip(got.column("step").to_pylist(), got.column("request_id").to_pylist())) == want
        assert {(w["step"], w["request_id"]) for w in b["worst_responses"]} <= want


@pytest.mark.slow
def test_analyze_carries_the_causes_section(sims, lpf_cli, tmp_path):
    dump = sims[("A", ("processed-logprobs", "micro-batch"))]
    out = dump.with_name(dump.stem + ".rl")
    r = lpf_cli("rl", "analyze", dump, "--json")
    assert r.code == 0, r.err
    f = json.loads(r.out)
    assert f["causes"]["named"] == ["processed_logprobs", "batch_shape"] and "causes:" in f["summary"]
    steps = pq.read_table(out / "rl_steps.parquet")
    for c in ("processed_logprobs", "batch_shape", "dtype_floor", "unexplained"):
        assert f"cause_{c}" in steps.column_names
    np.testing.assert_allclose(
        np.sum([steps.column(f"cause_{c}").to_numpy() for c in f["causes"]["shares"]], 0), 1.0, atol=1e-9
    )
    assert (out / "report.html").is_file() and "causes (causes)" in r.err


@pytest.mark.slow
def test_without_a_reference_the_state_path_is_still_found_and_the_rest_says_what_it_needs(sims, lpf_cli, tmp_path):
    import shutil

    for drills in (("state-dtype",), ("processed-logprobs",)):
        src = sims[("A", drills)]
        dump = tmp_path / src.name
        shutil.copy(src, dump)  # no RL directory beside it: no reference scores
        b = explain(lpf_cli, dump)
        status = {c["cause"]: c["status"] for c in b["causes"]}
        assert status["processed_logprobs"] == status["stale_weights"] == "untested"
        if drills == ("state-dtype",):
            assert b["named"] == ["position_growth"] and b["shares"]["position_growth"] >= 0.9, b["summary"]
        else:  # the offset is systematic: unexplained, with the processed-logprob signature named as a hint
            assert b["named"] == [] and b["shares"]["unexplained"] >= 0.95
            assert any("signature of processed logprobs" in h for h in b["hints"])
