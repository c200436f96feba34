"""The codebase's shape: imports run one way (no cycle), the command line's modules stay apart, every
command's --help works, and `lpf --help` stays light (no torch, no transformers)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_imports() -> dict[str, set[str]]:
    """{module: lpf modules it imports} read from the source (ast), so nothing is imported here.
    A package's `__init__` counts as the package; importing a name from a package counts as
    importing the submodule of that name when there is one."""
    mods = {}
    for p in (SRC / "lpf").rglob("*.py"):
        mods[".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")] = p
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m].update(n for n in names if n in mods and n != m)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        state[u] = 2
        stack.pop()

    for u in sorted(graph):
        if u not in state:
            visit(u)
    return found


def test_no_import_cycle_among_lpf_modules():
    graph = _module_imports()
    # a package importing its own submodules to register them (lpf.cli) is the package's job, not a cycle:
    # count edges from a package __init__ into its own submodules out
    for m in list(graph):
        if (SRC / Path(*m.split("."))).is_dir():
            graph[m] = {n for n in graph[m] if not n.startswith(m + ".")}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_command_modules_import_only_common_and_render():
    graph = _module_imports()
    shared = {"lpf.cli.common", "lpf.cli.render", "lpf.cli.render_compare", "lpf.cli.render_rl", "lpf.cli.render_locate"}
    commands = [m for m in graph if m.startswith("lpf.cli.") and m not in shared]
    assert {"lpf.cli.run", "lpf.cli.views", "lpf.cli.experiments", "lpf.cli.rl", "lpf.cli.serve"} <= set(commands)
    for m in commands:
        cli_deps = {d for d in graph[m] if d == "lpf.cli" or d.startswith("lpf.cli.")}
        assert cli_deps <= shared, (m, cli_deps - shared)
    assert not {d for m in shared for d in graph[m] if d.startswith("lpf.cli.")} - shared
    # domain modules never reach back into the command line
    for m, deps in graph.items():
        if not m.startswith("lpf.cli"):
            assert not any(d == "lpf.cli" or d.startswith("lpf.cli.") for d in deps), m


def _all_commands(group: click.Group, prefix=()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        out.append((*prefix, name))
        if isinstance(cmd, click.Group):
            out += _all_commands(cmd, (*prefix, name))
    return out


def test_every_help_exits_0(lpf_cli):
    from lpf.cli import cli

    commands = _all_commands(cli)
    assert len(commands) >= 14
    for path in [(), *commands]:
        r = lpf_cli(*path, "--help")
        assert r.code == 0, (path, r.err)
        assert "Usage:" in r.out, path


def test_lpf_help_imports_neither_torch_nor_transformers():
    probe = ("import sys; sys.argv = ['lpf', '--help']\n"
             "from lpf.cli import main\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "import json; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'transformers', 'pyarrow', 'numpy', 'duckdb'))))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    assert heavy == [], heavy


@pytest.mark.parametrize("module", ["lpf.adapters.base", "lpf.builtin.scheduler"])
def test_light_modules_stay_light(module):
    """The adapter interface and the scheduler are importable without torch (the scheduler never imports it)."""
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
