"""Shared fixtures: an isolated model cache, a CLI driver, and small prompt files; how the suite splits
over pytest-xdist workers.

`lpf_cli(*args)` runs the real `lpf` entry point in-process (argv, exit code, stdout, stderr), so
tests exercise the same parsing and error handling a user gets, without a process start each time.

Parallel runs (`make test`: `-n 2 --dist loadgroup --no-loadscope-reorder`): every test gets an
`xdist_group`, so a work unit is never smaller than what its fixtures share. By default the group is
the test's module (module-scoped servers and runs are built once, on one worker); modules that share a
session fixture or a resource two workers must not hold at once share one group (`SHARED_GROUPS`);
groups are handed out longest first (`LONGEST_FIRST`), so the last one to finish is a short one.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# Modules that must run on one worker, one after another: they read one session-scoped fixture (built
# once per worker: two workers would each build it), or each start a vLLM engine (two vLLM CPU
# engines at once take ~2x the memory of one on a machine shared with others).
SHARED_GROUPS = {
    "hybrid-audit": ["test_audit_hf", "test_bad_input", "test_edit_flags", "test_query", "test_run_schema"],
    "vllm": ["test_vllm", "test_vllm_trace"],
}
# Measured with --durations (serial seconds on this machine, 2026-12-02); an unlisted group goes after these
# in collection order.
LONGEST_FIRST = ["vllm"]


def _group_of(module: str) -> str:
    for group, modules in SHARED_GROUPS.items():
        if module in modules:
            return group
    return module


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(True for _ in item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(_group_of(item.module.__name__)))
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}

    def key(item):
        mark = next(item.iter_markers("xdist_group"))
        return rank.get(mark.args[0] if mark.args else mark.kwargs.get("name"), len(rank))

    items.sort(key=key)  # stable: collection order within a rank


@pytest.fixture(scope="session", autouse=True)
def _lpf_cache(tmp_path_factory):
    import os

    cache = tmp_path_factory.mktemp("lpf-cache")
    os.environ["LPF_CACHE"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield cache


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def lpf_cli(capsys, monkeypatch):
    from lpf import cli

    def run(*args) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["lpf", *map(str, args)])
        capsys.readouterr()
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def write_prompts(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


@pytest.fixture(scope="session")
def prompts_200(tmp_path_factory) -> Path:
    """200 varied prompts from the zoo's generators (oracle tasks, some with filler text)."""
    from lpf.zoo import registry

    items = registry.workload_items("oracle", seed=7, n=200)
    path = tmp_path_factory.mktemp("workloads") / "prompts200.jsonl"
    return write_prompts(path, [{"id": it["id"], "prompt": it["prompt"], "expected": it["expected"]} for it in items])


def lpf_subprocess(*args, timeout: float = 600, **kw):
    """The installed `lpf` console script in a child process (for long runs and signal tests)."""
    import os
    import subprocess

    exe = Path(sys.executable).with_name("lpf")
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, **kw)


@pytest.fixture(scope="session")
def hybrid_audit(tmp_path_factory, prompts_200):
    """One `lpf audit --engine hf` of the tiny hybrid over 200 prompts, float32, shared by tests
    that only read it (copy it before changing anything)."""
    out = tmp_path_factory.mktemp("runs") / "hybrid"
    proc = lpf_subprocess("audit", "--engine", "hf", "--model", "tiny:hybrid", "--workload", prompts_200,
                          "--max-tokens", 12, "--out", out, "--json")
    return out, proc
