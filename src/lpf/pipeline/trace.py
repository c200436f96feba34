"""The trace stage: a separately started vLLM server's trace joined to a run, and what a run's trace is.

`check_joinable(engine)` refuses (LpfError) a join for engines other than `openai`.
`join_trace(run, trace_dir)`: the lpf-vllm-trace plugin's directory of a server (`LPF_VLLM_TRACE_DIR`)
-> the rows of this run's requests, by request id, copied into `RUN/trace/` (and the drills' ground
truth into `RUN/faults/`), replacing what an earlier join copied. It waits (at most 10 s) until the
plugin's heartbeat is past the run's last answer, so the steps of the last requests are on disk.
A directory the plugin never wrote (none there, no status file) replaces nothing: rows an earlier
join copied stay, and the reason says so. The outcome goes to `manifest["trace"]`.
`trace_summary(run)`: findings' `trace` object: {"recorded", "source" (engine | vllm-plugin |
joined), "rows", "why"} (`why`: why there is none, or why it stopped part way).
`engine_info(run)`: the manifest's engine section as the trace features read it: a joined trace
adds what the plugin said about the server (its state slot stride, its drills); the drills in force
(the engine's or the plugin's) add the facts they make true of the engine (`drill_catalog.engine_facts`,
e.g. `state_offset_wrap_bits`), which is all analysis learns of them.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc

from lpf.adapters.client_behaviour import is_cancel_record
from lpf.adapters.vllm_trace import PluginDir, prefix_cache_info, relabel, sent_names, served_ids
from lpf.builtin.drill_catalog import engine_facts
from lpf.core.errors import LpfError
from lpf.run.store import RunDir


# what usually leaves a join empty while the plugin did record: the request ids lpf sent never reached vLLM
NO_ROWS_HINT = (
    "the server never saw the X-Request-Id lpf sent (a gateway or proxy between lpf and vLLM that drops it: "
    "LiteLLM forwards it with `forward_client_headers_to_llm_api: true`), or the trace is another server's"
)


def _joined(engine: str) -> bool:
    """Whether this engine's trace is a server's, joined after the run (`trace_source`: openai)."""
    from lpf.adapters import capability

    return capability(engine, "trace_source") == "joined"


def check_joinable(engine: str) -> None:
    """A server's trace joins a run of an engine whose trace is joined; the others record their own or none."""
    if not _joined(engine):
        from lpf.adapters import capability, engine_names

        joiners = " or ".join(f"--engine {e}" for e in engine_names() if _joined(e))
        own = capability(engine, "trace_source") == "own"
        raise LpfError(
            f"--trace-dir joins the trace of a vLLM server audited with {joiners}; the {engine} "
            f"engine {'records its own' if own else 'has none to join'}"
        )


