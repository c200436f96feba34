"""report.html in a real headless Chromium: a real audit's report renders (every chart drawn as SVG),
the console stays free of errors, a `<script>` inside model output shows as text and never runs,
and sweep and RL directories render too.

The run is real: `lpf run` on the built-in engine with the swap-outputs drill, then one request's
output is replaced by the tokens of `<script>window.__pwned=1</script>` in its requests and tokens
parts (as an engine that emitted that text would have written them), then the real `lpf rescore`
and `lpf analyze`, which writes the report. The sweep and RL directories are synthetic but follow
the shared contracts (their writers are built alongside). Chromium comes from `make test`
(Debian's chromium + chromium-driver).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import lpf_main, write_prompts
from lpf.report.html import script_json
from lpf.run import schema

XSS = "<script>window.__pwned=1</script>"
XSS_ID = "xss-r0"


# -- the browser ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.fail("headless Chromium is missing: `make test` installs it (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="lpf-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def open_page(driver, path):
    """Load a report, wait until its script has drawn every section, return the console entries."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(path.resolve().as_uri())
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.ready"))
    log = driver.get_log("browser")
    assert driver.execute_script("return document.body.dataset.ready") == "1", log  # every chart drawn
    return log


def severe(log):
    return [e for e in log if e.get("level") == "SEVERE"]


def plots_drawn(driver) -> tuple[int, int]:
    return tuple(
        driver.execute_script(
            "const p = [...document.querySelectorAll('.plot')];"
            "return [p.length, p.filter(d => d.querySelector('svg.main-svg g.trace')).length];"
        )
    )


# -- a real run with a <script> in its output ----------------------------------------------------
def _replace_output(run, request_id: str, text: str) -> list[int]:
    """Rewrite one request's output as the tokens of `text`, in its requests part and its tokens
    part (written as a pair, same part name), the way an engine that produced it would have."""
    from lpf.core.model_specs import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("zoo:hybrid"))
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    for part in sorted((run / "requests").glob("part-*.parquet")):
        rows = pq.read_table(part).to_pylist()
        if not any(r["request_id"] == request_id for r in rows):
            continue
        for r in rows:
            if r["request_id"] == request_id:
                r.update(output_token_ids=ids, output_text=text, finish_reason="stop")
        toks = [t for t in pq.read_table(run / "tokens" / part.name).to_pylist() if t["request_id"] != request_id]
        toks += [
            {
                "request_id": request_id,
                "position": i,
                "token_id": t,
                "engine_logprob": -0.01,
                "engine_topk_ids": [t],
                "engine_topk_logprobs": [-0.01],
            }
            for i, t in enumerate(ids)
        ]
        pq.write_table(pa.Table.from_pylist(toks, schema=schema.TOKENS), run / "tokens" / part.name)
        pq.write_table(pa.Table.from_pylist(rows, schema=schema.REQUESTS), part)
        return ids
    raise AssertionError(f"{request_id} is in no requests part")


