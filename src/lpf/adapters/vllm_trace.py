"""Reading what the lpf-vllm-trace plugin (`plugins/vllm-trace`, in vLLM's interpreter) wrote.

The plugin's directory holds `trace/part-<pid>-<n>.parquet` (lpf's trace columns, then vLLM-only
ones), `faults/part-<pid>-<n>.parquet` (drill ground truth) and `trace_status.json`, with vLLM's
request ids. An `lpf serve --trace-dir` directory reads the same way: its `serve.json` stands for the status (no
heartbeat: it writes what it holds whenever its engine goes idle) and its `part-<n>.parquet` parts are one
process's; it names requests as vLLM does (`cmpl-<X-Request-Id>-<i>`). Here:
- `PluginDir(path, pid=None)`: `status()` (None when there is none), `take(table)` (every part not
  taken before, of process `pid` only when given, concatenated, steps made unique across vLLM
  processes), `wait_for(t)` (until the plugin's heartbeat passes t: every row of a step before t is
  then on disk).
- `relabel(table, ids)`: request ids (the row's, resume_writer's, resume_publisher's) mapped to lpf's (`ids`: vLLM's -> lpf's); the trace keeps the
  original in `vllm_request_id`, and ids with no mapping are kept as they are, never dropped.
- `prefix_cache_info(status)`: the prefix-cache facts for the manifest's engine section, or None.
- `served_ids(vllm_ids, runs)`: vLLM's ids on an OpenAI server -> lpf's: vLLM names a completion
  `cmpl-<X-Request-Id>-<i>` and its runner adds `-<8 random chars>`; lpf sends its request id as
  X-Request-Id, `~retryN` on retries, or (the default) a UUID per attempt, recorded as the attempt's
  `sent_id` and mapped back through `sent_names(requests, runs)`. A retry's rows map to the request only
  when it is the attempt whose answer the run kept; the others keep `ID~retryN` (evidence of an
  attempt, not the answer).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lpf.adapters.client_behaviour import CANCELLED

_PART = re.compile(r"^part-(\d+)-(\d+)\.parquet$")
_SERVE_PART = re.compile(r"^part-(\d+)\.parquet$")  # `lpf serve --trace-dir`: one process, no pid in the name
_RANDOM_SUFFIX = re.compile(r"^(.*)-[0-9a-zA-Z]{8}$")
_SERVED = re.compile(r"^cmpl-(.*)-\d+$")
_RETRY = re.compile(r"^(.*)~retry(\d+)$")
_CANCELLED = re.compile(r"^(.*)~attempt0$")  # a cancelled first attempt (lpf.adapters.client_behaviour)


class PluginDir:
    def __init__(self, path: Path | str, pid: int | None = None):
        self.path = Path(path)
        self.pid = pid
        self.taken: dict[str, set[str]] = {"trace": set(), "faults": set()}
        self.step_offset: dict[int, int] = {}  # pid -> steps before it (a second process restarts at 0)
        self.next_step = 0

    def status(self) -> dict | None:
        try:
            return json.loads((self.path / "trace_status.json").read_text())
        except (OSError, ValueError):
            pass
        try:  # an `lpf serve --trace-dir` directory: what the server said about itself
            served = json.loads((self.path / "serve.json").read_text())
        except (OSError, ValueError):
            return None
        return {"server": "lpf serve", "inject": (served.get("options") or {}).get("inject") or ""}

    def take(self, table: str) -> pa.Table | None:
        d = self.path / table
        by_pid: dict[int, list[tuple[int, Path]]] = {}
        for p in d.glob("part-*.parquet") if d.is_dir() else ():
            m = _PART.match(p.name)
            pid, n = (int(m.group(1)), int(m.group(2))) if m else (0, None)
            if m is None and (served := _SERVE_PART.match(p.name)):
                n = int(served.group(1))
            if n is not None and p.name not in self.taken[table] and self.pid in (None, pid):
                by_pid.setdefault(pid, []).append((n, p))
        parts = []
        # processes in the order they started writing: a restarted server's steps follow the first's
        for pid in sorted(
            by_pid, key=lambda k: (k not in self.step_offset, min(p.stat().st_mtime for _, p in by_pid[k]))
        ):
            for _, p in sorted(by_pid[pid]):
                parts.append(self._unique_steps(pq.read_table(p), pid))
                self.taken[table].add(p.name)
        return pa.concat_tables(parts, promote_options="default") if parts else None

    def _unique_steps(self, t: pa.Table, pid: int) -> pa.Table:
        if pid not in self.step_offset:
            self.step_offset[pid] = self.next_step
        off = self.step_offset[pid]
        if t.num_rows and "step" in t.column_names:
            self.next_step = max(self.next_step, off + int(pc.max(t.column("step")).as_py()) + 1)
            if off:
                t = t.set_column(t.column_names.index("step"), "step", pc.add(t.column("step"), off))
        return t

    def wait_for(self, t: float, timeout: float = 10.0) -> bool:
        """Wait until the plugin's heartbeat reaches `t` (its flusher writes every half second)."""
        deadline = time.monotonic() + timeout
        while True:
            beat = (self.status() or {}).get("heartbeat") or 0
            if beat >= t:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def prefix_cache_info(status: dict) -> dict | None:
    """The engine's prefix-cache facts the analysis reads (`engine.cache.prefix_cache`), from the plugin's
    status when it read vLLM's align-mode Mamba prefix cache (its block is every KV-cache group's)."""
    if not status.get("provenance"):
        return None
    mbs = status.get("mamba_block_size")
    return {
        "prefix_cache": {"block_size": mbs, "mamba_block_size": mbs, "mamba_cache_mode": status.get("mamba_cache_mode")}
    }


