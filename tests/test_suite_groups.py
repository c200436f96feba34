"""The suite's split over pytest-xdist workers (tests/conftest.py) stays true to the tests it names.

Read from the test files themselves (their syntax trees), so a test added later is held to it: every
test that takes the session-wide `hybrid_audit` run is in the one group that builds it, every test that
needs vLLM is in the `vllm` group (one engine at a time), and every name the groups list exists.
"""

from __future__ import annotations

import ast
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def _tests():
    """(module, test name, argument names, decorator names) of every top-level test function."""
    for path in sorted(TESTS.glob("test_*.py")):
        body = ast.parse(path.read_text()).body
        # a module-wide `pytestmark = [...]` marks every test in it, as a decorator would
        marks = set()
        for node in body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
                values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                marks |= {ast.unparse(v).split("(")[0] for v in values}
        for node in body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                decorators = {ast.unparse(d).split("(")[0] for d in node.decorator_list} | marks
                yield path.stem, node.name, {a.arg for a in node.args.args}, decorators


def test_shared_fixtures_and_vllm_tests_are_each_in_one_group():
    tests = list(_tests())
    readers = [(m, t) for m, t, args, _ in tests if "hybrid_audit" in args]
    vllm = [
        (m, t) for m, t, _, decorators in tests if "needs_vllm" in decorators or m in ("test_vllm", "test_vllm_trace")
    ]
    assert readers and vllm
    for module, test in readers:
        assert conftest.group_of(f"tests/{module}.py::{test}") == "hybrid-audit", (module, test)
    for module, test in vllm:
        assert conftest.group_of(f"tests/{module}.py::{test}") == "vllm", (module, test)


def test_every_grouped_name_exists_and_parameters_stay_with_their_test():
    names = {m for m, *_ in _tests()} | {f"{m}::{t}" for m, t, *_ in _tests()}
    for group, members in conftest.SHARED_GROUPS.items():
        assert set(members) <= names, (group, set(members) - names)
    assert set(conftest.LONGEST_FIRST) <= {
        conftest.group_of(f"tests/{n.replace('::', '.py::', 1)}" if "::" in n else f"tests/{n}.py::t") for n in names
    }
    assert conftest.group_of("tests/test_run_level.py::test_healthy_bf16_vllm_passes_the_default_gate") == "vllm"
    assert (
        conftest.group_of("tests/test_run_level.py::test_each_substitution_drill_is_different_and_systematic[a-b]")
        == "test_run_level"
    )