@pytest.fixture(scope="module")
def xss_run(tmp_path_factory):
    from lpf.zoo import registry

    base = tmp_path_factory.mktemp("report")
    items = [{"id": i["id"], "prompt": i["prompt"]} for i in registry.workload_items("oracle", seed=11, n=160)]
    items.insert(40, {"id": "xss", "prompt": XSS})
    workload = write_prompts(base / "w.jsonl", items)
    run = base / "run"
    proc = lpf_main(
        "run",
        "--engine",
        "builtin",
        "--model",
        "zoo:hybrid",
        "--workload",
        workload,
        "--max-tokens",
        8,
        "--inject",
        "swap-outputs:3",
        "--out",
        run,
    )
    assert proc.returncode == 0, proc.stderr
    _replace_output(run, XSS_ID, XSS)
    proc = lpf_main("rescore", run)
    assert proc.returncode == 0, proc.stderr
    proc = lpf_main("analyze", run, "--fail-on", "never", "--json")
    assert proc.returncode == 0, proc.stderr
    return run, json.loads(proc.stdout), proc.stderr


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_analyze_writes_a_self_contained_report(xss_run):
    run, findings, stderr = xss_run
    assert f"report: {run / 'report.html'}" in stderr.replace("\n", "")
    page = (run / "report.html").read_text()
    assert len(page) < 8_000_000
    # offline: no external script, stylesheet or frame; plotly.js is inline
    assert not re.search(r"<(script|link|iframe|img)[^>]+(src|href)=", page, re.I)
    assert "plotly.js v" in page
    # the model text only ever appears escaped inside the data block
    assert page.count(XSS) == 0 and "\\u003cscript\\u003ewindow.__pwned=1\\u003c/script\\u003e" in page
    assert findings["counts"]["divergent"] + findings["counts"]["corrupt"] > 0
    assert XSS_ID in {f["request_id"] for f in findings["flagged"]}


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_run_report_renders_and_model_script_stays_text(xss_run, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    run, findings, _ = xss_run
    log = open_page(browser, run / "report.html")
    assert severe(log) == [], log
    n, drawn = plots_drawn(browser)
    # the run-level test's floor chart, histogram, per-request scatter, first-divergence, engine steps
    assert n == 5 and drawn == n
    assert "run test" in browser.find_element(By.ID, "run-test").text.lower()
    assert findings["run_test"]["sentence"] in browser.find_element(By.ID, "run-test").text
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    assert browser.execute_script("return document.scripts.length") == 3  # plotly, data, page: nothing injected
    badge = browser.find_element(By.CSS_SELECTOR, "header.hero .badge")
    assert badge.text.lower() == findings["verdict"]

    # the drill-down shows the request: its output text, and its token strip spells the same text
    card = next(
        d
        for d in browser.find_elements(By.CSS_SELECTOR, "details.req")
        if d.find_element(By.CSS_SELECTOR, ".rid").text == XSS_ID
    )
    browser.execute_script(
        "arguments[0].open = true; arguments[0].scrollIntoView({block: 'center', behavior: 'instant'})", card
    )
    texts = [p.text for p in card.find_elements(By.CSS_SELECTOR, "pre.text")]
    assert XSS in texts  # the output text, shown as text
    assert any(XSS in t for t in texts[:1])  # and the prompt it was given
    strip = card.find_element(By.CSS_SELECTOR, ".strip")
    assert browser.execute_script("return arguments[0].textContent", strip) == XSS

    # hover a token: the tooltip shows both sides' top-k, decoded
    from selenium.webdriver.support.ui import WebDriverWait

    token = strip.find_elements(By.CSS_SELECTOR, ".tok")[1]
    browser.execute_script("arguments[0].scrollIntoView({block: 'center', behavior: 'instant'})", token)
    ActionChains(browser).move_to_element(token).perform()
    tip = browser.find_element(By.ID, "tip")
    WebDriverWait(browser, 5).until(lambda d: tip.is_displayed())
    assert "engine top-k" in tip.text and "reference top-k" in tip.text and '"s"' in tip.text
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    assert severe(browser.get_log("browser")) == []

    # #request-ID (the anchor `lpf watch`'s live page links a flagged request to) opens that request, in view; an
    # id not drilled into says so
    closed = [d.get_attribute("id") for d in browser.find_elements(By.CSS_SELECTOR, "details.req:not([open])")]
    flagged = {f["request_id"] for f in findings["flagged"]}
    target = next(i for i in closed if i.removeprefix("request-") in flagged)
    browser.get((run / "report.html").resolve().as_uri() + "#" + target)
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return document.body.dataset.ready"))
    shown = "var e = document.getElementById(arguments[0]), r = e.getBoundingClientRect();"
    shown += "return [e.open, r.top < window.innerHeight && r.bottom > 0];"
    WebDriverWait(browser, 5).until(lambda d: d.execute_script(shown, target) == [True, True])
    browser.execute_script("location.hash = 'request-nope'")
    note = browser.find_element(By.CSS_SELECTOR, "#worst .unseen")
    WebDriverWait(browser, 5).until(lambda d: note.is_displayed())
    assert note.text.startswith("nope is not among the") and "lpf inspect DIR nope" in note.text


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_report_command_and_bad_directories(xss_run, tmp_path):
    run, _, _ = xss_run
    (run / "report.html").unlink()
    proc = lpf_main("report", run)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(run / "report.html") and (run / "report.html").is_file()
    for bad, message in (
        (tmp_path / "nope", "not a directory"),
        (tmp_path, "not a run, sweep, shrink, conformance, locate or RL directory"),
    ):
        proc = lpf_main("report", bad)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_script_json_cannot_break_out():
    text = script_json({"a": "</script><script>alert(1)</script>", "b": "x & y", "c": "\u2028", "d": float("nan")})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"a": "</script><script>alert(1)</script>", "b": "x & y", "c": "\u2028", "d": None}


