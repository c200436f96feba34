"""`lpf locate` on the built-in engine, end to end: real drill runs (`lpf audit`), located through the
real command line, judged against what the drill does (and the run's trace), never against a
stored answer.

- stale-state (tiny:jamba-longmem, 240 requests, the imposter budget of test_engine_drills): the
  first Mamba layer's input state at the imposter's first token differs from the reference's zero
  state, read from a slot the trace shows an earlier request used;
- offset-wrap:18 (same): the input state of the first decode differs, its prefill having written its
  final state at the wrapped offset (slot * stride mod 2^18);
- lost-chunk-state (zoo:hybrid, 16-token budget, prompt logprobs): the input state at a chunk
  boundary (an extend step that read no state);
- quantize-weights (zoo:hybrid): the first linear (layer 0's input projection) from an agreeing norm;
- a clean run: nothing departs, the replay reproduces the run's logprobs exactly;
- the float64 gold agrees with the float32 reference within float32 rounding on every zoo model;
- the report page renders in real headless Chromium with its charts drawn.
"""

from __future__ import annotations

import json

import pytest

from conftest import lpf_main, write_prompts
from lpf.views.query import run_query
from test_report import browser  # noqa: F401 - the real headless Chromium fixture

pytestmark = pytest.mark.slow

JAMBA = [
    "--model",
    "tiny:jamba-longmem",
    "--n",
    4,
    "--max-tokens",
    16,
    "--cache-mb",
    3,
    "--max-num-seqs",
    16,
    "--max-num-batched-tokens",
    32,
]


@pytest.fixture(scope="module")
def oracle60(tmp_path_factory):
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=0, n=60)
    return write_prompts(
        tmp_path_factory.mktemp("w") / "oracle60.jsonl", [{"id": i["id"], "prompt": i["prompt"]} for i in items]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, oracle60):
    base = tmp_path_factory.mktemp("locate")
    configs = {
        "stale": [*JAMBA, "--inject", "stale-state"],
        "wrap": [*JAMBA, "--inject", "offset-wrap:18"],
        "lost": [
            "--model",
            "zoo:hybrid",
            "--max-tokens",
            8,
            "--prompt-logprobs",
            "--max-num-batched-tokens",
            16,
            "--inject",
            "lost-chunk-state",
        ],
        "quant": ["--model", "zoo:hybrid", "--max-tokens", 8, "--inject", "quantize-weights"],
        "clean": ["--model", "zoo:hybrid", "--max-tokens", 8, "--max-num-batched-tokens", 24, "--cache-mb", 1],
    }
    for name, args in configs.items():
        proc = lpf_main(
            "audit", "--engine", "builtin", "--workload", oracle60, *args, "--out", base / name, "--fail-on", "never"
        )
        assert proc.returncode == 0, proc.stderr
    return base


def locate(lpf_cli, run, *args):
    r = lpf_cli("locate", run, *args, "--json")
    assert r.code == 0, r.err
    return json.loads(r.out)


def q(run, sql):
    return run_query(run, sql)[1]


def _shared(doc, exact: bool = True):
    """What every located drill shows: the engine departs, the reference agrees with itself, and
    the replay reproduced the run's logprobs (to the bit on a dense model; with MoE layers a pruned
    step's other requests route their tokens differently, so an expert's matmul may round differently)."""
    assert doc["verdict"]["suspect"] == "engine", doc["sentence"]
    worst = doc["replay"]["check"]["max_abs_logprob_diff"]
    assert doc["replay"]["reproduces"] is True and (worst == 0.0 if exact else worst <= 1e-5), worst
    assert doc["trials"]["gold"]["agrees"] is True
    assert doc["trials"]["decode_path"]["first_departure"] is None
    assert doc["sentence"].count(". ") == 0 and doc["sentence"].endswith("suspect: engine.")


def test_stale_state_is_located_to_the_first_mamba_layer_s_input_state(lpf_cli, runs):
    run = runs / "stale"
    doc = locate(lpf_cli, run)
    _shared(doc, exact=False)  # tiny:jamba-longmem has MoE layers
    loc, mamba = doc["located"], doc["mamba"]
    assert loc["layer"] == 0 and loc["name"] in ("state_in", "conv_state_in") and loc["position"] == 0
    assert (
        mamba["input_state"] == "differed" and mamba["reference_state_norm"] == 0.0 and mamba["engine_state_norm"] > 1
    )
    step = mamba["step"]
    assert step["phase"] == "decode" and step["first_position"] == 0  # the imposter's first step
    writers = [w for w in step["state_last_written_by"] if w]
    assert writers and writers[0]["request_id"] != doc["request_id"]
    # the trace agrees: that request ran on the same slot, earlier
    rows = q(
        run,
        f"SELECT count(*) FROM trace WHERE request_id = '{writers[0]['request_id']}' "
        f"AND state_slot = {step['state_slot']} AND step < {step['step']}",
    )
    assert rows[0][0] > 0
    assert doc["replay"]["steps_replayed"] < doc["replay"]["steps_scheduled"]  # only what the request depends on


