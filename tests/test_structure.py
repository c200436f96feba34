"""The codebase's shape: imports run one way (no cycle), the command line's modules stay apart, every
command's --help works, and `lpf --help` stays light (no torch, no transformers)."""

from __future__ import annotations

import ast
import functools
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
    importing the submodule of that name when there is one. (Read once per session; a copy each call.)"""
    return {m: set(deps) for m, deps in _read_module_imports().items()}


@functools.lru_cache(maxsize=1)
def _read_module_imports() -> dict[str, set[str]]:
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
                found.append(stack[stack.index(v) :] + [v])
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


def test_command_modules_import_only_the_shared_cli_modules():
    graph = _module_imports()
    shared = {
        "lpf.cli.common",
        "lpf.cli.options",
        "lpf.cli.audit_spec",
        "lpf.cli.render",
        "lpf.cli.render_compare",
        "lpf.cli.render_rl",
        "lpf.cli.render_locate",
        "lpf.cli.render_experiments",
        "lpf.cli.render_views",
        "lpf.cli.render_watch",
    }
    commands = [m for m in graph if m.startswith("lpf.cli.") and m not in shared]
    assert {"lpf.cli.run", "lpf.cli.views", "lpf.cli.experiments", "lpf.cli.rl", "lpf.cli.serve"} <= set(commands)
    for m in commands:
        cli_deps = {d for d in graph[m] if d == "lpf.cli" or d.startswith("lpf.cli.")}
        assert cli_deps <= shared, (m, cli_deps - shared)
    assert not {d for m in shared for d in graph[m] if d.startswith("lpf.cli.")} - shared
    # domain modules never reach back into the command line (`python -m lpf` is the command line's entry point)
    for m, deps in graph.items():
        if not m.startswith("lpf.cli") and m != "lpf.__main__":
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
    probe = (
        "import sys; sys.argv = ['lpf', '--help']\n"
        "from lpf.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import json; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'pyarrow', 'numpy', 'duckdb'))))"
    )
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


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return seen


def _is_cli(m: str) -> bool:
    return m == "lpf.cli" or m.startswith("lpf.cli.") or m == "lpf.__main__"


def test_experiments_never_import_click_or_the_command_line():
    """Experiments get AuditSpecs and knob questions, not argument lists: no module under
    lpf/experiments/ imports click or lpf.cli, directly or through anything it imports."""
    graph = _module_imports()
    experiments = [m for m in graph if m.startswith("lpf.experiments")]
    assert {
        "lpf.experiments.cells",
        "lpf.experiments.sweep",
        "lpf.experiments.repeat",
        "lpf.experiments.shrink.judge",
        "lpf.experiments.conformance.plan",
    } <= set(experiments)
    for m in experiments:
        assert not {d for d in _closure(graph, m) if _is_cli(d)}, m
        tree = ast.parse(
            (SRC / Path(*m.split("."))).with_suffix(".py").read_text()
            if (SRC / Path(*m.split("."))).with_suffix(".py").is_file()
            else (SRC / Path(*m.split(".")) / "__init__.py").read_text()
        )
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "click" not in imported, m


def test_knobs_flow_down_from_the_command_line_and_never_climb_back():
    """The import-graph form of following a knob: `knobs` from `lpf sweep` (cli/experiments builds its
    cells' AuditSpecs and hands them to experiments.sweep, which runs each as a cell) and `max_num_seqs`
    from `lpf audit` (cli/run builds an AuditSpec; the pipeline validates the engine options against the
    adapter's Options, whose builtin fields are declared in builtin/config) pass only through modules
    whose whole import closure stays out of lpf.cli."""
    graph = _module_imports()
    assert "lpf.experiments.sweep" in graph["lpf.cli.experiments"]
    # the one spec builder is where options become a spec (`lpf audit`, `lpf sweep`'s cells and `lpf.audit`)
    assert "lpf.pipeline.audit_options" in graph["lpf.cli.audit_spec"]
    assert "lpf.pipeline.audit_options" in graph["lpf.api.audit"]
    assert "lpf.pipeline.spec" in graph["lpf.pipeline.audit_options"]
    assert "lpf.cli.audit_spec" in graph["lpf.cli.run"] and "lpf.cli.audit_spec" in graph["lpf.cli.experiments"]
    sweep_path = ["lpf.experiments.sweep", "lpf.experiments.cells", "lpf.pipeline.spec", "lpf.core.knobs"]
    audit_path = [
        "lpf.pipeline.spec",
        "lpf.pipeline.generate",
        "lpf.adapters",
        "lpf.adapters.builtin",
        "lpf.builtin.config",
        "lpf.builtin.llm_engine",
        "lpf.builtin.scheduler",
        "lpf.core.knobs",
    ]
    # the hand-offs along the way are imports (data flows down them)
    for a, b in (
        ("lpf.experiments.sweep", "lpf.experiments.cells"),
        ("lpf.experiments.cells", "lpf.pipeline.spec"),
        ("lpf.pipeline.spec", "lpf.adapters"),
        ("lpf.pipeline.generate", "lpf.pipeline.spec"),
        ("lpf.pipeline.generate", "lpf.adapters"),
        ("lpf.adapters.builtin", "lpf.builtin.config"),
        ("lpf.builtin.llm_engine", "lpf.builtin.scheduler"),
        ("lpf.builtin.config", "lpf.core.knobs"),
    ):
        assert b in graph[a], (a, b)
    for m in sweep_path + audit_path:
        assert m in graph and not {d for d in _closure(graph, m) if _is_cli(d)}, m


INVERSE_NAMES = ("knob_args", "rescore_args", "parse_audit_args", "audit_option_kinds")


def _declares_an_option(node: ast.AST) -> bool:
    """click.option(...), click.Option([...]), click.argument(...): where option strings belong."""
    f = node.func if isinstance(node, ast.Call) else None
    return isinstance(f, ast.Attribute) and f.attr in ("option", "Option", "argument", "Argument")


def _strings_outside_declarations(node: ast.AST):
    if _declares_an_option(node):
        return
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    for child in ast.iter_child_nodes(node):
        yield from _strings_outside_declarations(child)


def _argv_literals(fn: ast.AST) -> list[str]:
    """Option strings ("--x", "-E") a function body puts into a list, a tuple or list.append/extend
    (an option's own declaration aside)."""
    hits = []
    for node in (n for stmt in fn.body for n in ast.walk(stmt)):
        items = (
            node.elts
            if isinstance(node, (ast.List, ast.Tuple))
            else (
                node.args
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "extend", "insert")
                else []
            )
        )
        hits += [v for item in items for v in _strings_outside_declarations(item) if v.startswith("--") or v == "-E"]
    return hits


def test_the_command_line_never_turns_options_back_into_arguments():
    """Options become an AuditSpec once (cli.audit_spec.build_audit_spec) and nothing in lpf/cli/ turns
    options or a spec back into an argument list: no function there builds a list holding an option
    string, and the old inverse functions are gone everywhere."""
    offenders = []
    for p in sorted((SRC / "lpf").rglob("*.py")):
        tree = ast.parse(p.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        offenders += [f"{p.relative_to(SRC)}: def {fn.name}" for fn in functions if fn.name in INVERSE_NAMES]
        if p.relative_to(SRC / "lpf").parts[0] == "cli":
            offenders += [f"{p.relative_to(SRC)} {fn.name}: {hit!r}" for fn in functions for hit in _argv_literals(fn)]
    assert offenders == [], offenders


def test_the_argv_rule_finds_an_inverse_function():
    """The rule above can fail: the old knob_args shape trips it."""
    fn = ast.parse(
        'def knob_args(o):\n    args = []\n    args += ["--cache-mb", str(o)]\n'
        '    args.append("--inject")\n    return args + ["-E", "x=1"]\n'
    ).body[0]
    assert fn.name in INVERSE_NAMES and _argv_literals(fn) == ["--cache-mb", "--inject", "-E"]
    declares = ast.parse('def opts(f):\n    return _apply(f, [click.option("--n", type=int)])\n').body[0]
    assert _argv_literals(declares) == []


def test_every_command_with_engine_knobs_generates_their_flags():
    """A command that takes -E must be a KnobCommand, or its named knob flags would silently vanish."""
    from lpf.cli import cli
    from lpf.cli.options import KnobCommand

    for path in _all_commands(cli):
        cmd = cli
        for name in path:
            cmd = cmd.commands[name]
        if any(p.name == "engine_option" for p in cmd.params):
            assert isinstance(cmd, KnobCommand), path
            names = {p.name for p in cmd.get_params(click.Context(cmd))}
            assert {"cache_mb", "max_num_seqs", "inject"} <= names, path


# lpf/__init__.py's package map, top to bottom: a package imports only packages below it
LAYERS = [
    "pytest_plugin",
    "cli",
    "experiments",
    "locate",
    "views",
    "serve",
    "rl",
    "api",
    "report",
    "pipeline",
    "adapters",
    "builtin",
    "analysis",
    "run",
    "zoo",
    "core",
]
ALLOWED_UP = {("core", "zoo")}  # core resolves zoo: specs through zoo/registry (lazily)


def test_the_package_map_is_complete_and_imports_run_down_it():
    import lpf

    entries = {
        p.stem if p.is_file() else p.name
        for p in (SRC / "lpf").iterdir()
        if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.stem != "__init__")
    }
    assert entries - {"__main__"} <= set(LAYERS) and set(LAYERS) <= entries, entries ^ set(LAYERS)
    for name in LAYERS:
        assert f"  {name}/" in lpf.__doc__, name
    up = []
    for m, deps in _module_imports().items():
        for d in deps:
            a, b = (x.split(".")[1] if x.count(".") else "" for x in (m, d))
            if a in LAYERS and b in LAYERS and LAYERS.index(b) < LAYERS.index(a) and (a, b) not in ALLOWED_UP:
                up.append((m, d))
    assert up == [], up
