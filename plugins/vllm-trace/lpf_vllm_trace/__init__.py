"""lpf's vLLM plugin: the per-step trace from inside vLLM's V1 model runner, and the seed's drills.

Entry point `vllm.general_plugins` -> `register()`, which vLLM calls in every process it starts.
Contract:
- Off unless `LPF_VLLM_TRACE_DIR=DIR` is set: then `register()` returns at once and nothing is
  patched (the cost is this module's import: the standard library only).
- On, it checks the vLLM version (`compat.KNOWN_VLLM`) and that every hook it needs is where it
  expects it. If anything is off (unknown version, a hook moved, DIR not writable, an unknown
  `LPF_VLLM_INJECT`), it logs one warning, writes why to `DIR/trace_status.json` (when DIR can take
  it) and installs nothing: no trace rather than a wrong one. The engine runs either way.
- Recording, it writes `DIR/trace/part-<pid>-<n>.parquet` (`schema.TRACE`: lpf's trace columns, lpf's
  speculative-decoding ones (drafts and accepted counts per step and request), then vLLM-only ones)
  and, under a drill, `DIR/faults/part-<pid>-<n>.parquet` (`schema.FAULTS`), each part atomically (a
  `.tmp-` name, then a rename). `request_id` there is vLLM's own id for the request as the runner knows
  it; lpf maps it back to its own.
- `LPF_VLLM_INJECT=stale-state[,offset-wrap:BITS][,publish-before-write][,unaligned-chunk-hashed]` puts
  drills in (`drills.py`). With vLLM's align-mode prefix cache on, the prefix-cache columns are filled
  from its cache manager (`prefix_log.py`).
- `LPF_VLLM_CAPTURE=SPEC.json` (lpf locate) also captures the named requests' activations op by op
  (`capture.py`), written with the trace at each flush; `set_capture(SPEC.json | None)` does the same
  (or stops) from inside the process, for the next steps: lpf's offline worker, one capture per batch.
- `status()` and `flush()` are for a caller in the same process (lpf's offline worker): the status
  dict, and "write every buffered row now" (before it reports the requests those rows describe).
It never imports lpf: it runs in vLLM's interpreter.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

ENV_DIR = "LPF_VLLM_TRACE_DIR"
ENV_INJECT = "LPF_VLLM_INJECT"
ENV_CAPTURE = "LPF_VLLM_CAPTURE"

_session = None  # the recording session of this process, once register() has run with the plugin on


def register() -> None:
    """vLLM's plugin hook: arm the trace (and drills) when LPF_VLLM_TRACE_DIR is set; else nothing."""
    global _session
    out_dir = os.environ.get(ENV_DIR)
    if not out_dir or _session is not None:
        return
    from lpf_vllm_trace.session import Session

    _session = Session.start(out_dir, os.environ.get(ENV_INJECT, ""), os.environ.get(ENV_CAPTURE) or None)


def status() -> dict:
    """What this process's plugin is doing: {"recording": bool, "why": str | None, ...}."""
    if _session is None:
        return {"recording": False, "why": f"the plugin is off ({ENV_DIR} is not set)"}
    return _session.status()


def set_capture(spec_path: str | None) -> str | None:
    """Capture the requests `spec_path` names from the next step on (None: stop capturing); returns
    why not, when the plugin records nothing or the spec cannot be read."""
    if _session is None or not _session.recording:
        return status().get("why") or "the plugin is not recording"
    return _session.set_capture(spec_path)


def flush() -> None:
    """Write every buffered trace and fault row to its parts now."""
    if _session is not None:
        _session.flush()
