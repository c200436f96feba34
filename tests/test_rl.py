"""`lpf rl simulate` / `lpf rl analyze`: real built-in engine, real reference rescorer, real CLI.

The offset-wrap runs use the lever-table geometry (docs/rl.md, "The seed's lever table"): zoo:hybrid's state slot
stride is 14,880 elements, so under offset-wrap:20 slots >= 71 write their final prefill state to a
wrapped offset; a 9 MB cache holds 79 slots (71..78 poisoned), an 8 MB cache 70 (none). With 16
rollouts of 1 prompt per step the slot sweep first reaches slot 71 at step ceil(72 / 16) = 5 and comes
back every 79 / 16 ~ 4.9 steps. Ground truth (the simulator's faults file) is read only by the tests.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import lpf_main


def simulate(out, *args):
    p = lpf_main("rl", "simulate", "--out", out, *args)
    assert p.returncode == 0, p.stderr
    return out


SIMULATIONS = {
    "clean": ("--steps", 50, "--rollouts", 2, "--max-tokens", 6),
    "wrap": ("--steps", 15, "--rollouts", 16, "--cache-mb", 9, "--inject", "offset-wrap:20"),
    "small": ("--steps", 10, "--rollouts", 16, "--cache-mb", 8, "--inject", "offset-wrap:20"),
    # the real RL setting: a bfloat16 rollout engine against a float32 trainer (bf16 halves the
    # slot size, so 4.5 MB holds the same 79 slots)
    "bf16": ("--steps", 50, "--rollouts", 4, "--dtype", "bfloat16"),
    "bf16_wrap": (
        "--steps",
        12,
        "--rollouts",
        16,
        "--dtype",
        "bfloat16",
        "--cache-mb",
        4.5,
        "--inject",
        "offset-wrap:20",
    ),
}


class Dumps(dict):
    """Each simulated dump made on first use (a test that needs one pays for that one only)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        self[name] = simulate(self.root / f"{name}.parquet", *SIMULATIONS[name])
        return self[name]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return Dumps(tmp_path_factory.mktemp("rl"))


def analyze(lpf_cli, dump, out, *args):
    r = lpf_cli("rl", "analyze", dump, "--out", out, "--json", *args)
    return r, (json.loads(r.out) if r.out.strip() else None)


@pytest.mark.slow
def test_no_fault_every_step_within_noise_floor(dumps, lpf_cli, tmp_path):
    r, f = analyze(lpf_cli, dumps["clean"], tmp_path / "c", "--fail-on-spike")
    assert r.code == 0, r.err
    assert f["n_steps"] == 50 and f["n_responses"] == 100 and not f["bad_rows"]
    assert f["n_spikes"] == 0 and f["spikes"] == [] and f["verdict"] == "clean" and f["implicated"]["n"] == 0
    steps = pq.read_table(tmp_path / "c" / "rl_steps.parquet")
    assert steps.num_rows == 50 and not any(steps.column("spike").to_pylist())
    # engine and trainer both float32 on the same weights: agreement to rounding on every step
    assert max(steps.column("max_abs_logprob_diff").to_pylist()) < 1e-3
    assert min(steps.column("ess").to_pylist()) > 0.999
    assert "within the noise floor" in r.err


@pytest.mark.slow
def test_offset_wrap_spikes_are_periodic_and_named(dumps, lpf_cli, tmp_path):
    r, f = analyze(lpf_cli, dumps["wrap"], tmp_path / "w", "--fail-on-spike")
    assert r.code == 1, r.err  # --fail-on-spike
    assert f["first_spike_step"] == 5, f["spike_steps"]
    assert len(f["spike_steps"]) >= 3 and f["period"]["period"] is not None
    assert abs(f["period"]["period"] - 79 / 16) <= 1.0, f["period"]
    top = f["hypotheses"][0]
    assert top["feature"] == "state_slot_max >= 71" and top["clean_with"] == 0
    assert "71..78" in top["sentence"] and "2^20" in top["sentence"]
    # localisation: the wrapped prefill leaves the slot unwritten, so the first decode (position 1) is off
    assert f["implicated"]["first_divergence"]["positions"].get("1", 0) >= 0.8 * f["implicated"]["n"]
    listed = {rid for s in f["spikes"] for rid in s["requests"]}
    dump = pq.read_table(dumps["wrap"]).to_pylist()
    truth = pq.read_table(dumps["wrap"].with_name("wrap.faults.parquet")).to_pylist()
    wrapped = {t["request_id"] for t in truth if t["role"] == "corrupted"}
    length = {d["request_id"]: len(d["response_token_ids"]) for d in dump}
    # every wrapped request that decoded at all (>= 2 tokens) is found; nothing outside the truth is
    assert {w for w in wrapped if length[w] >= 2} <= listed
    touched = wrapped | {t["request_id"] for t in truth}
    assert listed <= touched
    steps = pq.read_table(tmp_path / "w" / "rl_steps.parquet").to_pylist()
    assert {s["step"] for s in steps if s["spike"]} == set(f["spike_steps"])
    assert all(s["k3_kl"] > 1e-3 for s in steps if s["spike"]) and all(
        s["k3_kl"] < 1e-9 for s in steps if not s["spike"]
    )


