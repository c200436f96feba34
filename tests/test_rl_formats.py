"""`lpf rl analyze` on the dumps RL frameworks really write (fixtures in rl_fixtures.py follow each
framework's writer), and on the ways such dumps go wrong.

For every format: a fault every 7th step on responses FAULTY_IDX; analyze must find exactly those
steps as spikes, the period 7, the faulty responses under the framework's own identifiers and no
other response; the per-step metrics must equal the framework's own formula, computed here from the
files as the framework's code does (padded matrices, its masks, its averaging), not through lpf.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rl_fixtures as fx

STEPS_1 = range(1, 29)  # prime-rl, NeMo-RL and verl count steps from 1
FAULTY_1 = {7, 14, 21, 28}
STEPS_0 = range(0, 28)  # slime's rollout ids count from 0
FAULTY_0 = {7, 14, 21}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    run1, run0 = fx.make_run(STEPS_1, FAULTY_1), fx.make_run(STEPS_0, FAULTY_0, seed=1)
    return {
        "prime-rl": (fx.write_prime_rl(run1, root / "prime"), run1),
        "nemo-rl": (fx.write_nemo_rl(run1, root / "nemo" / "exp_001"), run1),
        "slime": (fx.write_slime(run0, root / "slime"), run0),
        "verl": (fx.write_verl(run1, root / "verl"), run1),
    }


def expected(fmt: str, run) -> dict[int, set[str]]:
    name = {
        "prime-rl": lambda r: fx.prime_rl_faulty_ids(r)[0],
        "nemo-rl": lambda r: f"idx_{r.index}",
        "slime": lambda r: f"sample_{fx.slime_index(r)}",
        "verl": lambda r: f"line_{r.index + 1}",
    }[fmt]
    out = {}
    for step in run:
        bad = {name(r) for r in step if r.faulty}
        if bad:
            out[step[0].step] = bad
    return out


def analyze(lpf_cli, dump, out, *args):
    r = lpf_cli("rl", "analyze", dump, "--out", out, "--json", *args)
    assert r.code == 0, r.err
    return json.loads(r.out), pq.read_table(out / "rl_steps.parquet")


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl", "slime", "verl"])
def test_faulty_steps_and_responses_are_found_by_their_own_names(written, lpf_cli, tmp_path, fmt):
    path, run = written[fmt]
    f, _ = analyze(lpf_cli, path, tmp_path / "o")
    want = expected(fmt, run)
    assert f["format"] == fmt and not f["bad_rows"], f["bad_rows"][:3]
    assert f["spike_steps"] == sorted(want), f["summary"]
    assert f["period"]["period"] == pytest.approx(7.0) and f["period"]["confidence"] > 0.99
    assert {s["step"]: set(s["requests"]) for s in f["spikes"]} == want
    assert f["implicated"]["n"] == sum(len(v) for v in want.values()) and f["implicated"]["outside_spike_steps"] == 0
    # the lie starts at the 4th token of the last model turn: its first off position says so
    assert all(int(p) >= 3 for s in f["spikes"] for p in s["positions"])
    # and the same command with the format forced reads the same thing
    g, _ = analyze(lpf_cli, path, tmp_path / "forced", "--format", fmt)
    assert g["spike_steps"] == f["spike_steps"]


def test_each_format_names_responses_and_skips_what_the_framework_skips(written, lpf_cli, tmp_path):
    f, _ = analyze(lpf_cli, written["prime-rl"][0], tmp_path / "p")
    # a multi-turn sample is one response per model turn (span); the STABLE markers are no data
    assert f["n_responses"] == 28 * (fx.RESPONSES + 1) and f["ignored_files"] == []
    logs = tmp_path / "logs"  # NeMo-RL's log dir: the experiment folder, and validation logs beside the training data
    shutil.copytree(written["nemo-rl"][0], logs / "exp_001")
    (logs / "exp_001" / "val_data_step0.jsonl").write_text(
        json.dumps({"content": [["q", "a"]], "rewards": [1.0]}) + "\n"
    )
    f, _ = analyze(lpf_cli, logs, tmp_path / "n")
    assert f["n_responses"] == 28 * (fx.RESPONSES - 1) and len(f["skipped_rows"]) == 28
    assert "sample_loss_mask 0" in f["skipped_rows"][0]["reason"] and f["skipped_rows"][0]["file"].startswith(
        "exp_001/"
    )
    assert f["ignored_files"] == ["exp_001/val_data_step0.jsonl"]
    f, _ = analyze(lpf_cli, written["slime"][0] / "train_data", tmp_path / "s")  # without the rollout side
    assert f["n_responses"] == 28 * fx.RESPONSES and f["format"] == "slime"


# -- the frameworks' own formulas, from the files, as their code computes them ---------------------
def _torch_median(v: np.ndarray) -> float:
    return float(np.sort(v)[(v.size - 1) // 2])  # torch.median: the lower of the two middle values


def test_prime_rl_mismatch_kl_is_prime_rls(written, lpf_cli, tmp_path):
    path, _ = written["prime-rl"]
    _, steps = analyze(lpf_cli, path, tmp_path / "o")
    got = {r["step"]: r for r in steps.to_pylist()}
    for step_dir in sorted(path.iterdir()):
        recs = [json.loads(line) for f in sorted(step_dir.glob("rank_*.jsonl")) for line in f.read_text().splitlines()]
        mask = np.concatenate([np.asarray(r["loss_mask"], bool) for r in recs])
        t = np.concatenate([np.asarray(r["trainer_logprobs"], np.float64) for r in recs])[mask]
        i = np.concatenate([np.asarray(r["inference_logprobs"], np.float64) for r in recs])[mask]
        exported = np.concatenate([np.asarray(r["mismatch_kl"], np.float64) for r in recs])[mask]
        lr = t - i
        mkl = np.exp(lr) - lr - 1  # compute_importance_ratio_and_mismatch_kl
        g = got[recs[0]["step"]]
        assert g["mismatch_kl_mean"] == pytest.approx(mkl.mean(), rel=1e-9)
        assert g["mismatch_kl_max"] == pytest.approx(mkl.max(), rel=1e-9)
        assert g["mismatch_kl_median"] == pytest.approx(_torch_median(mkl), rel=1e-6)
        # and the export's own float32 column agrees to float32 rounding
        assert abs(g["mismatch_kl_mean"] - exported.mean()) < 2e-6 + 1e-5 * exported.mean()


def _nemo_matrices(path):
    gen, prev, tmask, smask = [], [], [], []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        gen.append(r["generation_logprobs"][0])
        prev.append(r["prev_logprobs"][0])
        tmask.append(r["token_loss_mask"][0])
        smask.append(r["sample_loss_mask"][0])
    a = [np.asarray(x, np.float64) for x in (gen, prev, tmask)]
    return a[0][:, 1:], a[1][:, 1:], a[2][:, 1:] * np.asarray(smask, np.float64)[:, None]


def test_nemo_rl_metrics_are_nemo_rls(written, lpf_cli, tmp_path):
    path, _ = written["nemo-rl"]
    _, steps = analyze(lpf_cli, path, tmp_path / "o")
    got = {r["step"]: r for r in steps.to_pylist()}
    for f in path.glob("train_data_step*.jsonl"):
        g, p, m = _nemo_matrices(f)  # ClippedPGLossFn: [:, 1:] and token_mask * sample_mask
        ntok = m.sum()
        mult = (np.exp(np.abs(g - p) * m) * m).sum() / ntok
        logr = p - g
        gen_kl = ((np.exp(logr) - 1 - logr) * m).sum() / ntok
        pol_kl = ((np.exp(-logr) - 1 + logr) * m).sum() / ntok
        mix = np.log(0.5 * np.exp(p) + 0.5 * np.exp(g))
        js = ((0.5 * (np.exp(p - mix) - (p - mix) - 1) + 0.5 * (np.exp(g - mix) - (g - mix) - 1)) * m).sum() / ntok
        valid = m.sum(1) > 0
        seq = ((np.exp(np.abs(g - p) * m) * m).sum(1)[valid] / m.sum(1)[valid]).max()
        r = got[int(f.stem.removeprefix("train_data_step"))]
        for name, want in (
            ("token_mult_prob_error", mult),
            ("gen_kl_error", gen_kl),
            ("policy_kl_error", pol_kl),
            ("js_divergence_error", js),
            ("max_seq_mult_prob_error", seq),
        ):
            assert r[name] == pytest.approx(want, rel=1e-7, abs=1e-12), (f.name, name)


def test_slime_abs_diff_is_slimes_per_sample_mean_not_a_token_mean(written, lpf_cli, tmp_path):
    import torch

    path, _ = written["slime"]
    _, steps = analyze(lpf_cli, path, tmp_path / "o")
    got = {r["step"]: r for r in steps.to_pylist()}
    apart = []
    for f in sorted((path / "train_data").glob("*.pt")):
        payload = torch.load(f, weights_only=True)
        samples = payload["samples"]
        # loss.py: sum_of_sample_mean(|old_log_probs - rollout_log_probs|), denominators rollout_mask_sums;
        # train_metric_utils.reduce_train_step_metrics divides by step_global_batch_size (rollouts)
        absd = [(s["log_probs"].double() - s["rollout_log_probs"].double()).abs() * s["loss_masks"] for s in samples]
        total = sum(float(a.sum()) / max(float(s["rollout_mask_sums"]), 1.0) for a, s in zip(absd, samples))
        per_sample = total / payload["dp_shards"][0]["global_batch_sizes"][0]
        # --calculate-per-token-loss: sum over tokens / sum of clamp_min(mask.sum(), 1)
        per_token = sum(float(a.sum()) for a in absd) / sum(max(int(s["loss_masks"].sum()), 1) for s in samples)
        r = got[payload["rollout_id"]]
        assert r["train_rollout_logprob_abs_diff"] == pytest.approx(per_sample, rel=1e-9)
        assert r["train_rollout_logprob_abs_diff_per_token"] == pytest.approx(per_token, rel=1e-9)
        if r["spike"]:
            apart.append(abs(per_sample / per_token - 1))
    assert len(apart) == 3 and min(apart) > 0.02  # on a spiking step the two averagings tell different numbers


def test_verl_metrics_are_verls(written, lpf_cli, tmp_path):
    path, _ = written["verl"]
    _, steps = analyze(lpf_cli, path, tmp_path / "o")
    got = {r["step"]: r for r in steps.to_pylist()}
    for f in path.glob("*.jsonl"):
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        old = np.asarray([r["old_log_probs"] for r in rows], np.float64)
        roll = np.asarray([r["rollout_log_probs"] for r in rows], np.float64)
        m = np.asarray([r["response_mask"] for r in rows], np.float64)
        b = m.astype(bool)
        # verl/utils/debug/metrics.py calculate_debug_metrics
        pd = np.abs(np.exp(old) - np.exp(roll))[b]
        corr = np.corrcoef(np.exp(old)[b], np.exp(roll)[b])[0, 1]
        # verl/trainer/ppo/rollout_corr_helper.py compute_offpolicy_metrics (masked_mean adds 1e-8)
        lr = old - roll
        k3 = ((np.exp(lr) - lr - 1) * m).sum() / (m.sum() + 1e-8)
        rho = np.exp(np.clip(lr, -20, 20))
        chi2_token = (rho**2 * m).sum() / (m.sum() + 1e-8) - 1
        chi2_seq = np.mean(np.exp(2 * np.clip((lr * m).sum(1), -20, 20))) - 1
        lpd = (roll * m).sum(1) / (m.sum(1) + 1e-8) - (old * m).sum(1) / (m.sum(1) + 1e-8)
        # compute_is_metrics, token level, rollout_is_threshold 2.0
        w = np.clip(rho * m, 0.5, 2.0)
        ess = 1.0 / ((w / ((w * m).sum() / (m.sum() + 1e-8) + 1e-8)) ** 2 * m).sum() * (m.sum() + 1e-8)
        r = got[rows[0]["step"]]
        for name, want, rel in (
            ("rollout_probs_diff_max", pd.max(), 1e-12),
            ("rollout_probs_diff_mean", pd.mean(), 1e-12),
            ("rollout_probs_diff_std", pd.std(ddof=1), 1e-9),
            ("rollout_actor_probs_pearson_corr", corr, 1e-9),
            ("k3_kl", k3, 1e-7),
            ("chi2_token", chi2_token, 1e-5),  # verl's +1e-8 before the - 1
            ("chi2_seq", chi2_seq, 1e-7),
            ("log_ppl_diff", lpd.mean(), 1e-7),
            ("ppl_ratio", np.exp(lpd).mean(), 1e-7),
            ("rollout_is_eff_sample_size", ess, 1e-7),
        ):
            assert r[name] == pytest.approx(want, rel=rel, abs=1e-12), (f.name, name)


# -- content, not names; and dumps that go wrong ---------------------------------------------------
def test_formats_are_told_by_content_not_by_suffix(written, lpf_cli, tmp_path):
    src = written["prime-rl"][0] / "step_7" / "rank_1.jsonl"
    odd = tmp_path / "exported.dat"
    shutil.copy(src, odd)
    f, _ = analyze(lpf_cli, odd, tmp_path / "o")
    assert f["format"] == "prime-rl" and f["spike_steps"] == [7]
    # a Parquet dump without a suffix (what `rl simulate --out runs/wrap` used to write)
    rows = [
        {
            "step": s,
            "request_id": f"r{i}",
            "response_token_ids": [5, 6, 7],
            "rollout_logprobs": [-0.5, -0.2, -0.1],
            "trainer_logprobs": [-0.5, -0.2, -0.1],
        }
        for s in (1, 2)
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "wrap")
    f, _ = analyze(lpf_cli, tmp_path / "wrap", tmp_path / "w")
    assert f["format"] == "lpf" and f["n_responses"] == 6


def _one_line_error(r, *words):
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert len(r.err.strip().splitlines()) <= 3, r.err  # one message (rich may wrap a long line)
    for w in words:
        assert w in r.err, (w, r.err)


def test_mixed_truncated_and_unreadable_dumps(written, lpf_cli, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(written["prime-rl"][0] / "step_1", mixed / "step_1")
    shutil.copy(next(written["nemo-rl"][0].glob("train_data_step1.jsonl")), mixed / "train_data_step1.jsonl")
    _one_line_error(lpf_cli("rl", "analyze", mixed), "mixed dump formats", "prime-rl", "nemo-rl")
    # a JSONL cut off mid-line: the torn line is a bad row, the rest is read
    cut = tmp_path / "cut"
    shutil.copytree(written["nemo-rl"][0], cut)
    p = cut / "train_data_step28.jsonl"
    p.write_text(p.read_text()[:-200])
    f, _ = analyze(lpf_cli, cut, tmp_path / "o")
    assert [b["row"] for b in f["bad_rows"]] == [8] and "cut off" in f["bad_rows"][0]["reason"]
    assert f["spike_steps"] == sorted(FAULTY_1)
    # a torch file cut off
    t = tmp_path / "t"
    shutil.copytree(written["slime"][0] / "train_data", t)
    data = (t / "3.pt").read_bytes()
    (t / "3.pt").write_bytes(data[: len(data) // 2])
    _one_line_error(lpf_cli("rl", "analyze", t), "3.pt", "not a readable torch file")
    # not a dump at all
    (tmp_path / "junk.bin").write_bytes(bytes(range(256)) * 4)
    _one_line_error(lpf_cli("rl", "analyze", tmp_path / "junk.bin"), "neither Parquet, JSON lines nor a torch file")
    (tmp_path / "empty").mkdir()
    _one_line_error(lpf_cli("rl", "analyze", tmp_path / "empty"), "no dump files")


def test_slime_files_are_loaded_weights_only(written, lpf_cli, tmp_path):
    import torch

    d = tmp_path / "train_data"
    d.mkdir()
    payload = torch.load(written["slime"][0] / "train_data" / "0.pt", weights_only=True)
    payload["samples"][0]["tokens"] = np.asarray(payload["samples"][0]["tokens"])  # needs numpy's unpickler
    torch.save(payload, d / "0.pt")
    _one_line_error(lpf_cli("rl", "analyze", d), "weights_only=True", "numpy", "never runs pickled code")
    only_rollout = written["slime"][0] / "rollout_data"
    _one_line_error(lpf_cli("rl", "analyze", only_rollout), "engine side only", "train_data")
    # a checkpoint beside the dumps is no dump: ignored in a directory, refused alone
    mixed = tmp_path / "dump"
    shutil.copytree(written["slime"][0] / "train_data", mixed / "train_data")
    torch.save({"layer.weight": torch.zeros(2, 2)}, mixed / "model.pt")
    f, _ = analyze(lpf_cli, mixed, tmp_path / "o")
    assert f["format"] == "slime" and f["ignored_files"] == ["model.pt"] and f["n_responses"] == 28 * fx.RESPONSES
    _one_line_error(lpf_cli("rl", "analyze", mixed / "model.pt"), "not a slime debug dump")


def test_missing_fields_are_named(written, lpf_cli, tmp_path):
    src = written["nemo-rl"][0] / "train_data_step3.jsonl"
    recs = [json.loads(x) for x in src.read_text().splitlines()]
    p = tmp_path / "train_data_step3.jsonl"
    p.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "prev_logprobs"}) + "\n" for r in recs))
    _one_line_error(lpf_cli("rl", "analyze", p), "missing required column(s) prev_logprobs", "nemo-rl")
    _one_line_error(lpf_cli("rl", "analyze", src, "--format", "prime-rl"), "prime-rl", "inference_logprobs")
    _one_line_error(lpf_cli("rl", "analyze", src, "--format", "slime"), "not a torch file", "--dump-details")
    # NeMo-RL with the trainer recomputation skipped: prev_logprobs all 0
    p.write_text("".join(json.dumps({**r, "prev_logprobs": [[0.0] * len(r["prev_logprobs"][0])]}) + "\n" for r in recs))
    _one_line_error(lpf_cli("rl", "analyze", p), "prev_logprobs are all 0", "force_on_policy_ratio")
    # the step lives in NeMo-RL's file name only
    q = tmp_path / "renamed.jsonl"
    shutil.copy(src, q)
    _one_line_error(lpf_cli("rl", "analyze", q), "no usable rows", "train_data_step{N}")


def test_bad_rows_of_native_formats(written, lpf_cli, tmp_path):
    src = written["prime-rl"][0] / "step_7" / "rank_0.jsonl"
    recs = [json.loads(x) for x in src.read_text().splitlines()]
    recs[1]["mismatch_kl"][-1] = 5.0  # the export's columns disagree with each other
    recs[2]["trainer_logprobs"][-1] = None  # a non-finite logprob, written as null
    recs[3]["rl_weights"] = [0.0] * len(recs[3]["token_ids"])  # a ce-only sample: nothing sampled
    p = tmp_path / "rank_0.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    f, _ = analyze(lpf_cli, p, tmp_path / "o")
    reasons = {b["row"]: b["reason"] for b in f["bad_rows"]}
    assert set(reasons) == {2, 3} and "disagree" in reasons[2] and "null" in reasons[3]
    assert [(x["row"], "ce-only" in x["reason"]) for x in f["skipped_rows"]] == [(4, True)]
    r = lpf_cli("rl", "analyze", p, "--out", tmp_path / "o2", "--strict")
    _one_line_error(r, "row 2", "disagree")
    nemo = written["nemo-rl"][0] / "train_data_step2.jsonl"
    recs = [json.loads(x) for x in nemo.read_text().splitlines()]
    recs[0]["token_ids"] = recs[0]["token_ids"] * 2  # a batch dimension of 2
    q = tmp_path / "train_data_step2.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in recs))
    f, _ = analyze(lpf_cli, q, tmp_path / "o3")
    assert f["bad_rows"] == [{"row": 1, "reason": "token_ids has a batch dimension of 2, expected 1"}]
