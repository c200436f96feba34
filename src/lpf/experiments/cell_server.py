"""The kept worker's server process: torch, transformers and lpf imported once, each cell a fork of it.

Run as `python -m lpf.experiments.cell_server REQ_FD REP_FD LEARN` by `lpf.experiments.kept_cells`
(never imported by an experiment: this is the one experiment-side module that imports torch).

Contract, over two pipes of one JSON object per line:
- On start it imports `PRELOAD` and says `{"ready": true, "pid": ...}`; it never runs a torch op or starts
  a thread of its own, so a fork of it is a process no different from a fresh one that has imported
  the same modules. (`import torch` itself starts the OpenMP team when OMP_NUM_THREADS > 1; GNU
  libgomp, torch's OpenMP here, builds a new team in a forked child, checked by the tests at 2 threads.)
- A request `{"spec": JSON, "log": PATH, "cwd": DIR}` is served by one `os.fork()`: the child (the
  cell) dies with the server (PR_SET_PDEATHSIG; the server dies with the experiment the same way),
  moves to `cwd`, appends its stdout and stderr to `log`, reads the spec on stdin and runs exactly
  what `python -m lpf audit --spec - --fail-on never` runs (`runpy` of the `lpf` package as
  `__main__`, the exit code Python would give: 0 ok, 2 an `LpfError`, 1 a traceback), then exits as
  the interpreter would (non-daemon threads joined, atexit handlers run, streams flushed). The server
  answers `{"pid": N}` when the cell starts and `{"rc": CODE}` when it ends (minus the signal that
  killed it, as `subprocess` says it).
- What a fresh process would have of its own is renewed in the cell: Python's `random` (reseeded at
  fork by Python itself), numpy's global generator and torch's CPU generator (reseeded from the OS, as
  a fresh process's are: lpf's runs seed what they draw, so their outputs do not depend on it); torch's
  thread settings are what `import torch` made of the same environment (OMP_NUM_THREADS), as in a
  fresh process, and a cell's `torch.set_num_threads` is its own. The environment is the server's: the
  client starts another server when the experiment's environment changes.
- With LEARN=1 a cell reports the modules it imported and the server imports them after the cell
  (import only, in the order the cell imported them; one that fails is skipped), so later cells
  start with the engine's and the report's modules loaded too.
- Before each fork it checks it runs no thread but those (nor any Python thread; the jemalloc background
  thread pyarrow starts is excepted too: jemalloc re-arms it after a fork); if an import started one it answers
  `{"unsafe": WHY}` and exits, and the client starts a server that learns nothing.
- `{"probe": true}` forks a child that answers what the cell would see (thread counts, seeds), for tests.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from lpf.core.fresh_process import exit_code, finish_like_the_interpreter, renew_process_state
from lpf.experiments.cells import die_with_parent

PRELOAD = ("torch", "transformers", "pyarrow.parquet", "lpf.pipeline", "lpf.adapters.builtin", "lpf.adapters.hf")
AUDIT_ARGV = ["lpf", "audit", "--spec", "-", "--fail-on", "never"]
FORK_SAFE_THREADS = {"jemalloc_bg_thd"}  # pyarrow's allocator: its own fork handlers restart it


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else set()


def foreign_threads(own: set[str]) -> list[str]:
    """The threads of this process a fork would not carry safely: any Python thread, and any native one
    not in `own` (the main thread and the OpenMP team `import torch` starts when OMP_NUM_THREADS > 1,
    which libgomp rebuilds in a forked child) nor named in FORK_SAFE_THREADS."""
    import threading

    names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    for tid in sorted(_tasks() - own):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name not in FORK_SAFE_THREADS:
            names.append(f"{name} (native)")
    return names


def _cell(req: dict, report_fd: int, learn: bool, parent: int) -> None:
    """In the forked child: the `lpf audit --spec -` process. Never returns."""
    code = 1
    try:
        die_with_parent()
        if os.getppid() != parent:  # the server died between the fork and the prctl
            os._exit(137)
        os.chdir(req["cwd"])
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        import tempfile

        with tempfile.TemporaryFile() as spec:  # a file, not a pipe: a spec of any size, nothing to pump
            spec.write(req["spec"].encode())
            spec.flush()
            os.lseek(spec.fileno(), 0, os.SEEK_SET)
            os.dup2(spec.fileno(), 0)
        renew_process_state()
        before = set(sys.modules)
        sys.argv = list(AUDIT_ARGV)
        import runpy

        try:
            runpy.run_module("lpf", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = exit_code(e)
        except BaseException:  # noqa: BLE001 - as the interpreter: the traceback on stderr, exit 1
            sys.excepthook(*sys.exc_info())
            code = 1
        if learn:
            new = [m for m, mod in list(sys.modules.items()) if m not in before and mod is not None]
            with os.fdopen(report_fd, "w") as f:
                f.write("\n".join(new))
            report_fd = -1
    finally:
        if report_fd >= 0:
            os.close(report_fd)
        finish_like_the_interpreter(code)


def _probe(report_fd: int, parent: int) -> None:
    die_with_parent()
    renew_process_state()
    import torch

    facts = {
        "pid": os.getpid(),
        "server": parent,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_initial_seed": torch.initial_seed(),
        "torch_first_draw": torch.rand(1).item(),
    }
    with os.fdopen(report_fd, "w") as f:
        f.write(json.dumps(facts))
    os._exit(0)


def _preload(names: list[str]) -> None:
    for name in names:
        if name in sys.modules or name == "__main__" or name.startswith("__mp_main__"):
            continue
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module only its import context can load: the cell imports it itself
            pass


def serve(req_fd: int, rep_fd: int, learn: bool) -> int:
    importlib.import_module("torch")
    # every cell's analysis reads scipy.stats (lpf.analysis.stats), whose bundled OpenBLAS starts its thread pool
    # at import (OMP_NUM_THREADS > 1): imported here, it is the worker's own, rebuilt in a forked child by
    # OpenBLAS's fork handlers as numpy's (imported with torch) is; learned after the first cell, it made the
    # worker unsafe and every sweep start a second one
    importlib.import_module("scipy.stats")
    own = _tasks()  # this thread, and the OpenMP team torch starts at import (OMP_NUM_THREADS > 1)
    for name in PRELOAD:
        importlib.import_module(name)
    requests = os.fdopen(req_fd, "r")
    replies = os.fdopen(rep_fd, "w", buffering=1)

    def say(**msg) -> None:
        replies.write(json.dumps(msg) + "\n")

    say(ready=True, pid=os.getpid())
    for line in requests:
        req = json.loads(line)
        threads = foreign_threads(own)
        if threads:
            say(unsafe=f"the kept worker runs {len(threads)} thread(s) of its own ({', '.join(sorted(threads))})")
            return 3
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            requests.close()
            replies.close()
            if req.get("probe"):
                _probe(w, os.getppid())
            _cell(req, w, learn, os.getppid())
        os.close(w)
        say(pid=pid)
        with os.fdopen(r) as f:
            report = f.read()  # read before waiting: a full pipe would block the cell's exit
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        if req.get("probe"):
            say(rc=rc, probe=json.loads(report) if report else None)
        else:
            say(rc=rc)
            if learn and report:
                _preload(report.splitlines())
    return 0


def main(argv: list[str]) -> int:
    die_with_parent()
    req_fd, rep_fd, learn = int(argv[0]), int(argv[1]), argv[2] == "1"
    return serve(req_fd, rep_fd, learn)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