@pytest.mark.slow
def test_bf16_rollouts_noise_is_not_a_spike_and_the_wrap_still_is(dumps, lpf_cli, tmp_path):
    r, f = analyze(lpf_cli, dumps["bf16"], tmp_path / "b")
    assert r.code == 0 and f["n_steps"] == 50 and f["n_spikes"] == 0, f["summary"]
    steps = pq.read_table(tmp_path / "b" / "rl_steps.parquet")
    assert max(steps.column("max_abs_logprob_diff").to_pylist()) > 1e-3  # real bf16 noise, well above rounding
    r, f = analyze(lpf_cli, dumps["bf16_wrap"], tmp_path / "w")
    assert f["first_spike_step"] == 5 and f["hypotheses"][0]["feature"] == "state_slot_max >= 71", f["summary"]
    assert f["hypotheses"][0]["clean_with"] == 0


@pytest.mark.slow
def test_smaller_cache_no_spike(dumps, lpf_cli, tmp_path):
    r, f = analyze(lpf_cli, dumps["small"], tmp_path / "s")
    assert r.code == 0 and f["n_spikes"] == 0, f["summary"]
    meta = f["simulation"]["engine"]
    assert meta["num_state_slots"] * meta["state_slot_stride"] <= 2**20  # no slot id reaches the wrap
    assert not dumps["small"].with_name("small.faults.parquet").exists()


# -- the third opinion: lpf rl rescore -------------------------------------------------------------
@pytest.mark.slow
def test_rescore_puts_every_offset_wrap_spike_on_the_rollout_side(dumps, lpf_cli, tmp_path):
    out = tmp_path / "w.rl"
    r = lpf_cli("rl", "rescore", dumps["wrap"], "--out", out)  # --reference: the model the dump names
    assert r.code == 0, r.err
    assert (out / "reference.parquet").is_file() and "next: lpf rl analyze" in r.err
    r, f = analyze(lpf_cli, dumps["wrap"], out)
    assert r.code == 0 and len(f["spikes"]) >= 3, r.err
    # drawn with the three curves (tests/test_report.py renders such a page in Chromium)
    assert "report:" in r.err and "report not written" not in r.err and (out / "report.html").is_file()
    assert {s["side"] for s in f["spikes"]} == {"rollout"}
    assert {side for s in f["spikes"] for side in s["request_sides"]} == {"rollout"}
    assert (
        f["reference"]["spikes"]["rollout"] == f["n_spikes"] and "every spike is the rollout engine's" in f["summary"]
    )
    steps = pq.read_table(out / "rl_steps.parquet").to_pylist()
    # the three curves: on spike steps the rollout leaves the reference; the float32 trainer never does
    assert all(s["rollout_ref_abs_diff"] > 1e-3 for s in steps if s["spike"])
    assert max(s["trainer_ref_abs_diff"] for s in steps) < 1e-4


@pytest.mark.slow
def test_rescore_puts_a_trainer_side_lie_on_the_trainer(dumps, lpf_cli, tmp_path):
    table = pq.read_table(dumps["wrap"])
    rows = table.to_pylist()
    for row in rows:  # the rollout engine now agrees with the reference; the trainer carries the lie
        row["rollout_logprobs"], row["trainer_logprobs"] = row["trainer_logprobs"], row["rollout_logprobs"]
    dump = tmp_path / "trainer-lie.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), dump)
    r = lpf_cli("rl", "rescore", dump, "--reference", "zoo:hybrid")
    assert r.code == 0, r.err
    r, f = analyze(lpf_cli, dump, tmp_path / "trainer-lie.rl")
    assert len(f["spikes"]) >= 3 and {s["side"] for s in f["spikes"]} == {"trainer"}, f["summary"]
    assert "every spike is the trainer's" in f["summary"]


