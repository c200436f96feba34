"""The conformance matrix's config-variant axis: which fields the reference's modeling code reads (and
under which flag), the toggles and the pairwise covering built from them, the drop rule (a variant that
leaves the reference's logits unchanged is no row), and, on real vLLM (slow), a structural variant that
audits NemotronH where its default config is `not supported`."""

from __future__ import annotations

import json
from itertools import combinations

import pytest

from test_vllm import needs_vllm

SNIPPET = """
class Mixer:
    def __init__(self, config):
        self.use_norm = config.use_norm
        self.norm = Norm(before=config.norm_before_gate) if config.use_norm else None
        self.act = config.act
        if config.kind == "rope":
            self.rope = Rope(config.rope_theta)
        if getattr(config, "extra", None) is not None:
            pass

    def forward(self, x):
        if self.use_norm:
            x = self.norm(x, scale=self.config.norm_scale)
        return x
"""


def test_config_reads_names_each_field_with_the_flag_it_is_read_under():
    from lpf.experiments.conformance.config_reads import config_reads, modeling_source

    r = config_reads(SNIPPET)
    assert r["norm_before_gate"].enablers == {"use_norm": True}
    assert r["norm_scale"].enablers == {"use_norm": True}  # through the self.use_norm alias
    assert r["rope_theta"].enablers == {"kind": "rope"} and r["kind"].literals == ["rope"]
    assert r["use_norm"].enablers == {} and r["act"].enablers == {} and "extra" in r
    # the installed transformers: FalconH1's gate order only matters with its gated norm on, Zamba2's
    # long-context rope only with its memory rope on
    falcon = config_reads(modeling_source("falcon_h1")[0])
    assert falcon["mamba_norm_before_gate"].enablers == {"mamba_rms_norm": True}
    assert falcon["mamba_rms_norm"].enablers == {}
    zamba = config_reads(modeling_source("zamba2")[0])
    assert zamba["use_long_context"].enablers == {"use_mem_rope": True}
    assert "rope" in config_reads(modeling_source("granitemoehybrid")[0])["position_embedding_type"].literals


def test_toggles_carry_their_enablers_and_the_pairwise_rows_cover_every_pair():
    from lpf.experiments.conformance.config_reads import config_reads, modeling_source
    from lpf.experiments.conformance.tiny import tiny_default_config
    from lpf.experiments.conformance.variants import factors, pairwise, toggles, variants

    config = tiny_default_config("falcon_h1")
    reads = config_reads(modeling_source("falcon_h1")[0])
    fs, skipped = factors(config, reads)
    assert {"mamba_rms_norm", "mamba_norm_before_gate", "projectors_bias", "attention_bias"} <= set(fs)
    assert "hidden_act" in skipped and "_attn_implementation" in skipped
    assert not {"hidden_size", "rms_norm_eps", "ssm_multipliers"} & set(fs)  # sizes and coefficients
    by = {v.name: v for v in toggles(fs)}
    assert by["mamba_norm_before_gate=0"].overrides == {"mamba_norm_before_gate": False, "mamba_rms_norm": True}
    assert by["mamba_rms_norm=1"].overrides == {"mamba_rms_norm": True}
    rows = [{}, *(v.overrides for v in toggles(fs)), *(v.overrides for v in pairwise(fs))]
    for row in rows:  # the gate order is never varied with the gated norm off
        assert row.get("mamba_norm_before_gate", True) or row.get("mamba_rms_norm")
    full = [{f: r.get(f, fs[f].default) for f in fs} for r in rows]
    for a, b in combinations(fs, 2):
        for va in [fs[a].default, *fs[a].alternatives]:
            for vb in [fs[b].default, *fs[b].alternatives]:
                feasible = not (
                    (a == "mamba_norm_before_gate" and va is False and b == "mamba_rms_norm" and vb is False)
                    or (b == "mamba_norm_before_gate" and vb is False and a == "mamba_rms_norm" and va is False)
                )
                if feasible:
                    assert any(r[a] == va and r[b] == vb for r in full), (a, va, b, vb)
    assert len(pairwise(fs)) < 2 ** len(fs) // 8  # a covering array, not the product
    (pub,) = [v for v in variants("falcon_h1", config, reads, ["published"])]
    assert pub.overrides["mamba_norm_before_gate"] is False and "Megatron-Bridge" in pub.source


def test_variant_kinds_are_checked_in_one_line():
    from lpf.core.errors import LpfError
    from lpf.experiments.conformance.variants import KINDS, select_kinds

    assert select_kinds("none") == [] and select_kinds(None) == [] and select_kinds("all") == list(KINDS)
    assert select_kinds("toggle,structural") == ["toggle", "structural"]
    with pytest.raises(LpfError, match="unknown variant kind 'toggles'"):
        select_kinds("toggles")


