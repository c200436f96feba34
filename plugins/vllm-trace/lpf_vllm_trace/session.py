"""One process's recording: checks, then hooks, then a recorder; or one warning and nothing at all.

`Session.start(out_dir, inject)` never raises: every reason not to record becomes the status' `why`
and one warning in vLLM's log, and in that case no hook is installed. `warn_once` is the only path
to the log, so a run never shows the same problem twice.
"""

from __future__ import annotations

import atexit
import logging
import time

import lpf_vllm_trace


def _logger() -> logging.Logger:
    """vLLM's own logger for this plugin: its lines carry vLLM's format and go where vLLM's go."""
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.lpf_vllm_trace")
    except Exception:  # noqa: BLE001 - no vLLM logging: plain logging still reaches stderr
        return logging.getLogger("vllm.lpf_vllm_trace")


class Session:
    def __init__(self, recorder, drills, why: str | None, capture=None):
        self.recorder = recorder
        self.drills = drills
        self.why = why
        self.capture = capture  # capture.Capture when LPF_VLLM_CAPTURE names a spec (lpf locate)
        self._warned = False

    @classmethod
    def start(cls, out_dir: str, inject: str, capture_spec: str | None = None) -> "Session":
        from lpf_vllm_trace import compat
        from lpf_vllm_trace.drills import Drills
        from lpf_vllm_trace.recorder import Recorder

        recorder = Recorder(out_dir)
        version = _vllm_version()
        base = {
            "plugin": "lpf-vllm-trace",
            "plugin_version": lpf_vllm_trace.__version__,
            "vllm_version": version,
            "inject": inject or None,
            "started": time.time(),
        }
        drills, why = None, None
        try:
            drills = Drills.parse(inject)
        except ValueError as e:
            why = str(e)
        why = why or compat.problem(version) or recorder.open()
        session = cls(recorder, drills, why)
        if capture_spec and why is None:
            session.why = why = session.set_capture(capture_spec)
        if why is None:
            try:
                from lpf_vllm_trace.hooks import install

                install(session)
            except Exception as e:  # noqa: BLE001 - a plugin bug must cost the trace, never the engine
                session.why = why = f"installing the hooks failed ({type(e).__name__}: {e})"
        recorder.write_status({**base, "recording": why is None, "why": why})
        if why is not None:
            session.warn_once(why)
            return session
        recorder.start_flusher(session.warn_once)
        atexit.register(session.flush)
        return session

    def set_capture(self, spec_path: str | None) -> str | None:
        """A new capture from `spec_path` (None: none); returns why not when the spec is unreadable."""
        from lpf_vllm_trace import capture as cap

        if self.capture is not None:
            self.flush()
            self.capture.remove()  # its hooks would otherwise keep running, and keep its data alive
        self.capture = None
        cap._ACTIVE["capture"] = None
        if spec_path is None:
            return None
        try:
            self.capture = cap.Capture(cap.load_spec(spec_path))
        except (OSError, ValueError, KeyError) as e:
            return f"capture spec {spec_path} unreadable ({type(e).__name__}: {e})"
        return None

    def warn_once(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            _logger().warning("lpf-vllm-trace records no trace: %s", why)

    def stop(self, why: str) -> None:
        """Stop recording mid-run (a runner that does not look as expected, a plugin bug)."""
        if self.why is None:
            self.why = why
            self.recorder.failed = why
            self.recorder.write_status({"recording": False, "why": why})
            self.warn_once(why)

    @property
    def recording(self) -> bool:
        return self.why is None

    def status(self) -> dict:
        out = {
            **self.recorder.status_fields,
            "rows": self.recorder.counts["trace"],
            "recording": self.recording and self.recorder.failed is None,
            "why": self.why or self.recorder.failed,
        }
        if self.capture is not None:
            out["capture"] = {"installed": self.capture.installed, "why": self.capture.why}
        return out

    def flush(self) -> None:
        if self.why is None:
            failed = self.recorder.flush()
            if failed is not None:
                self.warn_once(failed)
            if self.capture is not None:
                try:
                    self.capture.write()
                except OSError as e:
                    self.capture.why = f"writing the capture failed ({e})"


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"
