"""lpf's pytest plugin (entry point `pytest11: lpf`): lpf's verdicts as a test's assertion, no configuration.

- `lpf_reference` (session fixture): `lpf_reference(model, dtype="float32", device="cpu")` -> an
  `lpf.Reference`, loaded once per session and (model, dtype, device); its `compare(outputs, ...)` writes run
  directories under the session's temporary directory (`.../lpf-runs/`). A test is a fixture and one line:
      lpf_reference("zoo:hybrid").compare(outputs, rule="first-mismatch-topk").check()
- A failed check (`lpf.FindingsCheckFailed`, an AssertionError) gets an `lpf` section in the test's report:
  its run directory and report.html (also in the item's and report's `user_properties` as `lpf_run_dir` /
  `lpf_report`: `--junitxml` writes them as the test case's properties), and
  the session's terminal summary lists every failed check's run directory.
- `--lpf-keep DIR`: each failed check's run directory is copied to DIR/<test name> (the session's temporary
  directory is pruned by pytest after a few sessions) and the copy is what the report names.
Loading the plugin imports nothing heavy (lpf.api.findings: the standard library); the reference loads when
a test first asks for it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from lpf.api.findings import FindingsCheckFailed

_FAILED = pytest.StashKey[list]()


def pytest_addoption(parser):
    group = parser.getgroup("lpf", "logprob-forensics")
    group.addoption(
        "--lpf-keep",
        metavar="DIR",
        default=None,
        help="Copy the run directory of every failed lpf check to DIR/<test name> (kept after the session).",
    )


def pytest_configure(config):
    config.stash[_FAILED] = []


class References:
    """`lpf_reference(model, dtype, device)`: one `lpf.Reference` per (model, dtype, device) per session."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = runs_dir
        self._loaded: dict[tuple[str, str, str], object] = {}

    def __call__(self, model: str, dtype: str = "float32", device: str = "cpu"):
        from lpf.api.compare import Reference

        key = (model, dtype, device)
        if key not in self._loaded:
            self._loaded[key] = Reference(model, dtype=dtype, device=device, runs_dir=self.runs_dir)
        return self._loaded[key]


@pytest.fixture(scope="session")
def lpf_reference(tmp_path_factory) -> References:
    """`lpf_reference(model, dtype="float32", device="cpu")`: the reference model, loaded once per session."""
    return References(tmp_path_factory.getbasetemp() / "lpf-runs")


def _kept(run_dir: Path, keep: str, nodeid: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid.split("::", 1)[-1]).strip("_") or "test"
    dest, i = Path(keep) / name, 1
    while dest.exists():
        i += 1
        dest = Path(keep) / f"{name}-{i}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns(".lock", ".tmp-*"))
    return dest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, FindingsCheckFailed):
        run_dir = exc.findings.run_dir
        keep = item.config.getoption("lpf_keep")
        if keep:
            run_dir = _kept(run_dir, keep, item.nodeid)
        page = run_dir / "report.html"
        lines = [f"run directory: {run_dir}"] + ([f"report: {page}"] if page.is_file() else [])
        report.sections.append(("lpf", "\n".join(lines)))
        props = [("lpf_run_dir", str(run_dir))] + ([("lpf_report", str(page))] if page.is_file() else [])
        report.user_properties.extend(props)
        # pytest's JUnit writer reads the properties of the teardown report, which pytest builds later from
        # the item's own list: put them there too, or --junitxml never shows them
        item.user_properties.extend(props)
        item.config.stash[_FAILED].append((item.nodeid, run_dir))
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    failed = config.stash.get(_FAILED, [])
    if failed:
        terminalreporter.section("lpf")
        for nodeid, run_dir in failed:
            terminalreporter.write_line(f"{nodeid}: {run_dir} (report.html inside)")
