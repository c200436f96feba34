"""`lpf diff RUN_A RUN_B`: who is wrong, per request.

The pure rule on hand-made tables (every suspect), then two real pairs: the built-in engine clean (A)
against the same engine with the lost-chunk-state drill (B): B is named; and the built-in engine
against HF generate, both rescored by a reference whose config differs from the engines' in one
field (GraniteMoeHybrid's attention_multiplier): the two engines agree and the reference is named.
"""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pytest

from conftest import write_prompts

MODEL = "zoo:hybrid"


def _side(name, verdicts, tokens, lps, clean=1e-3, worst=None):
    ids = [f"r{i}" for i in range(len(verdicts))]
    summary = pa.table(
        {
            "request_id": ids,
            "seq": list(range(len(ids))),
            "verdict": verdicts,
            "max_abs_logprob_diff": worst or [0.0] * len(ids),
        }
    )
    rows = [(rid, pos, t, lp) for rid, ts, ls in zip(ids, tokens, lps) for pos, (t, lp) in enumerate(zip(ts, ls))]
    tok = pa.table(
        {
            "request_id": [r[0] for r in rows],
            "position": [r[1] for r in rows],
            "token_id": [r[2] for r in rows],
            "engine_logprob": [r[3] for r in rows],
        }
    )
    from lpf.analysis.diff import DiffSide

    return DiffSide(name, summary, tok, clean)


def test_the_rule_names_every_suspect():
    from lpf.analysis.diff import diff_tables

    #          none      A only     B only     both agree   both disagree
    va = ["clean", "divergent", "clean", "divergent", "divergent"]
    vb = ["clean", "clean", "corrupt", "divergent", "divergent"]
    ta = [[1, 2], [1, 2], [1, 2], [5, 6], [5, 6]]
    tb = [[1, 2], [1, 2], [1, 9], [5, 6], [5, 7]]
    la = [[-0.1, -0.2], [-0.9, -0.2], [-0.1, -0.2], [-0.5, -0.5], [-0.5, -0.5]]
    lb = [[-0.1, -0.2], [-0.1, -0.2], [-0.1, -0.2], [-0.5, -0.5], [-0.5, -0.5]]
    a = _side("engine-a", va, ta, la, worst=[0, 1, 0, 2, 2])
    b = _side("engine-b", vb, tb, lb, worst=[0, 0, 3, 2, 2])
    table, doc = diff_tables(a, b, "divergent")
    assert table.column("suspect").to_pylist() == ["none", "A", "B", "reference", "both"]
    assert table.column("same_tokens").to_pylist() == [True, True, False, True, False]
    assert table.column("first_token_difference").to_pylist() == [None, None, 1, None, 1]
    assert doc["counts"] == {"none": 1, "A": 1, "B": 1, "reference": 1, "both": 1}
    # a level above what departed: nobody is a suspect
    _, doc = diff_tables(a, b, "corrupt")
    assert doc["suspect"] == "B" and doc["counts"]["B"] == 1 and doc["counts"]["A"] == 0


def test_a_token_without_a_logprob_is_left_out_and_a_nan_is_not():
    """Both depart and return the same tokens: a position either engine returned without a logprob
    (llama-server's partial UTF-8 tokens) is left out of |A - B|, so they still agree (the reference is
    named); a NaN logprob value is infinitely far (they disagree)."""
    from lpf.analysis.diff import diff_tables

    v = ["divergent", "divergent"]
    t = [[5, 6, 7], [5, 6, 7]]
    a = _side("a", v, t, [[-0.5, None, -0.5], [-0.5, float("nan"), -0.5]], worst=[2, 2])
    b = _side("b", v, t, [[-0.5, -0.3, -0.5], [-0.5, -0.3, -0.5]], worst=[2, 2])
    table, _ = diff_tables(a, b, "divergent")
    assert table.column("suspect").to_pylist() == ["reference", "both"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, prompts_200):
    """A: built-in clean; B: built-in with lost-chunk-state; H: HF generate (same workload, seeds, reference)."""
    from lpf.cli import cli

    root = tmp_path_factory.mktemp("diff")
    lines = prompts_200.read_text().splitlines()[:16]
    wl = write_prompts(root / "p16.jsonl", [json.loads(x) for x in lines])
    common = ["--model", MODEL, "--workload", wl, "--max-tokens", 6, "--prompt-logprobs", "--fail-on", "never"]
    runs = {
        "A": ["--max-num-batched-tokens", 16],
        "B": ["--max-num-batched-tokens", 16, "--inject", "lost-chunk-state"],
        "H": ["--engine", "hf"],
    }
    for name, extra in runs.items():  # in this process: three interpreter starts cost more than the runs
        cli.main(["audit", *map(str, common), *map(str, extra), "--out", str(root / name)], standalone_mode=False)
    return root


