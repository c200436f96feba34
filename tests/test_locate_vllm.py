"""`lpf locate` on real vLLM (the CPU build in .venv-vllm, lpf-vllm-trace capturing inside its worker),
through `lpf conformance`: every cell that does not conform gets a locate line, and the two bugs
docs/conformance.md found by hand are found by the command line alone:

- Lfm2 / Lfm2Moe: the attention's q and k after the rotary depart at the attention layer (vLLM's
  CPU rotary kernel on 3-D q/k), while its input norm and v agree;
- Zamba2: the first departure is the mixer's dt (vLLM never clamps it, transformers' prefill clamps
  at time_step_min), and the reference is on trial: its own decode path departs from its
  teacher-forced pass at dt too, and there the engine agrees with the decode path.
One matrix: these three architectures x the `fp32` cell, 4 prompts, 8 greedy tokens, float32.
"""

from __future__ import annotations

import json

import pytest

from test_report import browser  # noqa: F401 - the real headless Chromium fixture
from test_vllm import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    from conftest import lpf_main

    out = tmp_path_factory.mktemp("locate-conf") / "conf"
    proc = lpf_main(
        "conformance",
        "--engine",
        "vllm",
        "--arch",
        "Lfm2,Lfm2Moe,Zamba2",
        "--cell",
        "fp32",
        "--prompts",
        4,
        "--max-tokens",
        8,
        "--out",
        out,
        "--json",
        "--fail-on",
        "never",
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    return out, {c["architecture"]: c for c in doc["cells"]}, proc.stderr


def located(out, cell) -> dict:
    lc = cell["locate"]
    assert lc.get("sentence") and not lc.get("error"), lc
    assert (out / lc["link"]).is_file()
    return json.loads((out / lc["dir"] / "locate.json").read_text())


def test_every_cell_that_does_not_conform_has_a_locate_line(matrix):
    out, cells, stderr = matrix
    assert set(cells) == {"Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Zamba2ForCausalLM"}
    printed = " ".join(stderr.split())
    for cell in cells.values():
        assert cell["status"] == "ok" and cell["conformance"] != "clean", cell
        assert "locate: " + " ".join(cell["locate"]["sentence"].split()) in printed  # the terminal's locate line
        assert cell["locate"]["suspect"] in ("engine", "both")


@pytest.mark.parametrize("arch", ["Lfm2ForCausalLM", "Lfm2MoeForCausalLM"])
def test_the_lfm2_rotary_bug_is_located_to_q_and_k_after_the_rotary(matrix, arch):
    out, cells, _ = matrix
    doc = located(out, cells[arch])
    loc = doc["located"]
    attn_layer = 1  # the tiny recipe's layer_types: conv, full_attention, conv, conv
    assert loc["layer"] == attn_layer and loc["name"] in ("q", "k"), doc["sentence"]
    assert loc["also"] == [f"L{attn_layer}.{'k' if loc['name'] == 'q' else 'q'}"]  # both after the rotary
    assert doc["input"]["op"] == f"L{attn_layer}.norm" and doc["input"]["agreed"]
    v = next(m for m in doc["modules"] if m["op"] == f"L{attn_layer}.v")
    assert v["first_departure"] is None  # v never goes through the rotary: it agrees
    assert doc["verdict"]["suspect"] == "engine" and doc["trials"]["decode_path"]["first_departure"] is None
    assert doc["replay"]["check"]["first_other_token"] is None  # the replay sampled the run's own tokens


def test_zamba2_s_dt_clamp_is_located_to_the_mixer_s_dt_and_the_reference_disagrees_with_itself(matrix):
    out, cells, _ = matrix
    doc = located(out, cells["Zamba2ForCausalLM"])
    assert doc["located"]["name"] == "dt", doc["sentence"]
    assert doc["input"]["agreed"]  # what feeds the mixer's dt agrees; the dt does not
    dp = doc["trials"]["decode_path"]
    assert dp["first_departure"]["name"] == "dt" and dp["first_departure"]["position"] >= doc["target"]["prompt_len"]
    assert dp["engine_there"]["agrees"], dp  # vLLM computes what transformers' own decode step computes
    assert doc["verdict"]["suspect"] == "both"


def test_the_conformance_report_links_each_locate_line_to_its_page(matrix, browser):
    from selenium.webdriver.common.by import By

    from test_report import open_page, severe

    out, cells, _ = matrix
    log = open_page(browser, out / "report.html")
    assert severe(log) == [], log
    findings = browser.find_element(By.ID, "findings")
    assert findings.text.count("locate:") == len(cells)
    links = {a.get_attribute("href").split("/conf/")[-1] for a in findings.find_elements(By.CSS_SELECTOR, ".note a")}
    assert links == {c["locate"]["link"] for c in cells.values()}
