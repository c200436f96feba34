"""Shared fixtures: an isolated model cache, a CLI driver, and small prompt files; how the suite splits
over pytest-xdist workers.

`lpf_cli(*args)` runs the real `lpf` entry point in-process (argv, exit code, stdout, stderr), so
tests exercise the same parsing and error handling a user gets, without a process start each time.
`lpf_main(*args)` is the same for module-scoped fixtures, returned as `subprocess.run` returns a child
(a fresh `lpf` process costs ~6 s here before its first step); `lpf_subprocess(*args)` starts the
installed console script, for what needs a process of its own (signals, kills, crashes, its own env).

Parallel runs (`make test`: `-n 2 --dist loadgroup --no-loadscope-reorder`): every test belongs to a
group (`group_of`), so a work unit is never smaller than what its fixtures share. By default the group is
the test's module (module-scoped servers and runs are built once, on one worker); modules that share a
session fixture or a resource two workers must not hold at once share one group (`SHARED_GROUPS`);
groups are handed out longest first (`LONGEST_FIRST`), so the last one to finish is a short one.

No leaked processes: at the session's end (each xdist worker's), a child process still alive after a
grace period fails the run, named with the test it appeared during, and is killed; the session is the
subreaper of what its tests start, so an orphaned grandchild counts too.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# Modules (or single tests, "module::test") that must run on one worker, one after another: they read
# one session-scoped fixture (built once per worker: two workers would each build it), or each start a
# vLLM engine (two vLLM CPU engines at once take ~2x the memory of one on a machine shared with others).
SHARED_GROUPS = {
    "hybrid-audit": ["test_audit_hf", "test_bad_input", "test_edit_flags", "test_query", "test_run_schema"],
    # one local Ray per worker (the session's `ray_cluster`): its users run on one worker
    "ray": ["test_rescore_ray", "test_watch_ray"],
    "vllm": [
        "test_vllm",
        "test_vllm_trace",
        "test_vllm_zygote",
        "test_conformance::test_conformance_on_vllm_writes_the_matrix",
        "test_run_level::test_healthy_bf16_vllm_passes_the_default_gate",
        "test_shrink::test_the_vllm_minimum_reproduces_with_vllms_interpreter_alone",
        "test_shrink::test_a_vllm_crash_shrinks_to_one_prompt",
        "test_conformance_families::test_vllm_source_pairs_bailing_hybrid_with_its_two_names",
        "test_conformance_variants::test_a_structural_variant_audits_nemotron_h_without_its_moe_on_vllm",
        "test_vllm_prefix",
        "test_vllm_spec",
        "test_locate_vllm",
        "test_client_behaviour::test_cancel_then_resend_and_bursts_against_vllms_server",
        "test_bench_quick::test_vllm_bench_quick",
        "test_engine_ci",  # its vLLM runs, and the built-in runs its table and plugin tests share with them
        "test_watch_vllm",
        "test_reference_vllm::test_a_drilled_run_gets_the_transformers_verdicts_from_the_vllm_reference",
    ],
}
# The longest work units, handed out first so that neither worker is left with a long one at the end: the
# vLLM group (several engine starts of ~25 s each), then the slow modules by the figures in their
# docstrings and docs/reliability.md, then the not-slow modules' --durations (2026-12-02, setup + calls).
# (test_llamacpp .. test_transformers_serve: placed by their docstrings' figures, not yet measured in a
# full run.) An unlisted group goes after these, in collection order.
LONGEST_FIRST = [
    "vllm",
    "test_kill_resume",
    "test_kept_cells",  # ~8 min at load 6-15 (its branch's report), not yet measured in a full run
    "test_shrink",
    "test_engine_drills",
    "test_prefix_drills",
    "test_run_level",
    "test_llamacpp",
    "test_rl_causes",
    "test_locate_drills",
    "test_conformance_families",
    "test_transformers_serve",
    "test_report",
    "test_serve_stress",
    "test_watch_drills",  # ~6-7 min here (4 lpf serve starts, 3 lpf watch starts), by its own runs
    "hybrid-audit",
    "test_inspect",
    "test_analyze_stream",
    "test_sglang_adapter",
    "test_serve",
    "test_calibration_run",
]


def group_of(nodeid: str) -> str:
    """The work unit a test belongs to, from its node id alone (the xdist controller sees only ids)."""
    path, _, rest = nodeid.partition("::")
    module = Path(path).stem
    test = f"{module}::{rest.split('[', 1)[0]}"
    for group, members in SHARED_GROUPS.items():
        if module in members or test in members:
            return group
    return module


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with `group_of`'s groups. xdist's own loadgroup reads `xdist_group` marks into
    the node ids (`item._nodeid`), which pytest 9.2's structured node ids no longer let it do: every test
    silently became its own unit and module-scoped servers started on both workers (pytest-dev/pytest-xdist
    issue 1386, open; src/xdist/remote.py pytest_collection_modifyitems). The scope rule is the same."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


# Seconds spent per work unit and per xdist worker (setup + call + teardown), printed after the run: the
# suite's wall time is its busiest worker's, so a log shows whether a slow run was one long group or the split.
_GROUP_SECONDS: dict[str, float] = {}
_WORKER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    group = group_of(report.nodeid)
    _GROUP_SECONDS[group] = _GROUP_SECONDS.get(group, 0.0) + report.duration
    node = getattr(report, "node", None)  # under xdist the controller's report names the worker that ran it
    worker = node.gateway.id if node is not None else "main"
    _WORKER_SECONDS[worker] = _WORKER_SECONDS.get(worker, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _GROUP_SECONDS:
        return
    tr = terminalreporter
    tr.write_sep("=", "seconds per work unit (the 20 largest) and per worker")
    for group, seconds in sorted(_GROUP_SECONDS.items(), key=lambda kv: -kv[1])[:20]:
        tr.write_line(f"{seconds:8.1f}s  {group}")
    tr.write_line("  ".join(f"{w}: {s:.0f}s" for w, s in sorted(_WORKER_SECONDS.items())))
    # how busy the machine's cores were over the run: well under 100% means the workers waited (servers, sleeps,
    # subprocess start-ups), and another worker could use the idle share; near 100% means they cannot
    end, start = _cpu_jiffies(), _CPU_AT_START[0] if _CPU_AT_START else None
    if start and end and end[1] > start[1]:
        tr.write_line(f"machine CPU busy over the run: {100 * (end[0] - start[0]) / (end[1] - start[1]):.0f}%")


def pytest_collection_modifyitems(config, items):
    """Longest groups first (with --no-loadscope-reorder xdist hands units out in collection order)."""
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))  # stable within a rank


# -- no leaked processes: a child process a test started and left running fails the run ----------------------
# Long-lived helpers the interpreter or a library starts for the whole process, not a test's leftovers.
# (vLLM's zygote server is shared by the tests that start vLLM workers and exits after 60 s without one.)
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "compile_worker", "vllm_zygote_server")
_STARTED_BY: dict[int, str] = {}  # child pid -> the test during which it first appeared
LEAK_GRACE_S = 10.0  # children given this long to exit after the last test (a Ray shutdown, a SIGTERM in flight)


def _adopt_orphans() -> None:
    """Make this process the subreaper of what its tests start (Linux): a grandchild whose parent died (the
    scorer of an `lpf watch` a test SIGKILLed) is re-parented here rather than to init, so the session-end
    check sees it."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat's first line (Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