def test_rescore_and_reference_errors_are_one_line(tmp_path, lpf_cli):
    p = write_jsonl(tmp_path / "d.jsonl", [good(i) for i in range(3)])  # no prompt_token_ids
    r = lpf_cli("rl", "rescore", p)
    assert r.code == 2 and "--reference is required" in r.err and "Traceback" not in r.err
    r = lpf_cli("rl", "rescore", p, "--reference", "zoo:hybrid")
    assert r.code == 2 and "carry no prompt token ids" in r.err and "prompt_token_ids" in r.err
    # a reference file made for other tokens is refused, not silently joined
    out = tmp_path / "d.rl"
    out.mkdir()
    pq.write_table(
        pa.table(
            {
                "step": [1, 1, 1],
                "request_id": ["r0"] * 3,
                "position": pa.array([0, 1, 2], pa.int32()),
                "token_id": [3, 4, 99],
                "reference_logprob": [-0.1, -0.2, -0.3],
            }
        ),
        out / "reference.parquet",
    )
    r = lpf_cli("rl", "analyze", p)
    assert r.code == 2 and "made for another dump" in r.err and "Traceback" not in r.err


@pytest.mark.parametrize(
    "args, said",
    [
        (["--reference", "self"], "--reference self re-scores on an audited server, and a dump has none"),
        (["--reference", "http://127.0.0.1:1/v1"], "needs --reference-model NAME"),
        (["--reference", "http://127.0.0.1:1/v1", "--reference-model", "M"], "needs --model (the local copy"),
        (["--reference", "zoo:hybrid", "-R", "max_model_len=64"], "-R/--reference-option goes with --reference vllm:"),
        (["--reference", "zoo:hybrid", "--model", "zoo:hybrid"], "--model goes with --reference http(s)://"),
        (
            ["--reference", "vllm:zoo:hybrid", "-R", "enable_prefix_caching=true"],
            "the vLLM reference configuration fixes",
        ),
    ],
)
def test_a_server_reference_that_cannot_apply_is_refused_in_one_line(tmp_path, lpf_cli, args, said):
    """`lpf rl rescore` takes `lpf audit`'s reference strings, built and checked by the audit's own code."""
    p = write_jsonl(tmp_path / "d.jsonl", [good(i, prompt_token_ids=[1, 2]) for i in range(3)])
    r = lpf_cli("rl", "rescore", p, *args)
    assert r.code == 2 and said in r.err, r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "d.rl").exists()


@pytest.mark.slow
def test_simulate_into_a_directory_then_analyze_it_as_a_new_user_would(lpf_cli, tmp_path):
    out = tmp_path / "runs" / "wrap"
    p = lpf_main("rl", "simulate", "--steps", 3, "--rollouts", 2, "--max-tokens", 4, "--out", out)
    assert p.returncode == 0, p.stderr
    assert (out / "dump.parquet").is_file() and f"next: lpf rl analyze {out}" in p.stderr
    r = lpf_cli("rl", "analyze", out)
    assert r.code == 0, r.err
    f = json.loads((tmp_path / "runs" / "wrap.rl" / "rl_findings.json").read_text())
    assert f["format"] == "lpf" and f["n_responses"] == 6 and f["n_steps"] == 3