# -- sweep and RL directories --------------------------------------------------------------------
@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_sweep_report_renders(xss_run, browser, tmp_path):
    from selenium.webdriver.common.by import By

    from lpf.report import write_report

    run, _, _ = xss_run
    sweep = tmp_path / "sweep"
    knobs = [{"name": "cache_mb", "values": [1.5, 3, 6]}, {"name": "max_num_seqs", "values": [16, 64]}]
    cells = []
    for i, (cache, seqs) in enumerate((c, s) for c in (1.5, 3, 6) for s in (16, 64)):
        name = f"cache_mb={cache},max_num_seqs={seqs}"
        rate = round(0.08 / cache * (1.5 if seqs == 64 else 1.0), 4)
        cells.append(
            {
                "name": name,
                "values": {"cache_mb": cache, "max_num_seqs": seqs},
                "run_dir": f"cells/{name}",
                "verdict": "corrupt" if rate > 0.03 else "clean",
                "counts": {"clean": 500 - int(500 * rate), "noise": 0, "divergent": 0, "corrupt": int(500 * rate)},
                "n_requests": 500,
                "rate": rate,
                "onset_seq": 40 * (i + 1),
                "onset_step": 7 * (i + 1),
                "first_divergence_median": 0.0,
                "period": None,
                "max_abs_logprob_diff": 12.5 / (i + 1),
            }
        )
    shutil.copytree(run, sweep / "cells" / cells[0]["name"])
    (sweep / "sweep.json").write_text(
        json.dumps(
            {
                "kind": "sweep",
                "knobs": knobs,
                "cells": cells,
                "moves": [
                    {
                        "knob": "cache_mb",
                        "metric": "rate",
                        "sentence": "rate falls from 5.3% to 1.3% as cache_mb grows 1.5 -> 6",
                    }
                ],
            }
        )
    )
    assert write_report(sweep) == sweep / "report.html"
    log = open_page(browser, sweep / "report.html")
    assert severe(log) == [], log
    n, drawn = plots_drawn(browser)
    assert n >= 5 and drawn == n  # verdict mix + rate, onset seq/step, first divergence, max |diff|
    assert "rate falls from 5.3% to 1.3%" in browser.find_element(By.ID, "moves").text
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "#cells a")]
    assert len(links) == 1 and links[0].endswith("/report.html")  # only the cell whose directory exists


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_rl_report_renders(browser, tmp_path):
    import numpy as np

    from lpf.report import write_report

    rl = tmp_path / "rl"
    rl.mkdir()
    steps = np.arange(1, 61)
    spike = steps % 12 == 0
    rng = np.random.default_rng(0)
    base = 0.002 + 0.0005 * rng.random(60)
    cols = {
        "step": steps,
        "n_responses": np.full(60, 64),
        "n_tokens": np.full(60, 64 * 40),
        "rollout_probs_diff_max": np.where(spike, 0.9, base * 10),
        "rollout_probs_diff_mean": np.where(spike, 0.03, base),
        "rollout_probs_diff_std": np.where(spike, 0.1, base / 2),
        "k3_kl": np.where(spike, 0.2, base / 10),
        "chi2_token": np.where(spike, 3.0, 0.01),
        "ess": np.where(spike, 0.6, 0.99),
        "train_rollout_logprob_abs_diff": np.where(spike, 0.5, base),
        "token_mult_prob_error": np.where(spike, 1.6, 1 + base),
        "robust_z": np.where(spike, 25.0, rng.normal(0, 1, 60)),
        "spike": spike,
    }
    pq.write_table(pa.table(cols), rl / "rl_steps.parquet")
    (rl / "rl_findings.json").write_text(
        json.dumps(
            {
                "kind": "rl",
                "n_steps": 60,
                "n_responses": 3840,
                "n_tokens": 153600,
                "bad_rows": [{"row": 17, "reason": "logprobs and tokens differ in length (40 vs 39)"}],
                "spikes": [
                    {
                        "step": int(s),
                        "robust_z": 25.0,
                        "requests": [f"p{s}-r{k}" for k in range(3)],
                        "positions": {"0": 3},
                    }
                    for s in steps[spike]
                ],
                "period": {"period": 12.0, "confidence": 0.97},
                "hypotheses": [
                    {
                        "rank": 1,
                        "feature": "step_mod_12",
                        "sentence": "5/5 spike steps are multiples of 12; 0/55 other steps are",
                        "flagged_with": 5,
                        "flagged_total": 5,
                        "clean_with": 0,
                        "clean_total": 55,
                        "p_value": 1e-6,
                        "score": 6.0,
                    }
                ],
                "noise_floor": {"median": 0.002, "mad": 0.0003, "z_threshold": 6.0},
            }
        )
    )
    write_report(rl)
    log = open_page(browser, rl / "report.html")
    assert severe(log) == [], log
    n, drawn = plots_drawn(browser)
    assert n == 5 and drawn == n
    text = browser.execute_script("return document.body.innerText")
    assert (
        "every 12 steps" in text
        and "5/5 spike steps are multiples of 12" in text
        and "logprobs and tokens differ" in text
    )


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_rl_report_with_a_third_opinion_draws_the_three_curves(browser, tmp_path):
    """`lpf rl rescore` + `rl analyze`: the rollout / trainer / reference curves and each spike's side."""
    import numpy as np
    from selenium.webdriver.common.by import By

    from lpf.report import write_report

    rl = tmp_path / "rl"
    rl.mkdir()
    steps = np.arange(1, 29)
    spike = steps % 7 == 0
    lie = np.where(spike, 0.8, 2e-4)
    cols = {
        "step": steps,
        "n_responses": np.full(28, 8),
        "n_tokens": np.full(28, 100),
        "rollout_probs_diff_max": lie,
        "robust_z": np.where(spike, 30.0, 0.0),
        "k3_kl": lie / 2,
        "train_rollout_logprob_abs_diff_per_token": lie,
        "rollout_ref_abs_diff": lie,
        "trainer_ref_abs_diff": np.full(28, 1e-6),
        "rollout_logprob_mean": -1.2 - lie,
        "trainer_logprob_mean": np.full(28, -1.2),
        "reference_logprob_mean": np.full(28, -1.2),
        "spike": spike,
    }
    pq.write_table(pa.table(cols), rl / "rl_steps.parquet")
    sentence = (
        "against the reference zoo:hybrid, every spike is the rollout engine's (the trainer agrees with the reference)"
    )
    (rl / "rl_findings.json").write_text(
        json.dumps(
            {
                "kind": "rl",
                "n_steps": 28,
                "n_responses": 224,
                "n_tokens": 2800,
                "bad_rows": [],
                "spikes": [
                    {
                        "step": int(s),
                        "robust_z": 30.0,
                        "requests": ["rank_1/seq_0", "rank_1/seq_1/span_1"],
                        "positions": {"3": 2},
                        "side": "rollout",
                        "sides": {"rollout": 2},
                        "request_sides": ["rollout", "rollout"],
                    }
                    for s in steps[spike]
                ],
                "period": {"period": 7.0, "confidence": 1.0},
                "hypotheses": [],
                "reference": {"model": "zoo:hybrid", "spikes": {"rollout": 4}, "sentence": sentence},
                "noise_floor": {"z_threshold": 6.0},
            }
        )
    )
    write_report(rl)
    open_page(browser, rl / "report.html")
    titles = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#series h3")]
    assert "rollout, trainer and reference: mean |logprob difference| per step" in titles
    assert "mean logprob per step: rollout, trainer, reference" in titles
    n, drawn = plots_drawn(browser)
    assert n == 6 and drawn == n
    text = browser.find_element(By.ID, "spikes").text
    assert sentence in text and "SIDE" in text.upper() and text.count("rollout") >= 4


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_rl_report_shows_the_causes_and_their_fixes(browser, tmp_path, lpf_cli):
    """A real `lpf rl analyze` of a dump whose trainer errs only in micro-batches of more than one
    sequence (as verl #6280): the Causes section names batch shape with its share and the frameworks'
    fix, and the per-step shares are drawn."""
    import numpy as np
    from selenium.webdriver.common.by import By

    rng = np.random.default_rng(0)
    rows = []
    for step in range(1, 11):
        for i, mbs in enumerate([1, 1, 1, 2, 2, 2, 4, 4, 4, 4]):
            r = -rng.uniform(0.05, 3.0, 24)
            t = np.minimum(r + (rng.normal(0, 0.02, 24) if mbs > 1 else 0.0), 0.0)
            rows.append(
                {
                    "step": step,
                    "request_id": f"s{step}-{i}",
                    "response_token_ids": list(range(3, 27)),
                    "rollout_logprobs": r.tolist(),
                    "trainer_logprobs": t.tolist(),
                    "micro_batch_size": mbs,
                }
            )
    dump = tmp_path / "mb.parquet"
    pq.write_table(pa.Table.from_pylist(rows), dump)
    r = lpf_cli("rl", "analyze", dump, "--rollout-dtype", "float32", "--trainer-dtype", "float32")
    assert r.code == 0, r.err
    open_page(browser, tmp_path / "mb.rl" / "report.html")
    titles = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#series h3")]
    assert "mismatch causes per step (share of the step's sum |d|)" in titles
    n, drawn = plots_drawn(browser)
    assert drawn == n
    text = browser.find_element(By.ID, "causes").text
    assert "batch shape" in text and "named" in text and "log_prob_micro_batch_size_per_gpu" in text, text[:2000]