_CPU_AT_START: list = []


def pytest_configure(config):
    _adopt_orphans()
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        _CPU_AT_START.append(_cpu_jiffies())


def _children() -> list:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    try:
        return (yield)
    finally:
        for child in _children():
            _STARTED_BY.setdefault(child.pid, item.nodeid)


def _leftovers() -> list[tuple[int, str, str]]:
    """(pid, command line, test that started it) of the children still alive after the grace period."""
    import psutil

    kids = []
    for child in _children():
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if not any(h in cmd for h in _HELPERS):
            kids.append((child, cmd))
    _, alive = psutil.wait_procs([c for c, _ in kids], timeout=LEAK_GRACE_S)
    alive_pids = {c.pid for c in alive}
    out = []
    for child, cmd in kids:
        try:
            if child.pid in alive_pids and child.status() != psutil.STATUS_ZOMBIE:
                out.append((child.pid, cmd[:200], _STARTED_BY.get(child.pid, "(no test: a fixture or the session)")))
        except psutil.Error:
            pass
    return out


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when a child process a test started is still alive once every test and fixture is done
    (an orphaned `lpf.watch.scorer`, server or engine outlives the suite otherwise); the leftovers are killed.
    Under xdist the controller's children are its workers: each worker checks its own."""
    if session.config.pluginmanager.getplugin("dsession") is not None:
        return
    leaked = _leftovers()
    if not leaked:
        return
    import psutil

    lines = [f"  pid {pid} started during {test}: {cmd}" for pid, cmd, test in leaked]
    sys.stderr.write("\nleaked processes (still running after the session; killed now):\n" + "\n".join(lines) + "\n")
    for pid, _, _ in leaked:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray for the session (2 CPUs); its GCS address lets a child `lpf` join it. Its users share the
    `ray` group, so one worker starts it."""
    import logging

    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


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
def lpf_cli():
    def run(*args) -> CliResult:
        r = lpf_main(*args, width=None)
        return CliResult(r.returncode, r.stdout, r.stderr)

    return run


def pre_fix_chunk_without_the_advance(start, n, num_prompt_tokens, num_tokens, block, max_chunk):
    """The unaligned-chunk-hashed drill's pre-fix rule before it advanced inside a block wider than a
    step: below last_cache_position a budget under one block gets 0 tokens forever (a livelock)."""
    last = max(num_tokens - num_tokens % block - block, 0)
    return n // block * block if start + n < last else n


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


def lpf_main(*args, width: int | None = 200):
    """`lpf *args` in this process, returned as `subprocess.run` returns a child's: `returncode`,
    `stdout`, `stderr` (text); `width`: the consoles' for the call (None: as they are; `lpf_cli`). A test worker has imported torch, transformers and lpf once, so a call
    here skips what every fresh `lpf` process pays before its first step (~6 s here: imports, the
    tokenizer's and the model code's first use): a 2,000-request audit's fixed cost. For runs that
    need nothing of a process of their own; `lpf_subprocess` for signals, kills, time-outs, crashes,
    an environment or working directory of their own, or output a child of lpf writes to the fds."""
    import contextlib
    import io
    import subprocess

    from lpf import cli
    from lpf.cli import common

    # the width lpf_subprocess gives (COLUMNS=200): tables wide enough to read back. The consoles read
    # COLUMNS when lpf.cli is first imported, so theirs is set for the call and put back after it
    consoles = (common.out, common.err) if width else ()
    argv, widths = sys.argv, [c._width for c in consoles]
    sys.argv = ["lpf", *map(str, args)]
    for c in consoles:
        c.width = width
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as e:
                if isinstance(e.code, str):  # as the interpreter does with sys.exit("message")
                    err.write(e.code + "\n")
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        for c, width in zip(consoles, widths):
            c._width = width
    return subprocess.CompletedProcess(["lpf", *map(str, args)], code, out.getvalue(), err.getvalue())


def lpf_subprocess(*args, timeout: float = 600, **kw):
    """The installed `lpf` console script in a child process (signals, kills, time-outs, crashes, an
    environment of its own; `lpf_main` runs the rest in the test's process)."""
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
    proc = lpf_main(
        "audit",
        "--engine",
        "hf",
        "--model",
        "tiny:hybrid",
        "--workload",
        prompts_200,
        "--max-tokens",
        12,
        "--out",
        out,
        "--json",
    )
    return out, proc
