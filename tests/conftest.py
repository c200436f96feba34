"""Shared fixtures: an isolated model cache, a CLI driver, and small prompt files.

`lpf_cli(*args)` runs the real `lpf` entry point in-process (argv, exit code, stdout, stderr), so
tests exercise the same parsing and error handling a user gets, without a process start each time.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


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
