"""One spec, one builder: `lpf audit`'s options and `lpf.audit`'s keywords are one set of names, built into an
`AuditSpec` by one function (`lpf.pipeline.audit_options.build_spec`), engine hooks included.

- The option walk: every click option of `lpf audit` (the named engine-knob flags too) is a keyword of the
  same name in `lpf.audit` with the same default, but the terminal's own three (`--json`, `--fail-on`,
  `--spec`, each answered by the API in its own way); and a non-default value of each option gives the
  same spec through the command line and through the API.
- The options of `lpf audit` that apply to `lpf.compare` (the reference's, thresholds, attribution,
  temperature, a trace directory, where it goes) are its keywords too.
- `--limit N` keeps the first N prompts (`--n` still multiplies each).
- The openai engine through the API against a real `lpf serve` on 127.0.0.1: a served model name with a
  local reference, as the command line has always taken it.
"""

from __future__ import annotations

import inspect
import json

import click
import pytest

import lpf
from lpf.cli.run import audit as audit_command
from lpf.pipeline.audit_options import TERMINAL_ONLY, AuditOptions, knob_flags

# a non-default value per option: (command-line arguments, the API's keyword value)
SAMPLES = {
    "engine": (["--engine", "hf"], "hf"),
    "model": (["--model", "tiny:hybrid"], "tiny:hybrid"),
    "workload": (["--workload", "prompts.jsonl"], "prompts.jsonl"),
    "n": (["--n", "3"], 3),
    "limit": (["--limit", "7"], 7),
    "temperature": (["--temperature", "0.7"], 0.7),
    "top_p": (["--top-p", "0.9"], 0.9),
    "top_k": (["--top-k", "4"], 4),
    "max_tokens": (["--max-tokens", "9"], 9),
    "seed": (["--seed", "5"], 5),
    "ignore_eos": (["--ignore-eos"], True),
    "logprobs": (["--logprobs", "3"], 3),
    "prompt_logprobs": (["--prompt-logprobs"], True),
    "part_size": (["--part-size", "8"], 8),
    "trace_dir": (
        ["--engine", "openai", "--model", "SERVED", "--reference", "zoo:hybrid", "--base-url", "http://h:1/v1"]
        + ["--trace-dir", "/tmp/t"],
        "/tmp/t",
    ),
    "engine_option": (["-E", "block_size=32"], ["block_size=32"]),
    "reference": (["--reference", "tiny:hybrid"], "tiny:hybrid"),
    "reference_model": (["--reference", "http://h:1/v1", "--reference-model", "M"], "M"),
    "reference_concurrency": (
        ["--reference", "http://h:1/v1", "--reference-model", "M"] + ["--reference-concurrency", "3"],
        3,
    ),
    "reference_option": (["--reference", "vllm:zoo:hybrid", "-R", "max_model_len=512"], ["max_model_len=512"]),
    "reference_dtype": (["--reference-dtype", "bfloat16"], "bfloat16"),
    "reference_device": (["--reference-device", "cpu"], "cpu"),
    "token_budget": (["--token-budget", "999"], 999),
    "executor": (["--executor", "ray"], "ray"),
    "ray_address": (["--executor", "ray", "--ray-address", "ray://h:1"], "ray://h:1"),
    "actors": (["--executor", "ray", "--actors", "3"], 3),
    "gpus_per_actor": (["--executor", "ray", "--gpus-per-actor", "0.5"], 0.5),
    "calibrate": (["--calibrate"], True),
    "attribution": (["--no-attribution"], False),
    "threshold": (["--threshold", "tie_margin=0.5"], ["tie_margin=0.5"]),
    "kv_cache_dtype": (["--kv-cache-dtype", "q8_0"], "q8_0"),
    "flash_attention": (["--flash-attention", "on"], "on"),
    "weight_quantization": (["--weight-quantization", "q4_k_m"], "q4_k_m"),
    # two of the generated knob flags: a builtin one and a repeatable one
    "inject": (["--inject", "stale-state"], "stale-state"),
    "max_num_seqs": (["--max-num-seqs", "3"], 3),
}
# what an option's keyword needs beside it to be valid (the CLI sample carries the same)
CONTEXT = {
    "trace_dir": {"engine": "openai", "model": "SERVED", "reference": "zoo:hybrid", "base_url": "http://h:1/v1"},
    "reference_model": {"reference": "http://h:1/v1"},
    "reference_concurrency": {"reference": "http://h:1/v1", "reference_model": "M"},
    "reference_option": {"reference": "vllm:zoo:hybrid"},
    "ray_address": {"executor": "ray"},
    "actors": {"executor": "ray"},
    "gpus_per_actor": {"executor": "ray"},
}


def _options() -> list[click.Option]:
    ctx = audit_command.make_context("audit", [], resilient_parsing=True)
    return [p for p in audit_command.get_params(ctx) if isinstance(p, click.Option) and "--help" not in p.opts]


