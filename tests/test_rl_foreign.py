"""`lpf rl analyze` / `explain` on dumps lpf's engine did not make, in the four frameworks' layouts.

One RL run (tests/rl_hf_dumps.py): transformers samples zoo:hybrid at temperature 1, 12 steps x 16
responses x 16 tokens, the trainer's logprobs a teacher-forced float32 pass; at steps 3, 7, 11 the rollout
reports nucleus-renormalised logprobs (top-p 0.9), at steps 5, 9 its logits carry an error growing with the
position, the other 7 steps are clean. The dumps record no dtype. Written as prime-rl, NeMo-RL, slime and
verl write theirs; each is analysed as a user would: first alone, then after `lpf rl rescore` without the
rollout's top-p (inferred from the evidence) and with it.

Per step: every cause-carrying step goes to its cause with >= 90% of that step's mass, clean steps name
nothing, the spikes `rl analyze` reports are exactly the cause-carrying steps, each spike names the cause
its step carries, and none is floor; the period finder says two shapes, not one rhythm.
"""

from __future__ import annotations

import json
import shutil

import pytest
import rl_hf_dumps as hf
import rl_sim_native as native

from lpf.core.model_specs import resolve_model

LAYOUTS = ("prime-rl", "nemo-rl", "slime", "verl")
CAUSE_STEPS = set(hf.NUCLEUS) | set(hf.GROWTH)
MIN_SHARE = 0.90


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    rows = hf.generate(str(resolve_model("zoo:hybrid").path))
    root = tmp_path_factory.mktemp("foreign")
    out = {}
    for fmt in LAYOUTS:
        where = root / fmt
        out[fmt] = hf.write_verl(rows, where) if fmt == "verl" else native.write(fmt, rows, where, 512)
    return out


def _analyze(lpf_cli, dump, out) -> dict:
    r = lpf_cli("rl", "analyze", dump, "--out", out, "--json")
    assert r.code == 0, r.err
    return json.loads(r.out)


def _check_steps(f: dict, with_reference: bool) -> None:
    block = f["causes"]
    steps = {e["step"]: e for e in block["steps"]}
    assert set(steps) == set(range(1, hf.STEPS + 1))
    for s, e in steps.items():
        cause = hf.truth(s)
        if cause is None:
            assert e["named"] == [], (s, e)
            assert e["shares"].get("dtype_floor", 0) >= MIN_SHARE, (s, e)
        elif cause == "processed_logprobs" and not with_reference:
            # no kept mass to test against: never floor, never another cause; unexplained, with what it needs
            assert e["named"] == ["unexplained"], (s, e)
            assert e["shares"]["unexplained"] >= MIN_SHARE, (s, e)
        else:
            assert e["named"] == [cause], (s, e)
            assert e["shares"][cause] >= MIN_SHARE, (s, e)
    # the spike paragraph and the causes say the same: spikes are the cause-carrying steps, each naming
    # its step's cause, none inside the floor; two causes are two shapes, not one rhythm
    assert set(f["spike_steps"]) == CAUSE_STEPS
    for sp in f["spikes"]:
        assert sp["causes"] == steps[sp["step"]]["named"] and "dtype_floor" not in sp["causes"]
    assert block["verdict"] != "inside-floor"
    assert f["period"]["period"] is None and len(f["period"]["shapes"]) == 2, f["period"]
    assert "not one rhythm" in f["summary"]
    floor = next(c for c in block["causes"] if c["cause"] == "dtype_floor")
    assert "estimated from the dump's 7 quiet steps" in floor["evidence"]


@pytest.mark.parametrize(
    "fmt", [LAYOUTS[0], *(pytest.param(f, marks=pytest.mark.slow) for f in LAYOUTS[1:])]
)  # one layout in the fast suite; the other three read the same run through their own readers
def test_mixed_causes_are_found_at_their_steps(dumps, lpf_cli, tmp_path, fmt):
    out = tmp_path / "rl"
    f = _analyze(lpf_cli, dumps[fmt], out)
    _check_steps(f, with_reference=False)
    hints = " ".join(f["causes"]["hints"])
    assert f"at steps {', '.join(map(str, hf.NUCLEUS))} the rollout's logprobs sit above" in hints
    assert "lpf rl rescore" in hints

    r = lpf_cli("rl", "rescore", dumps[fmt], "--out", out, "--reference", "zoo:hybrid")
    assert r.code == 0, r.err
    f = _analyze(lpf_cli, dumps[fmt], out)
    _check_steps(f, with_reference=True)
    pl = next(c for c in f["causes"]["causes"] if c["cause"] == "processed_logprobs")
    assert pl["test"]["inferred"]["setting"] == "top_p" and pl["test"]["inferred"]["top_p"] == hf.TOP_P
    assert sorted(pl["test"]["steps"]) == sorted(hf.NUCLEUS)
    assert f["reference"]["spikes"]["rollout"] == len(CAUSE_STEPS)

    shutil.rmtree(out)
    r = lpf_cli("rl", "rescore", dumps[fmt], "--out", out, "--reference", "zoo:hybrid", "--top-p", str(hf.TOP_P))
    assert r.code == 0, r.err
    f = _analyze(lpf_cli, dumps[fmt], out)
    _check_steps(f, with_reference=True)
    pl = next(c for c in f["causes"]["causes"] if c["cause"] == "processed_logprobs")
    assert pl["test"]["inferred"] is None and sorted(pl["test"]["steps"]) == sorted(hf.NUCLEUS)