# -- verl --------------------------------------------------------------------------------------------
def to_verl(rows: list[dict], width: int, prompt_width: int = 0, inner_gap: bool = False) -> list[dict]:
    """Rows as verl's rollout_data_dir JSONL would carry them with the DataProto fields added:
    right-padded `responses` (pad id 0), `response_mask`, `rollout_log_probs` padded with -1 (verl's
    vLLM rollout pads with -1), `old_log_probs` (the actor recomputation, padding 0), `uid`."""
    out = []
    for r in rows:
        n = len(r["response_token_ids"])
        pad = width - n
        rec = {
            "input": "<prompt text>",
            "output": "<response text>",
            "gts": None,
            "score": 0.0,
            "step": r["step"],
            "uid": r["prompt_id"],
            "request_id": r["request_id"],
            "responses": r["response_token_ids"] + [0] * pad,
            "rollout_log_probs": r["rollout_logprobs"] + [-1.0] * pad,
            "old_log_probs": r["trainer_logprobs"] + [0.0] * pad,
        }
        mask = [1] * n + [0] * pad
        if inner_gap and n >= 3:  # a tool-output token inside a multi-turn response: masked out
            mask[1] = 0
            rec["rollout_log_probs"][1] = 0.0
        if prompt_width:
            rec["attention_mask"] = [1] * prompt_width + mask
        else:
            rec["response_mask"] = mask
        out.append(rec)
    return out


def write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.mark.slow
def test_verl_rollout_dir_matches_lpf_layout(dumps, lpf_cli, tmp_path):
    rows = pq.read_table(dumps["wrap"]).to_pylist()
    width = max(len(r["response_token_ids"]) for r in rows) + 3
    vdir = tmp_path / "rollout_data"
    vdir.mkdir()
    for step in sorted({r["step"] for r in rows}):  # one <global_steps>.jsonl per step, as verl writes
        write_jsonl(vdir / f"{step}.jsonl", to_verl([r for r in rows if r["step"] == step], width))
    r1, lpf_f = analyze(lpf_cli, dumps["wrap"], tmp_path / "a")
    r2, verl_f = analyze(lpf_cli, vdir, tmp_path / "b")
    assert r2.code == 0, r2.err
    assert verl_f["format"] == "verl" and lpf_f["format"] == "lpf" and not verl_f["bad_rows"]
    assert verl_f["spike_steps"] == lpf_f["spike_steps"] and verl_f["n_tokens"] == lpf_f["n_tokens"]
    a = pq.read_table(tmp_path / "a" / "rl_steps.parquet")
    b = pq.read_table(tmp_path / "b" / "rl_steps.parquet")
    for col in ("k3_kl", "rollout_probs_diff_max", "chi2_token", "ess", "token_mult_prob_error"):
        np.testing.assert_allclose(a.column(col).to_numpy(), b.column(col).to_numpy(), rtol=1e-12)
    # the GRPO group id became the prompt: hypotheses see it
    assert "uid" not in verl_f["hypotheses"][0]["feature"]


def test_verl_attention_mask_and_multiturn_mask(tmp_path, lpf_cli):
    rows = [
        {
            "step": 1,
            "prompt_id": "p",
            "request_id": f"q{i}",
            "response_token_ids": [5, 6, 7, 8],
            "rollout_logprobs": [-0.1, -0.2, -0.3, -0.4],
            "trainer_logprobs": [-0.1, -0.2, -0.3, -0.4],
        }
        for i in range(3)
    ]
    recs = to_verl(rows, width=6, prompt_width=4, inner_gap=True)
    recs[0]["old_log_probs"][1] = -9.0  # inside the masked tool output: must not count
    r, f = analyze(lpf_cli, write_jsonl(tmp_path / "v.jsonl", recs), tmp_path / "o")
    assert r.code == 0, r.err
    assert f["n_tokens"] == 9 and f["metrics"]["k3_kl"]["max"] == 0.0


def test_verl_text_only_dump_is_refused_with_a_reason(tmp_path, lpf_cli):
    p = write_jsonl(tmp_path / "3.jsonl", [{"input": "a", "output": "b", "gts": "c", "score": 1.0, "step": 3}])
    r = lpf_cli("rl", "analyze", p)
    assert r.code == 2 and "no logprobs" in r.err and "rollout_log_probs" in r.err and "Traceback" not in r.err


