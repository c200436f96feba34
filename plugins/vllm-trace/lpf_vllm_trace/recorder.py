"""Buffered rows -> Parquet parts and the status file, every file written atomically.

`Recorder(out_dir)`: `open()` makes `trace/` and `faults/` (returns why not, as a sentence, when the
directory cannot take files); `add(table, columns)` buffers a chunk of columns ({name: list}, every
schema column), `add_rows(table, rows)` a list of row dicts; `flush()` writes what is buffered as one
part per table (`part-<pid>-<n>.parquet`: several vLLM processes may share a directory) and
then the status; `write_status(dict)` writes `trace_status.json`. A background thread flushes every
`interval` seconds so a server's rows reach disk without anyone asking. The process whose runner writes
the rows (`writes_steps()`, said by step_rows) refreshes the status' `heartbeat` (unix seconds: every
row buffered before it is on disk); another process of the server (vLLM's API process, which runs no
model) never moves it, since its beat says nothing about the runner's buffer. Another process's runner
facts (`RUNNER_FIELDS`) and heartbeat already in the status survive its rewrite. A failed write stops the
recording (one warning, the reason in the status) and never raises into the engine.
"""

from __future__ import annotations

import json
import os
import threading
import time
from itertools import chain
from pathlib import Path


# what a runner learns about its engine (step_rows.StepReader._init), kept when another process of the
# same server (vLLM's API process, which runs no model) rewrites the status
RUNNER_FIELDS = (
    "mamba_groups",
    "state_slot_stride",
    "kv_cache_blocks",
    "enable_prefix_caching",
    "mamba_cache_mode",
    "mamba_block_size",
    "cache_config_block_size",
    "kv_cache_group_block_sizes",
    "provenance",
)
# what only the process writing the step rows can say truly
STEP_WRITER_FIELDS = ("heartbeat", "rows", "fault_rows", "pid")


class Recorder:
    def __init__(self, out_dir: str, interval: float = 0.5):
        self.dir = Path(out_dir)
        self.interval = interval
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.buffers: dict[str, list[dict]] = {"trace": [], "faults": []}  # chunks of columns
        self.counts = {"trace": 0, "faults": 0}  # rows on disk
        self.parts = 0
        self.status_fields: dict = {}
        self.failed: str | None = None
        self.steps = False  # this process's runner writes the step rows: its flushes are the heartbeat
        self._thread: threading.Thread | None = None

    def open(self) -> str | None:
        try:
            for sub in ("trace", "faults"):
                (self.dir / sub).mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".tmp-probe-{self.pid}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            return f"directory {self.dir} not writable ({e.strerror or e})"
        return None

    def writes_steps(self) -> None:
        with self.lock:
            self.steps = True

    def add(self, table: str, columns: dict[str, list]) -> None:
        if self.failed is None:
            with self.lock:
                self.buffers[table].append(columns)

    def add_rows(self, table: str, rows: list[dict]) -> None:
        if rows:
            self.add(table, {name: [r[name] for r in rows] for name in rows[0]})

    def flush(self) -> str | None:
        """Write buffered rows; returns why recording stopped, when a write failed."""
        from lpf_vllm_trace.schema import faults_schema, trace_schema

        with self.lock:
            if self.failed is not None:
                return self.failed
            beat = time.time()
            try:
                for table, schema in (("trace", trace_schema), ("faults", faults_schema)):
                    chunks = self.buffers[table]
                    if chunks:
                        n = self._write_part(table, chunks, schema())
                        self.counts[table] += n
                        self.buffers[table] = []
                self._write_status_locked(heartbeat=beat)
            except OSError as e:
                self.failed = f"writing to {self.dir} failed ({e.strerror or e}): the trace stops there"
                self.buffers = {"trace": [], "faults": []}
                try:
                    self._write_status_locked(heartbeat=beat)
                except OSError:
                    pass
            return self.failed

    def _write_part(self, table: str, chunks: list[dict], schema) -> int:
        import pyarrow as pa
        import pyarrow.parquet as pq

        def column(c, name):  # a column the rows lack (lpf's nullable prefix-cache columns) is null
            return c[name] if name in c else [None] * len(next(iter(c.values()), []))

        data = pa.table(
            {f.name: pa.array(list(chain.from_iterable(column(c, f.name) for c in chunks)), f.type) for f in schema},
            schema=schema,
        )
        if not data.num_rows:
            return 0
        name = f"part-{self.pid}-{self.parts:06d}.parquet"
        self.parts += 1
        tmp = self.dir / table / f".tmp-{name}"
        pq.write_table(data, tmp)
        os.replace(tmp, self.dir / table / name)
        return data.num_rows

    def write_status(self, fields: dict) -> None:
        with self.lock:
            self.status_fields.update(fields)
            try:
                self._write_status_locked()
            except OSError:
                pass  # the status is best effort: the caller has already said why in the log

    def _write_status_locked(self, heartbeat: float | None = None) -> None:
        if heartbeat is not None and self.steps:
            self.status_fields["heartbeat"] = heartbeat
        doc = {**self.status_fields, "rows": self.counts["trace"], "fault_rows": self.counts["faults"], "pid": self.pid}
        if self.failed is not None:
            doc.update(recording=False, why=self.failed)
        path = self.dir / "trace_status.json"
        try:  # a server's API process shares the file with its engine process: keep what the runner said
            old = json.loads(path.read_text())
            doc = {**{k: v for k, v in old.items() if k in RUNNER_FIELDS}, **doc}
            if not self.steps:  # the runner's beat and counts, never this process's empty ones
                doc.update({k: old[k] for k in STEP_WRITER_FIELDS if k in old})
        except (OSError, ValueError, AttributeError, TypeError):
            pass
        tmp = self.dir / f".tmp-trace_status-{self.pid}.json"
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)

    def start_flusher(self, on_failure) -> None:
        def loop():
            while True:
                time.sleep(self.interval)
                was = self.failed
                why = self.flush()
                if why is not None:
                    if was is None:
                        on_failure(why)
                    return

        self._thread = threading.Thread(target=loop, name="lpf-vllm-trace-flush", daemon=True)
        self._thread.start()