def join_trace(run: RunDir, trace_dir: Path | str) -> dict:
    m = run.manifest
    check_joinable(m["engine"].get("name", "?"))
    plugin = PluginDir(trace_dir)
    info = {"source": "joined", "dir": str(plugin.path), "recorded": False, "rows": 0, "why": None}
    requests = run.read("requests", ["request_id", "attempts", "t_finish"])
    status = plugin.status()
    if not plugin.path.is_dir() or status is None:
        info["why"] = (
            f"{plugin.path} is not a directory: was the server started with LPF_VLLM_TRACE_DIR={plugin.path} "
            f"and lpf-vllm-trace installed? (a directory it cannot write is named in its log)"
            if not plugin.path.is_dir()
            else f"{plugin.path} has no trace_status.json: lpf-vllm-trace did not run there (not installed "
            f"in the server's Python, or LPF_VLLM_TRACE_DIR not set for it)"
        )
        earlier = m.get("trace") or {}
        if run.has("trace") and earlier.get("source") == "joined":
            rows = run.read("trace", ["step"]).num_rows
            info.update({k: v for k, v in earlier.items() if k != "why"}, rows=rows, recorded=True)
            info["why"] += f"; the {rows} rows joined earlier from {earlier.get('dir')} are kept"
    else:
        last = pc.max(requests.column("t_finish")).as_py() if requests.num_rows else None
        late = last is not None and status.get("recording") and not plugin.wait_for(last)
        status = plugin.status() or status  # as of the last flush
        info.update(
            plugin_version=status.get("plugin_version"),
            vllm_version=status.get("vllm_version"),
            state_slot_stride=status.get("state_slot_stride"),
            faults=_drills(status),
            cache=prefix_cache_info(status),
        )
        info["why"] = status.get("why") or (
            "the plugin's heartbeat never passed the run's last answer (server stopped?): the last steps may be missing"
            if late
            else None
        )
        # the attempt whose answer the run kept, counted as the server named them: a cancelled first
        # attempt (`ID~attempt0`, client_behaviour) is not one of the numbered retries
        kept = {
            r["request_id"]: max(0, len([a for a in r["attempts"] or [] if not is_cancel_record(a)]) - 1)
            for r in requests.to_pylist()
        }
        trace, faults = plugin.take("trace"), plugin.take("faults")
        sent = sent_names(requests.to_pylist(), kept)  # the UUIDs sent as X-Request-Id, per attempt
        ids = served_ids(trace.column("request_id").to_pylist(), kept, sent) if trace is not None else {}
        for name in ("trace", "faults"):
            for p in run.parts(name):  # an earlier join's copy: replaced, never doubled
                p.unlink()
        for name, table in (("trace", trace), ("faults", faults)):
            if table is None:
                continue
            table = relabel(table, ids)
            table = table.filter(pc.is_in(table.column("request_id"), value_set=_run_ids(kept, ids)))
            if table.num_rows:
                run.append(name, table)
                if name == "trace":
                    info["rows"] = table.num_rows
        info["recorded"] = info["rows"] > 0
        if not info["recorded"] and info["why"] is None:
            info["why"] = (
                f"{plugin.path} has no trace parts: the server ran no step with the plugin on"
                if trace is None
                else f"none of the {trace.num_rows} rows in {plugin.path} belong to this run's requests: "
                + NO_ROWS_HINT
            )
    m["trace"] = info
    run.save_manifest()
    return info


def _run_ids(kept: dict[str, int], ids: dict[str, str]):
    import pyarrow as pa

    return pa.array(sorted(set(kept) | set(ids.values())), pa.string())


def _drills(status: dict) -> list[str]:
    return [d for d in (status.get("inject") or "").split(",") if d]


def trace_summary(run: RunDir) -> dict:
    m = run.manifest
    engine = m.get("engine") or {}
    info = m.get("trace") or engine.get("trace")
    rows = run.read("trace", ["step"]).num_rows if run.has("trace") else 0
    if info:
        why = info.get("why") or (None if rows else f"{info.get('source')} recorded no rows")
        return {"recorded": rows > 0, "source": info.get("source"), "rows": rows, "why": why}
    name = engine.get("name", "?")
    why = (
        None
        if rows
        else (
            "a server's trace is joined with --trace-dir DIR (vLLM with lpf-vllm-trace)"
            if _joined(name)
            else f"the {name} engine records no trace"
        )
    )
    return {"recorded": rows > 0, "source": "engine", "rows": rows, "why": why}


def engine_info(run: RunDir) -> dict:
    m = run.manifest
    info = dict(m.get("engine") or {})
    joined = m.get("trace") or {}
    for key in ("state_slot_stride", "faults", "cache"):
        if joined.get(key):
            info[key] = joined[key]
    # the drills in force, as facts about the engine (`drill_catalog.engine_facts`): analysis reads the facts
    drills = (info.get("cache") or {}).get("faults") or info.get("faults")
    if not drills:
        drills = [d for d in str((info.get("options") or {}).get("inject") or "").split(",") if d]
    for key, value in engine_facts(list(drills)).items():
        info.setdefault(key, value)
    return info