@pytest.mark.slow  # the pair of runs takes ~17 s to make
def test_diff_names_the_engine_that_carries_the_drill(lpf_cli, pair):
    r = lpf_cli("diff", pair / "A", pair / "B", "--json")
    assert r.code == 1, r.err  # someone departs at or above --fail-on divergent
    doc = json.loads(r.out)
    assert doc["suspect"] == "B" and doc["counts"]["B"] >= 1 and doc["counts"]["A"] == 0
    assert doc["counts"]["reference"] == 0 and doc["counts"]["both"] == 0
    assert "(B) is the suspect" in doc["sentence"]
    assert all(row["suspect"] == "B" for row in doc["requests"])


@pytest.mark.slow  # the pair of runs takes ~17 s to make
def test_diff_names_a_broken_reference_when_both_engines_agree(lpf_cli, pair, tmp_path):
    from lpf.core.model_specs import resolve_model

    broken = tmp_path / "broken-reference"
    shutil.copytree(resolve_model(MODEL).path, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["attention_multiplier"] = 0.5  # the engines' config says 1/sqrt(32)
    (broken / "config.json").write_text(json.dumps(cfg))
    for name in ("A", "H"):
        shutil.copytree(pair / name, tmp_path / name)
        assert lpf_cli("rescore", tmp_path / name, "--reference", broken, "--redo").code == 0
        assert lpf_cli("analyze", tmp_path / name, "--fail-on", "never").code == 0
    r = lpf_cli("diff", tmp_path / "A", tmp_path / "H", "--json", "--out", tmp_path / "diff.json")
    assert r.code == 1, r.err
    doc = json.loads(r.out)
    assert doc["suspect"] == "reference" and doc["counts"]["reference"] == doc["n_requests"] == 16
    assert doc["n_agree"] == 16 and json.loads((tmp_path / "diff.json").read_text())["suspect"] == "reference"
    # against the true reference the same two engines agree with it: nobody is a suspect
    r = lpf_cli("diff", pair / "A", pair / "H", "--json")
    assert r.code == 0 and json.loads(r.out)["suspect"] == "none"


@pytest.mark.slow  # the pair of runs takes ~17 s to make
def test_diff_refuses_runs_that_do_not_compare(lpf_cli, pair, tmp_path, prompts_200):
    other = write_prompts(
        tmp_path / "other.jsonl", [json.loads(x) for x in prompts_200.read_text().splitlines()[20:24]]
    )
    assert lpf_cli("audit", "--model", MODEL, "--workload", other, "--max-tokens", 4, "--out", tmp_path / "O").code == 0
    r = lpf_cli("diff", pair / "A", tmp_path / "O")
    assert r.code == 2 and "different workloads" in r.err and "Traceback" not in r.err
    r = lpf_cli("diff", pair / "A", tmp_path / "nowhere")
    assert r.code == 2 and "not a run directory" in r.err
    r = lpf_cli("diff", pair / "A", pair / "A")
    assert r.code == 2 and "are the same directory" in r.err and "Traceback" not in r.err
    r = lpf_cli("diff", pair / "A", pair / "B", "--out", tmp_path / "no" / "such" / "diff.json")
    assert r.code == 2 and "is not a directory" in r.err and "Traceback" not in r.err
