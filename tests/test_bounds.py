"""Every bound of every spec and engine-option field reaches the user as one line and exit 2.

The cases are not listed by hand: they are derived by walking the fields, so a field added tomorrow is
tested tomorrow. Walked: `AuditSpec` and the pydantic models under it (`RunSpec`, `AnalysisSpec`), and
every engine's `Options` class, found through the lazy registry (`lpf.adapters.REGISTRY`). For each
field with a bound (ge/gt/le/lt, min/max length, a Literal's choices, also inside `X | None`) a value
just past it is derived and the command line is driven in-process (`lpf_cli`): the field's own flag
where `lpf run`/`lpf audit` has one, `--spec FILE` for spec fields, `-E NAME=VALUE` for engine knobs.
Each must exit 2 with a single `error:` line naming the field, before any model is loaded (the run
directory is never created). `SamplingParams`, `RescoreSettings` and `RayOptions` are dataclasses whose
checks are code, not declared bounds: nothing here can walk them (test_bad_input covers them).
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel

from lpf.adapters import REGISTRY, get_engine_class
from lpf.pipeline.spec import AuditSpec

NOT_A_CHOICE = "zz-not-a-choice"
# what each engine needs besides the bad knob so that only the knob can be refused
ENGINE_ARGS = {
    "openai": ["--model", "zoo:hybrid", "--base-url", "http://127.0.0.1:9/v1"],
    "sglang": ["--base-url", "http://127.0.0.1:9"],
}


def _unwrap(annotation):
    """`X | None` -> X (a bound applies to the value when one is given)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        return args[0] if len(args) == 1 else annotation
    return annotation


def violating(field) -> object | None:
    """A value just past one of the field's declared bounds, or None when it declares none."""
    ann = _unwrap(field.annotation)
    if typing.get_origin(ann) is typing.Literal:
        choices = typing.get_args(ann)
        return (
            max(c for c in choices if isinstance(c, int)) + 1
            if all(isinstance(c, int) for c in choices)
            else NOT_A_CHOICE
        )
    for m in field.metadata:
        step = 1 if ann is int else 0.5
        if isinstance(m, Ge):
            return m.ge - step
        if isinstance(m, Gt):
            return m.gt
        if isinstance(m, Le):
            return m.le + step
        if isinstance(m, Lt):
            return m.lt
        if isinstance(m, MinLen) and m.min_length > 0:
            return "" if ann is str else []
        if isinstance(m, MaxLen):
            return "x" * (m.max_length + 1) if ann is str else [0] * (m.max_length + 1)
    return None


def spec_fields(model=AuditSpec, path=()):
    """(path, field) of every field of the spec models, nested models walked."""
    for name, f in model.model_fields.items():
        ann = _unwrap(f.annotation)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from spec_fields(ann, (*path, name))
        else:
            yield (*path, name), f


SPEC_CASES = [(".".join(p), violating(f)) for p, f in spec_fields() if violating(f) is not None]
ENGINE_CASES = [
    (engine, name, violating(f))
    for engine in sorted(REGISTRY)
    for name, f in get_engine_class(engine).Options.model_fields.items()
    if violating(f) is not None
]


def test_the_walk_finds_the_bounds_it_must():
    """The walk itself cannot silently find nothing: the bounds the issue named are among its cases."""
    assert {"run.n", "run.part_size", "version"} <= {p for p, _ in SPEC_CASES}
    names = {(e, n) for e, n, _ in ENGINE_CASES}
    assert {("builtin", "cache_mb"), ("openai", "concurrency"), ("openai", "request_id_header")} <= names
    assert {("llamacpp", "parallel"), ("llamacpp", "dtype"), ("vllm", "gpu_memory_utilization")} <= names
    assert len(ENGINE_CASES) >= 60


def _one_line(r, *needles):
    assert r.code == 2, (r.code, r.err[-2000:])
    assert "Traceback" not in r.err, r.err[-2000:]
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _flags(command: str) -> dict[str, str]:
    from lpf.cli import cli

    return {p.name: p.opts[0] for p in cli.commands[command].params if p.opts}


@pytest.mark.parametrize("path, value", SPEC_CASES, ids=[p for p, _ in SPEC_CASES])
def test_a_spec_bound_is_one_line_and_exit_2(lpf_cli, tmp_path, path, value):
    name = path.rsplit(".", 1)[-1]
    for command in ("run", "audit"):
        flag = _flags(command).get(name)
        if flag is None or path.count(".") > 1:
            continue
        out = tmp_path / command
        _one_line(lpf_cli(command, flag, value, "--out", out), flag)
        assert not out.exists()
    # the same value in a spec file (`lpf audit --spec`): named by its path
    spec = AuditSpec.model_validate({"run": {"out": str(tmp_path / "s")}}).model_dump(mode="json")
    node = spec
    *parents, last = path.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(spec))
    _one_line(lpf_cli("audit", "--spec", f), path)
    assert not Path(tmp_path / "s").exists()


@pytest.mark.parametrize("engine, name, value", ENGINE_CASES, ids=[f"{e}.{n}" for e, n, _ in ENGINE_CASES])
def test_an_engine_knob_bound_is_one_line_and_exit_2(lpf_cli, tmp_path, engine, name, value):
    out = tmp_path / "run"
    r = lpf_cli("run", "--engine", engine, *ENGINE_ARGS.get(engine, []), "-E", f"{name}={value}", "--out", out)
    _one_line(r, name)
    assert not out.exists()


def test_a_shared_flags_help_names_every_engines_choices(lpf_cli):
    """--dtype serves several engines: its help lists each one's choices (llamacpp's quantized GGUF
    types were missing: the builtin engine's help alone was shown)."""
    from lpf.core.knobs import choices

    r = lpf_cli("audit", "--help")
    assert r.code == 0, r.err
    text = " ".join(r.out.split()).replace("| ", "|").replace(" |", "|")
    for engine in ("llamacpp", "vllm", "builtin"):
        want = "|".join(choices(get_engine_class(engine).Options.model_fields["dtype"].annotation))
        assert want.replace("|", "") in text.replace("|", "").replace(" ", ""), (engine, want)
    assert "q4_k_m" in text.replace(" ", "")