# -- the metrics, against their frameworks' definitions ---------------------------------------------
def test_step_metrics_follow_the_framework_definitions():
    """One step of two responses (a unit each); the formulas as the frameworks write them (the native
    fixtures of test_rl_formats.py check every metric against each framework's own files)."""
    from lpf.rl.metrics import series, token_terms

    r = np.array([-0.5, -1.0, -2.0, -0.1, -0.3])
    t = np.array([-0.6, -0.7, -2.0, -3.0, -0.2])
    tok_resp = np.array([0, 0, 0, 1, 1])
    g = series(np.zeros(5, dtype=int), np.zeros(2, dtype=int), tok_resp, np.arange(2), 1, token_terms(r, t))
    d = t - r
    pd = np.abs(np.exp(t) - np.exp(r))
    rho = np.exp(d)
    k3 = rho - d - 1
    assert g["rollout_probs_diff_max"][0] == pytest.approx(pd.max())
    assert g["rollout_probs_diff_std"][0] == pytest.approx(pd.std(ddof=1))  # torch.std is unbiased
    assert g["k3_kl"][0] == pytest.approx(k3.mean()) and g["gen_kl_error"][0] == g["k3_kl"][0]
    assert g["mismatch_kl_median"][0] == pytest.approx(np.sort(k3)[2]) and g["mismatch_kl_max"][0] == pytest.approx(
        k3.max()
    )
    assert g["chi2_token"][0] == pytest.approx(np.mean(rho**2) - 1)
    assert g["ess"][0] == pytest.approx(rho.sum() ** 2 / (5 * (rho**2).sum()))
    w = np.clip(rho, 0.5, 2.0)
    assert g["rollout_is_eff_sample_size"][0] == pytest.approx(w.mean() ** 2 / (w**2).mean())
    seq = [d[:3], d[3:]]
    assert g["chi2_seq"][0] == pytest.approx(np.mean([np.exp(2 * s.sum()) for s in seq]) - 1)
    assert g["log_ppl_diff"][0] == pytest.approx(np.mean([-s.mean() for s in seq]))
    assert g["ppl_ratio"][0] == pytest.approx(np.mean([np.exp(-s.mean()) for s in seq]))
    # slime: per-sample mean, then over samples (default); per token with --calculate-per-token-loss
    assert g["train_rollout_logprob_abs_diff"][0] == pytest.approx(np.mean([np.abs(s).mean() for s in seq]))
    assert g["train_rollout_logprob_abs_diff_per_token"][0] == pytest.approx(np.abs(d).mean())
    assert g["token_mult_prob_error"][0] == pytest.approx(np.exp(np.abs(d)).mean())
    assert g["max_seq_mult_prob_error"][0] == pytest.approx(max(np.exp(np.abs(s)).mean() for s in seq))
    assert g["policy_kl_error"][0] == pytest.approx(np.mean(np.exp(-d) - 1 + d))
    m = np.log(0.5 * np.exp(t) + 0.5 * np.exp(r))
    js = 0.5 * (np.exp(t - m) - (t - m) - 1) + 0.5 * (np.exp(r - m) - (r - m) - 1)
    assert g["js_divergence_error"][0] == pytest.approx(js.mean())
    assert g["rollout_actor_probs_pearson_corr"][0] == pytest.approx(np.corrcoef(np.exp(t), np.exp(r))[0, 1])


# -- malformed dumps ---------------------------------------------------------------------------------
def good(i=0, step=1, **kw):
    rec = {
        "step": step,
        "request_id": f"r{i}",
        "response_token_ids": [3, 4, 5],
        "rollout_logprobs": [-0.1, -0.2, -0.3],
        "trainer_logprobs": [-0.1, -0.2, -0.3],
    }
    rec.update(kw)
    return rec


BAD_ROWS = [
    ("length", good(9, rollout_logprobs=[-0.1, -0.2]), "length mismatch"),
    ("nan", good(9, trainer_logprobs=[-0.1, float("nan"), -0.3]), "NaN/inf"),
    ("inf", good(9, rollout_logprobs=[-0.1, float("-inf"), -0.3]), "NaN/inf"),
    ("positive", good(9, trainer_logprobs=[-0.1, 2.5, -0.3]), "not a logprob"),
    ("empty", good(9, response_token_ids=[], rollout_logprobs=[], trainer_logprobs=[]), "no scored tokens"),
    ("no-step", {k: v for k, v in good(9).items() if k != "step"}, "step"),
    ("no-id", {k: v for k, v in good(9).items() if k != "request_id"}, "request_id"),
    ("duplicate", good(0), "duplicate request_id"),
    ("ids", good(9, response_token_ids=[3, "x", 5]), "non-negative integers"),
]


