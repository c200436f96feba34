"""One cell of an experiment: an `AuditSpec` audited in its own process, and the rules every
experiment's rerun relies on.

Contract:
- `run_cell(spec, log, name)` audits `spec` into `spec.run.out` as `lpf audit --spec -` in a child
  process (the spec on its stdin; engines such as vLLM cannot be re-sized in place, and one process
  per cell keeps them apart), its output appended to `log` under a header with the same audit as an
  `lpf audit` command line (for people). The resume rule: a directory the cell already started is
  finished, not redone (the child reopens a run whose spec.json is this spec's and runs what is left:
  generation, rescoring, analysis); a directory left empty by a run killed while being created is
  removed and started again; one that holds files but no manifest is refused (`LpfError`: move it
  away). A cell that fails says so in one `LpfError` line naming the cell and its log. Cells run with
  `--fail-on never`, so exit 1 is a crash, never findings.
  Inside `kept_cells.kept_cells()` a cell whose engine it serves (`kept_cells.serves`: builtin, hf) is
  a fork of the experiment's kept worker instead of a fresh process (the same audit, log and exit
  codes, without the ~4 s of imports); a kept worker that dies with the cell in flight is replaced and
  the cell tried once more (the resume rule finishes it), a second death fails the cell in one line.
  `LPF_CELLS_FRESH_PROCESS=1` runs every cell in a fresh process.
- `cell_complete(run_dir)`: the run is complete, analysed and fully scored (a rerun skips it).
- `read_out_doc(out, name)`: the document an earlier run of an experiment left in its --out
  directory, or None; an --out that is a file, or a document that is not JSON, is an `LpfError`
  (the sweep's, shrink's and conformance's resume rule).
The child runs the tool's own entry point (`python -m lpf`, started fresh, or run by the fork as
`__main__`), never imported here: nothing here knows the command line beyond `lpf audit --spec`.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from lpf.core.errors import LpfError
from lpf.experiments import kept_cells
from lpf.pipeline.spec import AuditSpec, audit_command


def die_with_parent() -> None:
    """The kernel kills this process when its parent dies: a fresh cell (before exec), the kept worker
    and each cell it forks (a SIGKILLed sweep must not leave a cell's audit writing into the run a
    rerun resumes). Linux only; elsewhere a no-op (the run directory's lock still refuses a second
    writer)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _error_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:")]
    return (errs or lines or ["(no output)"])[-1]


def cell_complete(run_dir: Path) -> bool:
    f = run_dir / "findings.json"
    if not f.is_file():
        return False
    try:
        findings = json.loads(f.read_text())
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return manifest.get("status") == "complete" and findings.get("run_complete") and not findings.get("unscored")


def _prepare(run_dir: Path) -> bool:
    """The resume rule's start: whether the cell finishes a run it already started."""
    if run_dir.exists() and not (run_dir / "manifest.json").is_file():
        if any(p.is_file() for p in run_dir.rglob("*")):
            raise LpfError(f"{run_dir} holds files but no manifest.json: move it away to rerun this cell")
        shutil.rmtree(run_dir)  # only empty directories left by a run killed while being created
    return run_dir.exists()


def _run_fresh(spec: AuditSpec, log) -> int:
    cmd = [sys.executable, "-m", "lpf", "audit", "--spec", "-", "--fail-on", "never"]
    return subprocess.run(
        cmd,
        input=spec.model_dump_json().encode(),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=kept_cells.cell_env(),
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    ).returncode


def run_cell(spec: AuditSpec, log: Path, name: str) -> None:
    run_dir = Path(spec.run.out)
    pool = kept_cells.active() if kept_cells.serves(spec) is None else None
    for attempt in (1, 2):
        resuming = _prepare(run_dir)
        with open(log, "a") as f:
            f.write(
                f"$ lpf audit --spec - --fail-on never{'   (finishing the interrupted run)' if resuming else ''}\n"
                f"# the same audit: lpf audit {shlex.join(audit_command(spec))}\n"
            )
            f.flush()
            if pool is None:
                rc = _run_fresh(spec, f)
                break
        try:
            rc = pool.run(spec, log)  # the cell's process appends to the log itself
            break
        except kept_cells.WorkerDied as e:
            with open(log, "a") as f:
                f.write(f"# the kept worker died ({e}): a new one finishes this cell\n")
            if attempt == 2:
                raise LpfError(
                    f"cell {name}: the kept worker died twice ({e}); {kept_cells.FRESH_ENV}=1 runs each cell in "
                    f"its own process; log: {log}"
                ) from None
    if rc == 2:
        raise LpfError(f"cell {name}: {_error_line(log).removeprefix('error:').strip()} (log: {log})")
    if rc != 0:  # cells run with --fail-on never: 1 is a crash here, not findings
        raise LpfError(f"cell {name}: lpf audit failed with exit code {rc} ({_error_line(log)}); log: {log}")


def read_out_doc(out: Path, name: str) -> dict | None:
    """The document `name` an earlier run of the command left in its --out directory, or None when there
    is none. Refuses, in one line, an --out that is a file and a document that is not JSON."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise LpfError(f"{out} is a file, not a directory: choose another --out")
    path = out / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise LpfError(f"{path} is unreadable: move it away or choose another --out") from None