# columns naming a request: the row's own, and the prefix cache's writer and publisher of a restored state
ID_COLUMNS = ("request_id", "resume_writer", "resume_publisher")


def relabel(table: pa.Table, ids: dict[str, str]) -> pa.Table:
    for name in ID_COLUMNS:
        if name in table.column_names:
            mapped = pa.array(
                [ids.get(r, r) if r is not None else None for r in table.column(name).to_pylist()], pa.string()
            )
            table = table.set_column(table.column_names.index(name), name, mapped)
    return table


def served_ids(vllm_ids, runs: dict[str, int], sent: dict[str, str] | None = None) -> dict[str, str]:
    """{vLLM id: lpf id} for the ids a server's runner knew; `runs`: lpf id -> index of the attempt
    whose answer the run kept; `sent`: X-Request-Id values that were not lpf's id (UUIDs, recorded per
    attempt) -> the lpf name of that attempt (`sent_names`). Ids that name none of the run's requests
    are left out."""
    out = {}
    sent = sent or {}
    for vid in set(vllm_ids):
        m = _RANDOM_SUFFIX.match(vid)
        for cand in ([m.group(1)] if m else []) + [vid]:
            served = _SERVED.match(cand)
            if not served:
                continue
            x = served.group(1)
            if x in sent:
                out[vid] = sent[x]
                break
            cancelled = _CANCELLED.match(x)
            if cancelled and cancelled.group(1) in runs:  # kept as an attempt of its own, never as the answer
                out[vid] = x
                break
            retry = _RETRY.match(x)
            base, attempt = (retry.group(1), int(retry.group(2))) if retry else (x, 0)
            if base in runs:
                out[vid] = base if runs[base] == attempt else x
                break
    return out


def sent_names(requests: list[dict], runs: dict[str, int]) -> dict[str, str]:
    """{id sent: the lpf name of that attempt} from the requests' attempt records (`sent_id`): the kept
    attempt is the request itself, another is `ID~retryN` (N counting the attempts `runs` counts:
    cancel records aside), and the attempts of a cancelled first send are `ID~attempt0`. lpf's own ids
    (`-E request_id_header=lpf`) are left out: `served_ids` reads those by name."""
    out = {}
    for r in requests:
        rid, attempts = r["request_id"], list(r.get("attempts") or [])
        cancelled = max(
            (i for i, a in enumerate(attempts) if str(a.get("error") or "").startswith(CANCELLED)), default=-1
        )
        k = 0
        for i, a in enumerate(attempts):
            is_cancel = i == cancelled
            sid = a.get("sent_id")
            if i <= cancelled:
                name = f"{rid}~attempt0"
            else:
                name = rid if k == runs.get(rid) else f"{rid}~retry{k}"
            if not is_cancel:
                k += 1
            if sid and sid != rid and not sid.startswith(rid + "~"):  # lpf's own names map by name
                out[sid] = name
    return out