def test_offset_wrap_is_located_to_the_state_its_prefill_wrote_elsewhere(lpf_cli, runs):
    run = runs / "wrap"
    doc = locate(lpf_cli, run)
    _shared(doc, exact=False)
    loc, mamba = doc["located"], doc["mamba"]
    stride = json.loads((run / "manifest.json").read_text())["engine"]["cache"]["state_slot_stride"]
    assert loc["layer"] == 0 and loc["name"] in ("state_in", "conv_state_in")
    assert mamba["input_state"] == "differed" and mamba["step"]["phase"] == "decode"
    prompt_len = doc["target"]["prompt_len"]
    assert loc["position"] >= prompt_len - 1  # a decode after the prompt
    slot, prev = mamba["step"]["state_slot"], mamba["previous_step"]
    assert slot * stride >= 2**18 and mamba["step"]["state_read_offset"] == slot * stride
    assert prev["state_write_offset"] == (slot * stride) % 2**18  # the wrapped slot
    assert "instead" in doc["sentence"]


def test_lost_chunk_state_is_located_to_the_chunk_boundary(lpf_cli, runs):
    run = runs / "lost"
    doc = locate(lpf_cli, run)
    _shared(doc)
    loc, mamba = doc["located"], doc["mamba"]
    assert loc["layer"] == 0 and loc["name"] in ("state_in", "conv_state_in")
    step = mamba["step"]
    assert (
        step["phase"] == "extend"
        and step["state_read_offset"] is None
        and step["first_position"] == loc["position"] > 0
    )
    bounds = {
        r[0]
        for r in q(
            run, f"SELECT num_computed_tokens FROM trace WHERE request_id = '{doc['request_id']}' AND phase = 'extend'"
        )
    }
    assert loc["position"] in bounds and mamba["reference_state_norm"] > 0 and mamba["engine_state_norm"] == 0.0


def test_quantize_weights_is_located_to_the_first_linear(lpf_cli, runs):
    doc = locate(lpf_cli, runs / "quant")
    _shared(doc)
    assert doc["located"]["op"] == "L0.in_proj" and doc["located"]["position"] == 0
    assert doc["input"]["op"] == "L0.norm" and doc["input"]["agreed"]
    assert "linear op computes another function" in doc["sentence"]


def test_a_clean_request_departs_nowhere_and_its_replay_is_exact(lpf_cli, runs):
    run = runs / "clean"
    rid = q(run, "SELECT request_id FROM requests ORDER BY len(prompt_token_ids) DESC LIMIT 1")[0][0]
    doc = locate(lpf_cli, run, "--request", rid)
    assert doc["verdict"]["suspect"] == "nobody" and doc["located"] is None
    assert doc["replay"]["check"]["max_abs_logprob_diff"] == 0.0
    assert max(m["ratio"] for m in doc["modules"] if m["ratio"] is not None) < 0.5  # honest: far inside each floor


@pytest.mark.parametrize("spec", ["zoo:hybrid", "zoo:jamba", "zoo:llama"])
def test_the_float64_gold_agrees_with_the_float32_reference_on_every_zoo_model(spec):
    from lpf.locate import align
    from lpf.locate.finding import _gold_trial
    from lpf.locate.reference_side import reference_side
    from lpf.core.model_specs import resolve_model

    ids = [1] + list(range(30, 90))
    side = reference_side(resolve_model(spec).path, ids, 40, [19, 39], trials=False)
    errs, _ = align.rel_errors(side.tf, side.gold)
    gold = _gold_trial(errs)
    assert gold["agrees"] and gold["compared_ops"] >= 20, gold
    assert gold["worst_epsilons"] <= align.GOLD_TOLERANCE


def test_the_locate_report_renders_in_chromium(lpf_cli, runs, browser):
    from selenium.webdriver.common.by import By

    from test_report import open_page, severe

    out = runs / "stale-located"
    doc = locate(lpf_cli, runs / "stale", "--out", out)
    assert (out / "locate.json").is_file() and (out / "report.html").is_file()
    log = open_page(browser, out / "report.html")
    assert severe(log) == [], log
    drawn = browser.execute_script(  # the line chart's traces, the heat map's image layer
        "return [...document.querySelectorAll('.plot')].map(d => !!d.querySelector('svg.main-svg g.trace, "
        "svg.main-svg g.hm image'));"
    )
    assert drawn == [True, True]
    assert doc["request_id"] in browser.find_element(By.TAG_NAME, "header").text
    assert "input state at prompt token 0 already differed" in browser.find_element(By.ID, "finding").text
    assert "decode path" in browser.find_element(By.ID, "trials").text