def _cli_spec(args: list[str]):
    from lpf.cli.audit_spec import build_audit_spec

    ctx = audit_command.make_context("audit", [*args, "--out", "/tmp/lpf-walk"])
    return build_audit_spec({k: v for k, v in ctx.params.items() if k not in TERMINAL_ONLY})


def test_every_audit_option_is_an_api_keyword_of_the_same_name_and_default():
    keywords = set(AuditOptions.model_fields) | set(knob_flags())
    options = _options()
    assert {"limit", "n", "engine_option", "threshold", "inject"} <= {p.name for p in options}
    missing = [p.opts[0] for p in options if p.name not in keywords and p.name not in TERMINAL_ONLY]
    assert missing == [], f"lpf audit options with no lpf.audit keyword: {missing}"
    given = audit_command.make_context("audit", []).params  # every option as the command sees it untouched
    for p in options:
        if p.name in AuditOptions.model_fields:
            field = AuditOptions.model_fields[p.name]
            default = given[p.name]
            assert default == field.default, f"{p.opts[0]}: the command's default {default!r} != {field.default!r}"
        elif p.name in knob_flags():
            assert given[p.name] in (None, ()), f"{p.opts[0]}: a knob flag not given must leave the engine's default"


def test_every_option_gives_the_same_spec_from_the_command_line_and_the_api():
    # `out` is in every comparison below (both sides name the same directory)
    walked = {p.name for p in _options()} - set(TERMINAL_ONLY) - (set(knob_flags()) - set(SAMPLES)) - {"out"}
    assert walked <= set(SAMPLES), f"options without a sample here: {sorted(walked - set(SAMPLES))}"
    from lpf.api.audit import build_spec

    base = _cli_spec([])
    for name, (args, value) in SAMPLES.items():
        if name == "executor":
            pytest.importorskip("ray")
        cli = _cli_spec(args)
        api = build_spec(out="/tmp/lpf-walk", **{**CONTEXT.get(name, {}), name: value})
        assert cli == api, name
        assert cli != base, f"{name}: the sample value changed nothing"


def test_an_option_error_names_the_flag_on_the_command_line_and_the_keyword_in_the_api(lpf_cli):
    r = lpf_cli("audit", "--limit", "0", "--out", "/tmp/lpf-never")
    assert r.code == 2 and "--limit must be >= 1, got 0" in r.err
    with pytest.raises(lpf.LpfError, match=r"^lpf.audit: limit must be >= 1, got 0$"):
        lpf.audit(limit=0)
    with pytest.raises(lpf.LpfError, match="no setting 'limt'.*did you mean 'limit'"):
        lpf.audit(limt=3)


def test_the_options_that_apply_to_compare_are_its_keywords():
    applies = {"out", "reference", "reference_dtype", "reference_device", "token_budget"}
    applies |= {"temperature", "trace_dir", "threshold", "attribution"}
    assert applies <= {p.name for p in _options()}
    taken = set(inspect.signature(lpf.compare).parameters) | set(inspect.signature(lpf.Reference.compare).parameters)
    assert applies - taken == set()
    with pytest.raises(lpf.LpfError, match="give reference_dtype or dtype, not both"):
        lpf.compare([], reference="tiny:hybrid", dtype="float32", reference_dtype="bfloat16")


def test_limit_keeps_the_first_prompts_and_n_still_multiplies_them(tmp_path):
    from lpf.api.audit import build_spec
    from lpf.pipeline import create_run
    from lpf.zoo import registry

    run = create_run(build_spec(limit=3, n=2, max_tokens=2, out=tmp_path / "run"))  # written, not generated
    w = run.manifest["workload"]
    assert (w["limit"], w["n_prompts"], w["n_requests"]) == (3, 3, 6)
    first = [json.loads(line)["id"] for line in (run.path / "workload.jsonl").read_text().splitlines()]
    assert first == [it["id"] for it in registry.workload_items("oracle")[:3]]


@pytest.mark.slow  # an `lpf serve` child and an audit through it (~20 s)
def test_the_openai_engine_through_the_api_takes_a_served_name_and_a_local_reference(tmp_path):
    from lpf.serve.process import served

    with served("--model", "zoo:hybrid", "--served-model-name", "SERVED", "--cache-mb", 16) as s:
        findings = lpf.audit(
            engine="openai",
            model="SERVED",
            reference="zoo:hybrid",
            engine_options={"base_url": s.base_url + "/v1"},
            limit=4,
            max_tokens=4,
            reference_device="cpu",
            out=tmp_path / "run",
        )
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["engine"]["options"]["served_model"] == "SERVED" and m["model"]["spec"] == "zoo:hybrid"
    assert findings.n_requests == 4 and findings.errors == 0
    assert findings.verdict == "clean", findings.verdict