@pytest.mark.parametrize("case,rec,reason", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_bad_row_is_listed_or_refused_with_its_row(tmp_path, lpf_cli, case, rec, reason):
    recs = [good(i, step=s) for s in (1, 2) for i in range(3)]
    # JSON has no NaN/inf: json.dumps writes them as NaN/Infinity, which Python reads back; other
    # writers are covered by the Parquet variant below
    p = write_jsonl(tmp_path / "d.jsonl", recs[:2] + [rec] + recs[2:])
    r, f = analyze(lpf_cli, p, tmp_path / "o")
    assert r.code == 0, r.err
    assert f["bad_rows"] == [{"row": 3, "reason": f["bad_rows"][0]["reason"]}] and reason in f["bad_rows"][0]["reason"]
    assert f["n_responses"] == 6
    r = lpf_cli("rl", "analyze", p, "--out", tmp_path / "o2", "--strict")
    assert r.code == 2 and "row 3" in r.err and reason in r.err and "Traceback" not in r.err


def test_bad_rows_in_parquet_and_malformed_json(tmp_path, lpf_cli):
    recs = [good(0), good(1, trainer_logprobs=[-0.1, float("nan"), -0.3]), good(2)]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "d.parquet")
    r, f = analyze(lpf_cli, tmp_path / "d.parquet", tmp_path / "o")
    assert r.code == 0 and f["bad_rows"][0]["row"] == 2 and "NaN" in f["bad_rows"][0]["reason"]
    p = tmp_path / "j.jsonl"
    p.write_text(json.dumps(good(0)) + "\n{not json\n" + json.dumps(good(1)) + "\n[1, 2]\n")
    r, f = analyze(lpf_cli, p, tmp_path / "o2")
    assert [b["row"] for b in f["bad_rows"]] == [2, 4] and "not valid JSON" in f["bad_rows"][0]["reason"]


def test_empty_steps_are_reported(tmp_path, lpf_cli):
    recs = [good(0, step=1), good(0, step=2, rollout_logprobs=[-1.0]), good(0, step=4)]
    r, f = analyze(lpf_cli, write_jsonl(tmp_path / "d.jsonl", recs), tmp_path / "o")
    assert r.code == 0 and f["empty_steps"] == [2, 3] and f["n_steps"] == 2 and len(f["bad_rows"]) == 1


@pytest.mark.parametrize(
    "content,message",
    [
        ([{"step": 1, "request_id": "a", "response_token_ids": [1]}], "missing required column"),
        ([good(0, rollout_logprobs=[-1.0])], "no usable rows"),
        ([], "no rows"),
    ],
    ids=["missing-columns", "all-rows-bad", "empty-file"],
)
def test_unusable_dump_is_one_line_error(tmp_path, lpf_cli, content, message):
    r = lpf_cli("rl", "analyze", write_jsonl(tmp_path / "d.jsonl", content))
    assert r.code == 2 and message in r.err and "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) <= 2  # one message (rich may wrap a long line once)


def test_unreadable_inputs(tmp_path, lpf_cli):
    (tmp_path / "x.parquet").write_bytes(b"PAR1 this is not parquet")
    for args, message in (
        (["rl", "analyze", tmp_path / "nope.jsonl"], "does not exist"),
        (["rl", "analyze", tmp_path / "x.parquet"], "not a readable Parquet"),
        (["rl", "analyze", write_jsonl(tmp_path / "g.jsonl", [good(0)]), "--metric", "kl3"], "unknown metric"),
        (["rl", "simulate", "--rollouts", 0], "--rollouts must be >= 1"),
        (["rl", "simulate", "--inject", "offset-wrapp:20"], "unknown fault"),
    ):
        r = lpf_cli(*args)
        assert r.code == 2 and message in r.err and "Traceback" not in r.err, (args, r.err)


def test_robust_z_floor_ignores_a_few_spikes():
    from lpf.rl.spikes import robust_z

    rng = np.random.default_rng(0)
    y = rng.normal(-4, 0.3, 200)
    z0, f0 = robust_z(y)
    y[::25] = 0.0  # 8 spikes four decades up
    z1, f1 = robust_z(y)
    assert abs(f1["median"] - f0["median"]) < 0.05 and math.isclose(f1["scale"], f0["scale"], rel_tol=0.1)
    assert (z1[::25] > 6).all() and (np.delete(z1, np.s_[::25]) < 6).all()