def test_a_variant_that_leaves_the_references_logits_unchanged_is_dropped(tmp_path):
    from lpf.experiments.conformance.variant_check import check_variants

    prompts = [[1, *range(3, 40)], [1, *range(100, 130)]]
    doc = check_variants(tmp_path, {"architecture": "Mamba2ForCausalLM", "model_type": "mamba2"}, ["toggle"], prompts)
    rows = {v["name"]: v for v in doc["variants"]}
    # float32 everywhere: keeping the residual in float32 or not is the same computation
    assert rows["residual_in_fp32=0"]["status"] == "dropped" and "identical" in rows["residual_in_fp32=0"]["reason"]
    assert rows["use_bias=1"]["status"] == "kept" and rows["use_bias=1"]["max_abs_logit_change"] > 0
    assert rows["random-biases"]["status"] == "kept"  # the default's zero conv biases, drawn at random
    assert doc["factors"]["use_conv_bias"] == {"default": True, "alternatives": [False], "enablers": {}}
    assert json.loads((tmp_path / "variants" / "Mamba2.json").read_text()) == json.loads(json.dumps(doc))


@needs_vllm
@pytest.mark.slow
def test_a_structural_variant_audits_nemotron_h_without_its_moe_on_vllm(lpf_cli, tmp_path):
    out = tmp_path / "conf"
    r = lpf_cli(
        "conformance",
        "--engine",
        "vllm",
        "--arch",
        "NemotronH",
        "--cell",
        "fp32",
        "--variants",
        "structural",
        "--prompts",
        4,
        "--max-tokens",
        6,
        "--out",
        out,
        "--json",
    )
    doc = json.loads(r.out)
    rows = {c["architecture"]: c for c in doc["cells"]}
    assert rows["NemotronHForCausalLM"]["status"] == "not supported"  # the relu^2 MoE (bug 5)
    no_moe = rows["NemotronH~no-moe"]
    assert no_moe["variant_of"] == "NemotronHForCausalLM" and no_moe["variant"]["kind"] == "structural"
    assert no_moe["variant"]["overrides"]["layers_block_type"] == ["linear_attention", "mlp", "full_attention", "mlp"]
    assert no_moe["status"] == "ok" and no_moe["verdict"] is not None, no_moe
    assert "NemotronH~no-moe" in r.out and r.code in (0, 1)


def test_variants_of_an_unsupported_default_are_skipped_but_structural_ones_run():
    from lpf.experiments.conformance.variants import variant_skip

    rows = [{"architecture": "NemotronHForCausalLM", "status": "not supported"}]
    toggle = {
        "architecture": "NemotronH~use_bias=1",
        "variant_of": "NemotronHForCausalLM",
        "variant": {"kind": "toggle"},
    }
    structural = dict(toggle, variant={"kind": "structural"})
    assert "only structural variants run" in variant_skip(toggle, rows)
    assert variant_skip(structural, rows) is None
    assert variant_skip(toggle, rows + [{"architecture": "NemotronHForCausalLM", "status": "ok"}]) is None
    assert variant_skip({"architecture": "NemotronHForCausalLM"}, rows) is None  # a default row


def test_the_matrix_view_names_each_variant_row_and_each_dropped_variant():
    from lpf.experiments.conformance.view import matrix_view

    variant = {"name": "mlp_bias=1", "kind": "toggle", "overrides": {"mlp_bias": True}, "why": "mlp_bias = True"}
    doc = {
        "cell_catalogue": [{"name": "fp32"}],
        "architectures": [
            {"architecture": "FalconH1ForCausalLM", "status": "audit"},
            {
                "architecture": "FalconH1~mlp_bias=1",
                "status": "audit",
                "variant_of": "FalconH1ForCausalLM",
                "variant": variant,
            },
        ],
        "variants": [
            {
                "architecture": "FalconH1ForCausalLM",
                "variants": [{"name": "x=0", "status": "dropped", "reason": "identical"}],
            },
            {"architecture": "Mamba2ForCausalLM", "error": "cannot build", "variants": []},
        ],
        "cells": [
            {"architecture": a, "cell": "fp32", "status": "ok", "verdict": v, "conformance": v, "dtype": "float32"}
            for a, v in (("FalconH1ForCausalLM", "clean"), ("FalconH1~mlp_bias=1", "corrupt"))
        ],
    }
    v = matrix_view(doc)
    assert [name for name, _ in v["grid"]] == ["FalconH1", "FalconH1~mlp_bias=1"]
    assert v["variants"] == [("FalconH1~mlp_bias=1", "toggle", "mlp_bias=True")]
    assert v["dropped"] == [("FalconH1", "x=0", "identical"), ("Mamba2", "(every variant)", "cannot build")]


