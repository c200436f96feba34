"""What an engine can do is said once, by class attributes on its adapter (`lpf.adapters.base.Engine`), and
asked by the callers (`lpf.adapters.capability`): no caller keeps a list of engine names.

- Every registered adapter's capabilities have their declared shapes, and a `locate_replay` names a function.
- The callers answer from them: joining a server's trace, `lpf locate`'s engine side, the seeded replay,
  `lpf conformance`'s engines, and a name no adapter has (a run lpf.compare wrote) has none of them.
- The callers hold no engine-name comparisons (the rule can fail: it finds one in a sample).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from lpf.adapters import capability, engine_names, engines_with, get_engine_class
from lpf.adapters.base import CAPABILITY_WORDS
from lpf.core.errors import LpfError

SRC = Path(__file__).resolve().parents[1] / "src" / "lpf"
CALLERS = [
    "locate/__init__.py",
    "pipeline/trace.py",
    "pipeline/replay.py",
    "cli/compare.py",
    "pipeline/generate.py",
    "experiments/kept_cells.py",
]  # (experiments/shrink/repro.py asks `repro_script`, then writes each engine's script config by its name)


def test_every_adapter_declares_its_capabilities_in_their_shapes():
    for name in engine_names():
        cls = get_engine_class(name)
        assert cls.trace_source in (None, "own", "joined"), name
        for attr in CAPABILITY_WORDS:
            if attr not in ("trace_source", "locate_replay"):
                assert isinstance(getattr(cls, attr), bool), (name, attr)
        if cls.locate_replay:
            module, function = cls.locate_replay.split(":")
            assert callable(getattr(importlib.import_module(module), function)), name
    assert engines_with("server") == ["llamacpp", "openai", "sglang"]
    assert engines_with("locate_replay") == ["builtin", "hf", "vllm"]
    assert [e for e in engine_names() if capability(e, "trace_source") == "joined"] == ["openai"]


def test_the_callers_answer_from_the_capabilities():
    from lpf.pipeline.replay import replay_for
    from lpf.pipeline.trace import check_joinable

    check_joinable("openai")
    with pytest.raises(LpfError, match="with --engine openai; the llamacpp engine records its own"):
        check_joinable("llamacpp")
    with pytest.raises(LpfError, match="the hf engine has none to join"):
        check_joinable("hf")
    with pytest.raises(LpfError, match="the external engine has none to join"):
        check_joinable("external")  # lpf.compare's runs: no adapter, no capability
    assert replay_for("hf", {"temperature": 1.0}) is None
    assert replay_for("builtin", {"temperature": 1.0}) is not None
    assert capability("external", "server", False) is False


def test_conformance_refuses_an_engine_that_cannot_say_what_it_loads(lpf_cli, tmp_path):
    r = lpf_cli("conformance", "--engine", "hf", "--out", tmp_path / "c")
    assert r.code == 2 and "the hf adapter cannot say (engines that can: builtin, llamacpp, vllm)" in r.err
    assert not (tmp_path / "c").exists()


def _name_checks(tree) -> list[str]:
    names = set(engine_names())
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for right in node.comparators:
                consts = [right] if isinstance(right, ast.Constant) else getattr(right, "elts", [])
                hits += [c.value for c in consts if isinstance(c, ast.Constant) and c.value in names]
    return hits


def test_no_caller_compares_engine_names():
    assert _name_checks(ast.parse('if name == "openai" or e in ("builtin", "vllm"): pass')) == [
        "openai",
        "builtin",
        "vllm",
    ]
    found = {p: _name_checks(ast.parse((SRC / p).read_text())) for p in CALLERS}
    assert {p: h for p, h in found.items() if h} == {}