def test_scatter_downsampling_keeps_flagged_and_envelope():
    """100k requests become at most MAX_SCATTER_POINTS points: every flagged request, and per arrival
    bin the largest |diff| of the rest (so a spike among clean requests is never dropped)."""
    import numpy as np

    from lpf.report.charts import MAX_SCATTER_POINTS, downsample_by_bin

    rng = np.random.default_rng(1)
    n = 100_000
    x = np.arange(n)
    y = rng.random(n) * 1e-5
    flagged = np.zeros(n, bool)
    flagged[rng.choice(n, 300, replace=False)] = True
    y[flagged] = 10.0
    y[77_777] = 0.1  # the largest unflagged value
    idx = downsample_by_bin(x, y, flagged, MAX_SCATTER_POINTS)
    assert len(idx) <= MAX_SCATTER_POINTS and np.all(np.diff(x[idx]) > 0)
    assert set(np.flatnonzero(flagged)) <= set(idx.tolist()) and 77_777 in idx


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_prompt_section_and_conformance_matrix_render(xss_run, browser, tmp_path, lpf_cli, prompts_200):
    """A run with prompt logprobs shows its prompt (prefill) section; a conformance directory its matrix,
    with model text and sentences kept as text and cells linking to their run's report."""
    from selenium.webdriver.common.by import By

    from conftest import write_prompts
    from lpf.report import write_report

    wl = write_prompts(tmp_path / "p.jsonl", [json.loads(x) for x in prompts_200.read_text().splitlines()[:8]])
    run = tmp_path / "drill"
    r = lpf_cli(
        "audit",
        "--model",
        "zoo:hybrid",
        "--workload",
        wl,
        "--max-tokens",
        4,
        "--prompt-logprobs",
        "--max-num-batched-tokens",
        16,
        "--inject",
        "lost-chunk-state",
        "--out",
        run,
        "--fail-on",
        "never",
    )
    assert r.code == 0, r.err
    log = open_page(browser, run / "report.html")
    assert severe(log) == [], log
    text = browser.find_element(By.ID, "prompt").text
    assert "Prompt verdict" in text and "jumps at a chunk boundary" in text
    conf = tmp_path / "conf"
    shutil.copytree(xss_run[0], conf / "cells" / "GraniteMoeHybrid" / "fp32")
    cell = {
        "architecture": "GraniteMoeHybridForCausalLM",
        "cell": "fp32",
        "status": "ok",
        "verdict": "divergent",
        "prompt_verdict": "clean",
        "max_abs_output": 3.5,
        "max_abs_prompt": 1e-5,
        "first_divergence": 2,
        "link": "cells/GraniteMoeHybrid/fp32/report.html",
        "top_hypothesis": "<script>alert(1)</script>",
        "attribution": {"suspect": "A", "says": "engine bug", "sentence": "vllm (A) is the suspect"},
    }
    failed = {
        "architecture": "GraniteMoeHybridForCausalLM",
        "cell": "bf16",
        "status": "engine error",
        "error": "CPU GDN attention requires BF16",
    }
    # cells the engine's own judgement calls clean although their verdict is not: llama.cpp per token
    # (a departure it names), bf16 per position against the honest bf16 runs
    per_token = {
        "architecture": "Lfm2ForCausalLM",
        "cell": "fp32",
        "status": "ok",
        "verdict": "systematic",
        "conformance": "clean",
        "engine_judgement": {
            "conformance": "clean",
            "causes": [{"name": "normaliser", "says": "a float32 log-softmax", "evidence": "over 40/192"}],
        },
    }
    per_position = {
        "architecture": "Lfm2ForCausalLM",
        "cell": "bf16",
        "status": "ok",
        "verdict": "divergent",
        "conformance": "clean",
        "bf16_paired": {
            "result": "within ensemble",
            "departs": False,
            "share_worse_than_ensemble": 0.31,
            "p_value": 1.0,
        },
    }
    reference_column = [
        {
            "architecture": "Zamba2ForCausalLM",
            "status": "reference inconsistent",
            "departing": ["decode"],
            "paths": {
                "decode": {"max_abs": 1.7, "first_departure": {"prompt": 0, "position": 2}},
                "teacher-forced f32": {"max_abs": 2.6e-4, "first_departure": None},
            },
        },
        {"architecture": "BambaForCausalLM", "status": "no tiny recipe", "reason": "no scaled-down recipe"},
    ]
    (conf / "conformance.json").write_text(
        json.dumps(
            {
                "kind": "conformance",
                "engine": "vllm",
                "engine_version": "0.32.0",
                "reference": "transformers 5.24.0",
                "grid": "small",
                "complete": True,
                "cells": [cell, failed, per_token, per_position],
                "reference_column": reference_column,
                "cell_catalogue": [
                    {"name": "fp32", "args": [], "dtype": "float32"},
                    {"name": "bf16", "args": [], "dtype": "bfloat16"},
                ],
                "architectures": [
                    {"architecture": "GraniteMoeHybridForCausalLM", "status": "audit", "reason": ""},
                    {"architecture": "Lfm2ForCausalLM", "status": "audit", "reason": ""},
                    {"architecture": "JambaForCausalLM", "status": "not supported", "reason": "no selective_scan_fwd"},
                ],
            }
        )
    )
    assert write_report(conf) == conf / "report.html"
    log = open_page(browser, conf / "report.html")
    assert severe(log) == [], log
    matrix = browser.find_element(By.ID, "matrix").text
    assert "engine bug" in matrix
    assert "clean* per token: normaliser" in matrix and "per position: 31% worse" in matrix, matrix
    findings = browser.find_element(By.ID, "findings").text
    assert "<script>alert(1)</script>" in findings  # text, not markup
    not_clean = browser.find_element(By.CSS_SELECTOR, "#findings ul.sentences").text
    assert "GraniteMoeHybrid · fp32" in not_clean and "Lfm2" not in not_clean  # both Lfm2 cells judged clean
    assert "normaliser" in findings and "over 40/192" in findings  # the departure per-token judging names
    ref = browser.find_element(By.ID, "reference").text
    assert "Zamba2" in ref and "reference inconsistent" in ref and "1.7 from position 2 of prompt 0" in ref, ref
    assert "no scaled-down recipe" in ref
    assert "no selective_scan_fwd" in browser.find_element(By.ID, "not-audited").text
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "#matrix a")]
    assert len(links) == 1 and links[0].endswith("fp32/report.html")


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_a_large_runs_histogram_is_drawn_from_every_kth_request(xss_run, monkeypatch):
    """Above HISTOGRAM_TOKENS scored tokens the report reads the token rows of every k-th request only
    (bounded memory on a 100M-token run), says so, and counts exactly those requests' tokens."""
    import pyarrow.parquet as pq

    from lpf.report import run_page

    run, _, _ = xss_run
    summary = pq.read_table(run / "summary.parquet")
    scored = summary.column("n_scored_tokens").to_pylist()

    def drawn(page) -> int:
        return sum(sum(d["y"]) for d in page["charts"]["histogram"]["data"] if d.get("type") == "bar")

    whole = run_page.load(run)
    assert whole["notes"]["histogram_every"] == 1 and drawn(whole) == sum(scored)
    monkeypatch.setattr(run_page, "HISTOGRAM_TOKENS", sum(scored) // 4)
    sampled = run_page.load(run)
    every = sampled["notes"]["histogram_every"]
    assert every in (4, 5) and drawn(sampled) == sum(scored[::every]) < sum(scored) // 3
    # the rest of the page does not change with the sample
    assert sampled["findings"] == whole["findings"] and sampled["drill"] == whole["drill"]