def test_the_matrix_view_says_clean_star_only_where_the_judgement_made_the_cell_clean():
    """llama.cpp's per-token judgement names its known departures on every cell; a cell that departs past
    them (Bamba on llama.cpp: 81 tokens past the clean threshold) is not shown as clean*."""
    from lpf.experiments.conformance.view import matrix_view

    cause = {"name": "utf8-missing", "evidence": "15 of 96 tokens in 5 requests have no logprob"}
    doc = {
        "cell_catalogue": [{"name": "fp32"}],
        "architectures": [{"architecture": a, "status": "audit"} for a in ("JambaForCausalLM", "BambaForCausalLM")],
        "cells": [
            {
                "architecture": a,
                "cell": "fp32",
                "status": "ok",
                "verdict": "systematic",
                "conformance": c,
                "dtype": "float32",
                "engine_judgement": {"causes": [cause]},
            }
            for a, c in (("JambaForCausalLM", "clean"), ("BambaForCausalLM", "corrupt"))
        ],
    }
    v = matrix_view(doc)
    assert [e["label"] for _, (e,) in v["grid"]] == ["clean*", "systematic"]
    assert [(n, clean) for n, _, _, clean in v["named"]] == [("Jamba · fp32", True), ("Bamba · fp32", False)]


def test_the_dt_limit_variants_clamp_about_half_of_the_steps(monkeypatch):
    """Each `limits` variant moves the Mamba2 mixers' dt clamp to where it acts on a good share of the
    steps (the reason it is a variant at all: at the default it never or rarely acts)."""
    import importlib

    import torch
    from transformers import AutoModelForCausalLM

    from lpf.experiments.conformance.tiny import build_tiny, tiny_default_config
    from lpf.experiments.conformance.variants import LIMITS, variants

    prompts = [[1, *range(3, 60)], [1, *range(200, 240)]]
    for model_type, (variant,) in LIMITS.items():
        assert variants(model_type, tiny_default_config(model_type), {}, ["limits"]) == [variant]
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        scan, seen = modeling.mamba2_chunk_scan, []

        def recording(hs, dt, *a, scan=scan, seen=seen, dt_bias=None, dt_limit=(0.0, float("inf")), **kw):
            raw = torch.nn.functional.softplus(dt + dt_bias) if kw.get("dt_softplus") else dt
            seen.append(((raw < dt_limit[0]) | (raw > dt_limit[1])).float().mean().item())
            return scan(hs, dt, *a, dt_bias=dt_bias, dt_limit=dt_limit, **kw)

        monkeypatch.setattr(modeling, "mamba2_chunk_scan", recording)
        model = AutoModelForCausalLM.from_pretrained(build_tiny(model_type, variant.overrides), dtype=torch.float32)
        with torch.no_grad():
            for p in prompts:
                model(torch.tensor([p]), use_cache=False)
        share = sum(seen) / len(seen)
        assert 0.25 <= share <= 0.75, (model_type, share)


@pytest.mark.slow
def test_the_reference_column_checks_a_variant_rows_own_checkpoint(tmp_path):
    """A variant row's reference check runs on the variant's checkpoint: Mamba2 with a dt limit that acts
    is computed one way by transformers' teacher-forced pass (the chunk scan clamps) and another by its
    decode step (no clamp: bug 15), where the default config's row is consistent."""
    from lpf.experiments.conformance.reference_column import reference_column
    from lpf.experiments.conformance.variants import LIMITS

    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"prompt_token_ids": [1, *range(3, 40)]}) + "\n")
    base = {"architecture": "Mamba2ForCausalLM", "model_type": "mamba2"}
    (v,) = LIMITS["mamba2"]
    variant = {**base, "architecture": "Mamba2~dt-limit", "variant": {"name": v.name, "overrides": v.overrides}}
    rows = {r["architecture"]: r for r in reference_column(tmp_path, [base, variant], workload, max_tokens=6)}
    assert rows["Mamba2ForCausalLM"]["status"] == "reference consistent"
    assert rows["Mamba2~dt-limit"]["status"] == "reference inconsistent"
    assert (
        "decode" in rows["Mamba2~dt-limit"]["departing"]
        and "teacher-forced" not in rows["Mamba2~dt-limit"]["departing"]
    )
    assert (tmp_path / "reference" / "Mamba2~dt-limit.json").is_file()
