"""The cause decomposition's parts on data whose answer is known by construction (fast, no engine):
the statistics of `lpf.rl.cause_tests`, `lpf.rl.causes.explain` on synthetic dumps, the kept mass of
`lpf.rl.row_stats` against the built-in sampler, the drills' parsing, the fix table, and the
command line's refusals."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lpf.rl import cause_tests as ct
from lpf.rl.cause_inputs import ExplainInputs
from lpf.rl.causes import CAUSES, explain

FLOOR = {"token": {"median": 1e-6, "q99": 1e-5}, "settled": {"q99": 0.0}, "pair": "float32/float32"}


def test_exact_fit_finds_slope_one_and_rejects_an_unrelated_component():
    rng = np.random.default_rng(0)
    c = -rng.uniform(0, 0.2, 5000)
    d = c + rng.normal(0, 0.01, c.size)
    fit = ct.exact_fit(d, {"a": c, "b": rng.normal(0, 0.1, c.size)})
    assert abs(fit["a"]["beta"] - 1) < 0.02 and ct.exact_passes(fit["a"])
    assert abs(fit["b"]["beta"]) < 0.05 and not ct.exact_passes(fit["b"])
    # raw logprobs at top-p 0.9: the offset exists in the reference but not in d
    assert not ct.exact_passes(ct.exact_fit(rng.normal(0, 0.01, c.size), {"a": c})["a"])


def test_variance_fit_recovers_an_additive_model():
    phi, beta, pi = 0.5, np.array([0.0, 2.0, 5.0]), np.array([0.0, 1.0, 3.0, 8.0])
    v = phi + beta[:, None] + pi[None, :]
    fit = ct.fit_variance(v, np.full(v.shape, 50), use_groups=True, use_positions=True)
    assert fit["phi"] == pytest.approx(phi, abs=1e-6)
    np.testing.assert_allclose(fit["beta"], beta, atol=1e-6)
    np.testing.assert_allclose(fit["pi"], pi, atol=1e-6)
    # a factor left out goes back into the level
    assert ct.fit_variance(v, np.full(v.shape, 50), use_groups=False, use_positions=True)["phi"] > phi


def test_shuffles_stay_inside_their_blocks_and_ranks_separate_groups():
    rng = np.random.default_rng(1)
    labels, blocks = np.arange(40) % 4, np.repeat(np.arange(5), 8)
    out = ct.shuffle_within(labels, blocks, rng)
    for b in range(5):
        assert sorted(out[blocks == b]) == sorted(labels[blocks == b])
    assert not np.array_equal(out, labels)
    levels = np.r_[np.zeros(5), rng.uniform(1, 2, 35)]
    groups = np.r_[np.zeros(5, dtype=int), np.ones(35, dtype=int)]
    obs = ct.kruskal(levels, groups)
    p = ct.permutation_p(obs, [ct.kruskal(levels, rng.permutation(groups)) for _ in range(199)])
    assert p <= 0.01 and ct.kruskal(levels, rng.permutation(groups)) < obs
    assert list(ct.position_bucket(np.array([0, 1, 2, 3, 4, 7, 8, 31, 32]))) == [0, 1, 2, 2, 3, 3, 4, 5, 6]


def _inputs(d_parts: dict, pos, resp, steps, **kw) -> ExplainInputs:
    """A synthetic dump: t = r + the sum of `d_parts`."""
    n = pos.size
    r = -np.full(n, 1.0)
    t = r + sum(d_parts.values())
    base = dict(
        fmt="lpf",
        steps=steps,
        request_ids=[f"q{i}" for i in range(steps.size)],
        tok_resp=resp,
        tok_pos=pos,
        r=r,
        t=t,
        resp_unit=np.arange(steps.size),
        sensitivity=np.full(n, 0.5),
        sensitivity_source="reference",
        floors={"rollout and trainer": FLOOR},
    )
    base.update(kw)
    return ExplainInputs(**base)


def _layout(n_resp=60, length=32, steps=6):
    resp = np.repeat(np.arange(n_resp), length)
    return np.tile(np.arange(length), n_resp), resp, np.repeat(np.arange(steps), n_resp // steps)


def _shares(inp):
    ex = explain(inp)
    a = np.abs(inp.t - inp.r)
    return ex, dict(zip(CAUSES, (ex.shares * a[:, None]).sum(0) / a.sum()))


def test_synthetic_causes_land_where_they_were_put():
    rng = np.random.default_rng(2)
    pos, resp, steps = _layout()
    floor = rng.normal(0, 1e-7, pos.size)
    # an offset the reference predicts exactly
    lk = -rng.uniform(0.01, 0.1, pos.size)
    ex, s = _shares(_inputs({"p": lk, "f": floor}, pos, resp, steps, log_kept=lk))
    assert s["processed_logprobs"] > 0.99 and ex.tests["processed_logprobs"]["status"] == "passed"
    # noise that grows along the response
    grow = rng.normal(0, 1, pos.size) * 1e-3 * pos  # nothing at position 0 (the prefill), then more and more
    ex, s = _shares(_inputs({"g": grow, "f": floor}, pos, resp, steps))
    assert s["position_growth"] > 0.95 and ex.tests["position_growth"]["status"] == "passed"
    # noise on responses of micro-batches larger than one, none on the singles
    mbs = np.tile([1, 2, 2, 4, 4, 4, 4, 2, 2, 1], 6).astype(float)
    batch = rng.normal(0, 0.01, pos.size) * (mbs[resp] > 1)
    ex, s = _shares(_inputs({"b": batch, "f": floor}, pos, resp, steps, batch={"micro_batch_size": mbs}))
    assert s["batch_shape"] > 0.95 and ex.tests["batch_shape"]["status"] == "passed"
    # rounding alone: all floor, nothing found
    ex, s = _shares(_inputs({"f": rng.normal(0, 1e-6, pos.size)}, pos, resp, steps, batch={"micro_batch_size": mbs}))
    assert s["dtype_floor"] > 0.99 and ex.tests["dtype_floor"]["status"] == "inside"
    assert {ex.tests[c]["status"] for c in ("position_growth", "batch_shape")} == {"failed"}


def test_an_unknown_error_stays_unexplained():
    rng = np.random.default_rng(3)
    pos, resp, steps = _layout()
    # a few responses lie wildly (a corrupted state): never forced into position growth or the floor
    lie = np.where(np.isin(resp, [5, 17, 40]) & (pos >= 1), rng.normal(0, 2.0, pos.size), 0.0)
    ex, s = _shares(_inputs({"x": lie, "f": rng.normal(0, 1e-6, pos.size)}, pos, resp, steps))
    assert s["unexplained"] > 0.9, s
    assert set(ex.tests["unexplained"]["outlier_responses"]) == {"q5", "q17", "q40"}
    # a systematic error everywhere, well above the floor
    ex, s = _shares(_inputs({"x": rng.normal(0, 0.01, pos.size)}, pos, resp, steps))
    assert s["unexplained"] > 0.95 and ex.tests["dtype_floor"]["status"] == "exceeded"


def test_log_kept_mass_is_what_the_builtin_sampler_renormalises_by():
    import torch

    from lpf.builtin.sampler import processed_logits
    from lpf.rl.row_stats import log_kept_mass

    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 300, generator=g) * 3
    for top_k, top_p, t in ((0, 0.9, 1.0), (20, 1.0, 1.0), (40, 0.7, 0.8), (0, 1.0, 1.0)):
        lk = log_kept_mass(z, t, top_k, top_p)
        for i in range(z.shape[0]):
            pz = processed_logits(z[i], t, top_k, top_p)
            kept = torch.isfinite(pz)
            # processed logprob = tempered logprob - log kept mass, on every kept token
            diff = (torch.log_softmax(z[i] / t, -1) - torch.log_softmax(pz, -1))[kept]
            assert torch.allclose(diff, torch.full_like(diff, float(lk[i])), atol=1e-5), (top_k, top_p, i)


def test_drills_and_fixes_are_named_as_documented():
    from lpf.core.errors import LpfError
    from lpf.rl import fixes
    from lpf.rl.drills import RLDrills

    d = RLDrills.parse("processed-logprobs:0.8,micro-batch,state-dtype,stale-policy:2")
    assert d.names() == ["processed-logprobs:0.8", "micro-batch", "state-dtype:bfloat16", "stale-policy:2"]
    assert d.causes() == ["processed_logprobs", "batch_shape", "position_growth", "stale_weights"]
    for bad, why in (("stale", "did you mean"), ("processed-logprobs:2", "0.01..0.999"), ("state-dtype:int8", "DTYPE")):
        with pytest.raises(LpfError, match=why):
            RLDrills.parse(bad)
    for cause in CAUSES:
        for fw in fixes.FRAMEWORKS:
            f = fixes.fixes(cause, fw)
            assert f["why"] and (cause == "unexplained" or f["fix"]), (cause, fw)
    assert "mamba_ssm_cache_dtype" in " ".join(fixes.fixes("position_growth", "nemo-rl")["fix"])
    assert "rollout_is" in " ".join(fixes.fixes("stale_weights", "verl")["correction"])
    assert fixes.fixes("processed_logprobs", "slime")["fix"][0].startswith("--rollout-top-p 1.0")


def _dump(tmp_path, rows):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p)
    return p


def test_explain_without_a_reference_says_what_each_test_needs(tmp_path, lpf_cli):
    rng = np.random.default_rng(4)
    rows = []
    for step in range(1, 5):
        for i in range(8):
            r = -rng.uniform(0.1, 2.0, 24)
            rows.append(
                {
                    "step": step,
                    "request_id": f"s{step}-{i}",
                    "response_token_ids": list(range(3, 27)),
                    "rollout_logprobs": r.tolist(),
                    "trainer_logprobs": (r - 0.05).tolist(),
                }
            )
    p = _dump(tmp_path, rows)
    r = lpf_cli("rl", "explain", p, "--json", "--rollout-dtype", "float32", "--fail-on-cause")
    assert r.code == 1, r.err  # a systematic offset well above a float32 floor: unexplained
    b = json.loads(r.out)
    by = {c["cause"]: c for c in b["causes"]}
    assert by["processed_logprobs"]["status"] == by["stale_weights"]["status"] == "untested"
    assert "rescore" in by["processed_logprobs"]["missing"] and "--lags" in by["stale_weights"]["missing"]
    assert b["verdict"] == "unexplained" and b["shares"]["unexplained"] > 0.9
    assert any("signature of processed logprobs" in h for h in b["hints"])  # the rollout sits above everywhere
    assert (tmp_path / "d.rl" / "rl_causes.json").is_file() and (tmp_path / "d.rl" / "rl_causes.parquet").is_file()
    assert "untested" in r.err and "hint:" in r.err


@pytest.mark.parametrize(
    "args,message",
    [
        (["rl", "simulate", "--drill", "stale"], "unknown RL drill"),
        (["rl", "simulate", "--drill", "processed-logprobs", "--top-p", "0.8"], "give one"),
        (["rl", "simulate", "--policy-drift", "0.5"], "--policy-drift"),
        (["rl", "simulate", "--micro-batch-tokens", "0"], "--micro-batch-tokens"),
    ],
    ids=["unknown-drill", "two-top-p", "drift", "micro-batch-tokens"],
)
def test_simulate_refuses_bad_drills_in_one_line(lpf_cli, args, message):
    r = lpf_cli(*args)
    assert r.code == 2 and message in r.err and "Traceback" not in r.err, r.err


def test_rescore_refuses_lags_without_checkpoints(tmp_path, lpf_cli):
    rows = [
        {
            "step": 1,
            "request_id": "a",
            "prompt_token_ids": [3, 4],
            "response_token_ids": [5, 6],
            "rollout_logprobs": [-0.1, -0.2],
            "trainer_logprobs": [-0.1, -0.2],
        }
    ]
    p = _dump(tmp_path, rows)
    for args, message in (
        (["--lags", "0,1"], "holding {step}"),
        (["--lags", "x"], "--lags expects integers"),
        (["--lags", "1"], "must include 0"),
        (["--top-p", "1.5"], "--top-p in (0, 1]"),
    ):
        r = lpf_cli("rl", "rescore", p, "--reference", "zoo:hybrid", *args)
        assert r.code == 2 and message in r.err and "Traceback" not in r.err, (args, r.err)


@pytest.mark.slow
def test_log_kept_mass_is_vllms_processed_logprob_offset(tmp_path):
    """vLLM's own sampler code (the CPU build in .venv-vllm: vllm/v1/sample/ops/topk_topp_sampler.py
    apply_top_k_top_p, then log_softmax as forward_native/forward_cpu do under processed_logprobs) on
    the same logits: its processed logprob is the tempered logprob minus `log_kept_mass`, token by token."""
    import subprocess

    import torch

    from lpf.rl.row_stats import log_kept_mass
    from test_vllm import _vllm_python

    python = _vllm_python()
    if python is None:
        pytest.skip("no vLLM venv: run `make vllm` (make test does)")
    g = torch.Generator().manual_seed(1)
    z = torch.randn(48, 200, generator=g) * 3
    cases = [(1.0, 0, 0.9), (1.0, 20, 1.0), (0.7, 50, 0.8), (1.3, 0, 0.5)]
    np.save(tmp_path / "z.npy", z.numpy())
    probe = (
        "import json, sys, numpy as np, torch\n"
        "from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p\n"
        "z = torch.from_numpy(np.load(sys.argv[1])); out = {}\n"
        f"for i, (t, k, p) in enumerate({cases!r}):\n"
        "    n, v = z.shape\n"
        "    kk = torch.full((n,), k if k else v, dtype=torch.long)\n"  # vLLM passes the vocabulary size for 'off'
        "    lp = apply_top_k_top_p((z / t).clone(), kk, torch.full((n,), float(p))).log_softmax(-1, dtype=torch.float32)\n"
        "    np.save(sys.argv[1] + f'.{i}.npy', lp.numpy())\n"
    )
    r = subprocess.run([str(python), "-c", probe, str(tmp_path / "z.npy")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for i, (t, k, p) in enumerate(cases):
        processed = torch.from_numpy(np.load(tmp_path / f"z.npy.{i}.npy"))
        kept = torch.isfinite(processed)
        offset = (torch.log_softmax(z / t, -1) - processed)[kept]
        want = log_kept_mass(z, t, k, p)[:, None].expand_as(processed)[kept]
        assert torch.allclose(offset, want, atol=2e-5), (t, k, p, float((offset - want).abs().max()))


def test_mamba_ssm_cache_dtype_rounds_the_ssm_state_and_sizes_the_cache():
    import torch

    from lpf.builtin.config import EngineConfig
    from lpf.builtin.llm_engine import cache_sizes, state_buffer_dtype
    from lpf.builtin.models import model_shape
    from lpf.builtin.state_cache import StateCache
    from lpf.core.model_specs import resolve_model

    sc = StateCache(
        [[("conv", (4, 3)), ("ssm", (2, 8))]],
        2,
        torch.float32,
        part_dtypes={"conv": torch.float32, "ssm": torch.bfloat16},
    )
    x = torch.randn(1, 2, 8) * 1.000123
    sc.write(0, "ssm", [1], x, "decode")
    sc.write(0, "conv", [1], torch.full((1, 4, 3), 1.000123), "decode")
    assert torch.equal(sc.read(0, "ssm", [1], "decode"), x.to(torch.bfloat16).float())  # stored as bf16 would be
    assert torch.equal(sc.read(0, "conv", [1], "decode"), torch.full((1, 4, 3), 1.000123))
    shape = model_shape(resolve_model("zoo:hybrid").path)
    bf16 = EngineConfig(dtype="bfloat16", cache_mb=8)
    wide = EngineConfig(dtype="bfloat16", cache_mb=8, mamba_ssm_cache_dtype="float32")
    assert state_buffer_dtype(wide) == "float32" and state_buffer_dtype(bf16) == "bfloat16"
    assert cache_sizes(shape, wide)[0] < cache_sizes(shape, bf16)[0]  # a wider state buys fewer slots
