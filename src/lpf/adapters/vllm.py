"""`vllm` engine: offline `vllm.LLM` on token ids, run in vLLM's own interpreter as a child process.

vLLM lives in its own venv (`make vllm` builds `.venv-vllm`; `LPF_VLLM_PYTHON` points elsewhere), so
lpf never imports it. Each adapter instance starts one worker (`vllm_worker.py`) for its configuration:
an engine cannot be re-sized in place, and a sweep gets one process per cell. Requests go to the
worker's stdin and completions come back as JSON lines on a dedicated pipe while they finish; vLLM's
own output goes to a log file whose tail is quoted when the worker fails. If the worker dies, every
request it had not finished comes back with that error (never dropped).

Knobs (`VLLMOptions`, with their checks in `vllm_options`) keep vLLM's names and go to `vllm.LLM` as
given (dtype, seed, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
enable_chunked_prefill, enable_prefix_caching, enforce_eager, max_model_len,
num_gpu_blocks_override, tensor_parallel_size, logprobs_mode, speculative_config: JSON text, handed over as the object, with
vLLM's stats on so that `describe()["spec_decode"]` carries vLLM's draft and acceptance counts);
`cpu_kvcache_space` (whole GiB) sets
VLLM_CPU_KVCACHE_SPACE, the KV size on CPU; `batch_invariant` sets VLLM_BATCH_INVARIANT=1. Logprobs are vLLM's `raw_logprobs` where this vLLM has
`logprobs_mode`; `describe()` records the mode actually used (None when the vLLM has no such
switch), the vLLM version and every argument.

The step trace comes from the lpf-vllm-trace plugin (`plugins/vllm-trace`, installed by `make vllm`):
the worker runs with LPF_VLLM_TRACE_DIR set (`-E trace=false`: not; `-E trace_dir=DIR`: there instead
of a private temporary directory) and `inject` drills (stale-state, offset-wrap[:BITS]) in
LPF_VLLM_INJECT. `side_tables()` hands over the plugin's parts with lpf's request ids (the worker
says which vLLM id is whose), and `describe()["trace"]` names the source and, when the plugin
records nothing, its reason (an unknown vLLM version, a hook missing, a directory not writable);
`describe()` also carries what the trace features read: the SSM state's slot stride and the drills.
`capture` (set by `lpf locate`, never by hand) names a capture spec sent to the worker before the
batch (a kept worker included), which hands it to the plugin: one request's activations op by op
(`lpf.locate.vllm_replay`).

Inside `kept_workers()` a closed engine's worker is kept (one idle worker at a time) and handed to the
next engine started with the same interpreter, environment and model, which rebuilds vllm.LLM in it
(`configure`): a matrix of configurations (`lpf conformance`) pays vLLM's import once per model instead
of once per configuration. The plugin's directory goes with the worker; the parts the earlier engines
took are never handed over again. A worker that failed (a refused configuration, a failure mid-run)
or that ran drills (`inject`: the plugin's drill state is per process) is never reused.

On vLLM's CPU build a worker is forked from a vLLM imported once (`vllm_zygote`: a server per
interpreter and import-time environment, gone after a minute idle) instead of a fresh interpreter
that imports vLLM (~9 CPU s of each start here); the fork is what the fresh process would be, tested
token for token. LPF_VLLM_ZYGOTE=0, or a server that cannot come up, starts a process as before; a
CUDA build always does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from lpf.adapters.base import Completion, Engine
from lpf.adapters.vllm_options import VLLMOptions
from lpf.core.errors import LpfError
from lpf.core.workload import EngineRequest

WORKER = Path(__file__).with_name("vllm_worker.py")
REPO_VENV = Path(__file__).resolve().parents[3] / ".venv-vllm"
_KEPT: dict | None = None  # key -> an idle worker's handles, while kept_workers() is active


@contextmanager
def kept_workers():
    """Keep and reuse idle workers within the block; every kept worker is stopped on exit."""
    global _KEPT
    outer, _KEPT = _KEPT, {} if _KEPT is None else _KEPT
    try:
        yield
    finally:
        if outer is None:
            _close_kept()
            _KEPT = None


def _close_kept() -> None:
    """Stop every idle kept worker."""
    while _KEPT:
        holder = VLLMEngine.__new__(VLLMEngine)
        holder.proc, holder.results, holder.log, holder.tmp, _ = _KEPT.popitem()[1]
        holder.close()


def vllm_python() -> Path:
    """vLLM's interpreter: $LPF_VLLM_PYTHON, else the repository's .venv-vllm. Raises LpfError when missing."""
    env = os.environ.get("LPF_VLLM_PYTHON")
    path = Path(env).expanduser() if env else REPO_VENV / "bin" / "python"
    if not path.is_file():
        where = f"LPF_VLLM_PYTHON={env}" if env else str(path)
        raise LpfError(
            f"vLLM's Python ({where}) does not exist: run `make vllm` to build .venv-vllm, "
            f"or set LPF_VLLM_PYTHON to a Python that has vLLM"
        )
    return path


def _is_cpu_build(python: Path) -> bool:
    prefix = python.parent.parent
    return any(prefix.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


# how lpf runs vLLM (its worker, and the shrink reproducers that must run it the same way)
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: ~25 s start instead of ~60
    "TORCHDYNAMO_DISABLE": "1",  # logprobs trigger a torch.compile even with enforce_eager
}


class VLLMEngine(Engine):
    name = "vllm"
    Options = VLLMOptions
    supports_prompt_logprobs = True  # SamplingParams(prompt_logprobs=k) in the worker
    trace_source = "own"  # lpf-vllm-trace in the worker
    state_slots = True
    locate_replay = "lpf.locate.replays:vllm"
    discovers_architectures = True
    repro_script = True
    # settings every request of a batch carries over the run's (a self-reference's re-score: `reference_vllm_self`)
    request_sampling: dict | None = None

    @classmethod
    def check_model(cls, config: dict) -> None:
        python = vllm_python()
        arch = (config.get("architectures") or ["?"])[0]
        if arch == "JambaForCausalLM" and _is_cpu_build(python):
            raise LpfError(
                "vLLM's CPU build does not run Mamba1 models (Jamba); use a GraniteMoeHybrid or "
                "Llama model, or a GPU build of vLLM"
            )

    def __init__(self, model, sampling, options: VLLMOptions):
        super().__init__(model, sampling, options)
        from lpf.adapters.vllm_trace import PluginDir

        if options.inject and not options.trace:
            raise LpfError("--inject on the vllm engine works through the trace plugin: drop -E trace=false")
        self.python = vllm_python()
        self.vllm_ids: dict[str, str] = {}  # vLLM's id for a request -> ours
        self.trace_status: dict | None = None
        self.engine_args = self._engine_args()
        config = {"engine_args": self.engine_args, "sampling": sampling.to_dict()}
        # one model per process: vLLM sets process-wide state from the first model it builds (its
        # parallel groups: an MoE model after a dense one finds no expert-parallel group)
        self._key = (
            str(self.python),
            str(model.path),
            options.trace,
            options.trace_dir,
            options.cpu_kvcache_space,
            tuple(sorted(self._env(None).items())),
        )
        if not options.inject and _KEPT is not None and self._key in _KEPT and _KEPT[self._key][0].poll() is None:
            self._reuse(_KEPT.pop(self._key), config)
            return
        self.tmp = tempfile.TemporaryDirectory(prefix="lpf-vllm-")
        self.log_path = Path(self.tmp.name) / "vllm.log"
        self.plugin = PluginDir(options.trace_dir or Path(self.tmp.name) / "trace-out") if options.trace else None
        (Path(self.tmp.name) / "config.json").write_text(json.dumps(config))
        config = Path(self.tmp.name) / "config.json"
        read_fd, write_fd = os.pipe()
        self.log = open(self.log_path, "wb")
        env = self._env(self.plugin)
        try:
            self.proc = self._forked(config, env, write_fd) or subprocess.Popen(
                [str(self.python), str(WORKER), str(config), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env=env,
                text=True,
                start_new_session=True,
            )
        finally:
            os.close(write_fd)  # the worker holds the only write end: EOF here means it exited
        self.results = os.fdopen(read_fd, "r")
        if self.plugin is not None:
            self.plugin.pid = self.proc.pid  # the engine runs in the worker (no V1 multiprocessing): its parts only
        try:
            self.ready = self._wait_ready()
        except BaseException:  # a failed start or Ctrl-C while loading: no orphaned worker
            self.close(kill=True)
            raise

    def _forked(self, config: Path, env: dict, write_fd: int):
        """The worker forked from a vLLM imported once (`vllm_zygote`), on vLLM's CPU build (a CUDA
        vLLM is never forked: CUDA state does not survive a fork); None: start it as a process."""
        if not _is_cpu_build(self.python):
            return None
        from lpf.adapters import vllm_zygote

        return vllm_zygote.spawn(self.python, config, env, self.log, write_fd)

    def _reuse(self, kept: tuple, config: dict) -> None:
        """Take over a kept worker and rebuild vllm.LLM in it for `config`."""
        from lpf.adapters.vllm_trace import PluginDir

        self.proc, self.results, self.log, self.tmp, plugin = kept
        self.log_path = Path(self.tmp.name) / "vllm.log"
        self.plugin = None
        if plugin is not None:  # the same directory and process; what earlier engines took stays taken
            self.plugin = PluginDir(plugin.path, pid=self.proc.pid)
            self.plugin.taken = {t: set(names) for t, names in plugin.taken.items()}
            self.plugin.step_offset, self.plugin.next_step = dict(plugin.step_offset), plugin.next_step
        try:
            self.proc.stdin.write(json.dumps({"type": "configure", "config": config}) + "\n")
            self.proc.stdin.flush()
            self.ready = self._wait_ready()
        except BaseException:
            self.close(kill=True)
            raise

    def _engine_args(self) -> dict:
        o = self.options
        args = {
            "model": str(self.model.path),
            "dtype": o.dtype,
            "enforce_eager": o.enforce_eager,
            "seed": self.sampling.seed if o.seed is None else o.seed,
            "logprobs_mode": o.logprobs_mode,
            "max_logprobs": max(20, self.sampling.logprobs),
        }
        for name in (
            "gpu_memory_utilization",
            "max_num_seqs",
            "max_num_batched_tokens",
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "max_model_len",
            "kv_cache_dtype",
            "tensor_parallel_size",
        ):
            if getattr(o, name) is not None:
                args[name] = getattr(o, name)
        if o.speculative_config is not None:
            args["speculative_config"] = json.loads(o.speculative_config)
            args["disable_log_stats"] = False  # the worker reads vLLM's spec-decode counters (drafts, accepted)
        return args

    def _env(self, plugin) -> dict:
        """The worker's environment; `plugin` None: without the trace directory (the kept-worker key)."""
        venv = self.python.parent.parent
        cache = (
            venv / "lpf-cache" if (venv / "pyvenv.cfg").is_file() else Path(tempfile.gettempdir()) / "lpf-vllm-cache"
        )
        env = dict(os.environ)
        env.update(
            {
                **VLLM_ENV,
                "VLLM_CACHE_ROOT": str(cache),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                "VLLM_CPU_KVCACHE_SPACE": str(self.options.cpu_kvcache_space),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.pop("PYTHONPATH", None)  # lpf's paths must not shadow vLLM's packages
        env.pop("VLLM_BATCH_INVARIANT", None)  # this engine's knob, not the caller's environment
        if self.options.batch_invariant:
            env["VLLM_BATCH_INVARIANT"] = "1"
        for var in ("LPF_VLLM_TRACE_DIR", "LPF_VLLM_INJECT", "LPF_VLLM_CAPTURE"):  # this run's, not the caller's
            env.pop(var, None)
        if plugin is not None:
            env["LPF_VLLM_TRACE_DIR"] = str(plugin.path)
            if self.options.inject:
                env["LPF_VLLM_INJECT"] = self.options.inject
        return env

    def _wait_ready(self) -> dict:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.results, selectors.EVENT_READ)
        deadline = time.monotonic() + self.options.start_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                tail = self._log_tail()
                raise LpfError(
                    f"vLLM did not start within {self.options.start_timeout_s:g} s (raise -E start_timeout_s=...){tail}"
                )
            if not sel.select(timeout=min(left, 1.0)):
                continue
            line = self.results.readline()
            if not line:
                code, tail = self.proc.wait(), self._log_tail()
                raise LpfError(f"vLLM's worker exited with code {code} before it was ready{tail}")
            msg = json.loads(line)
            if msg["type"] == "ready":
                sel.close()
                self.trace_status = msg.get("trace")
                return msg
            if msg["type"] == "fatal":
                raise LpfError(f"vLLM could not start {self.model.spec}: {msg['error']}")

    def _log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        tail = " | ".join(line.strip() for line in text[-lines:] if line.strip())
        return f"; vLLM log: {tail}" if tail else ""

    def describe(self) -> dict:
        status = self.trace_status or {}
        from lpf.adapters.vllm_trace import prefix_cache_info

        info = prefix_cache_info(status)
        cache = {"cache": info} if info else {}
        return {
            "name": self.name,
            "version": self.ready.get("vllm_version"),
            "options": self.options.to_dict(),
            **cache,
            "engine_args": self.engine_args,
            "logprobs_mode": self.ready.get("logprobs_mode"),
            "python": str(self.python),
            "cpu_build": _is_cpu_build(self.python),
            "trace": self._trace_info(),
            # what the trace features read: the SSM state's slot stride and the drills in force
            "state_slot_stride": status.get("state_slot_stride"),
            "faults": [f for f in self.options.inject.split(",") if f],
            # vLLM's own counts when it speculates (drafts, draft tokens, accepted tokens, per draft position)
            **({"spec_decode": self.spec_decode} if getattr(self, "spec_decode", None) else {}),
        }

    def configuration(self) -> dict:
        from lpf.adapters.engine_config import from_vllm_config, kv_cache_scale

        ready = self.ready or {}
        out = from_vllm_config(ready.get("vllm_config"), None, "vLLM in-process vllm_config")
        scales = kv_cache_scale(ready.get("kv_scales"), _is_cpu_build(self.python))
        if scales is not None:
            out["kv_cache_scale"] = scales
        if ready.get("vllm_config") is not None:
            # vllm.LLM applies the model's generation-config defaults only to requests without SamplingParams
            gen = ready.get("sampling_defaults") or {}
            why = f"; under vllm serve the model's generation config would set {gen}" if gen else ""
            out["sampling_defaults"] = ({}, f"vllm.LLM with lpf's explicit SamplingParams: none applied{why}")
        return out

    def _add_spec_counts(self, batch: dict | None) -> None:
        """Add one batch's speculative-decoding counts (vLLM's metrics, read by the worker) to the run's."""
        if batch is None:
            return
        total = getattr(self, "spec_decode", None) or {}
        for key, value in batch.items():
            if key == "accepted_per_position":
                old = total.get(key) or []
                value = [v + (old[i] if i < len(old) else 0) for i, v in enumerate(value)]
            else:
                value = total.get(key, 0) + value
            total[key] = value
        self.spec_decode = total

    def _trace_info(self) -> dict:
        """Where the trace comes from and, when the plugin records none (or stopped), its reason; the
        rows themselves are counted where they land (RUN/trace)."""
        status = self.trace_status or {}
        why = "turned off (-E trace=false)" if self.plugin is None else status.get("why")
        return {"source": "vllm-plugin", "why": why, "plugin_version": status.get("plugin_version")}

    def side_tables(self) -> dict:
        if self.plugin is None:
            return {}
        from lpf.adapters.vllm_trace import relabel

        tables = {}
        for name in ("trace", "faults"):
            table = self.plugin.take(name)
            tables[name] = relabel(table, self.vllm_ids) if table is not None else None
        return tables

    def generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        finished = False
        try:
            yield from self._generate(requests)
            finished = True
        finally:
            if not finished:  # abandoned mid-batch (Ctrl-C, an error downstream): stop vLLM now
                self.close(kill=True)

    def _generate(self, requests: list[EngineRequest]) -> Iterator[Completion]:
        pending = {r.request_id: r for r in requests}
        failure = None
        try:
            # lpf locate's capture for this batch, or none (a kept worker may have captured for the last engine)
            self.proc.stdin.write(json.dumps({"type": "capture", "spec": self.options.capture}) + "\n")
            for r in requests:
                self.proc.stdin.write(
                    json.dumps(
                        {
                            "request_id": r.request_id,
                            "prompt_token_ids": list(r.prompt_token_ids),
                            "max_tokens": r.max_tokens,
                            "seed": r.seed,
                            **({"sampling": self.request_sampling} if self.request_sampling else {}),
                        }
                    )
                    + "\n"
                )
            self.proc.stdin.write(json.dumps({"type": "end"}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            failure = f"vLLM's worker stopped taking requests ({e})"
        while failure is None:
            line = self.results.readline()
            if not line:
                failure = f"vLLM's worker exited with code {self.proc.wait()} mid-run"
                break
            msg = json.loads(line)
            if msg["type"] == "completion" and msg["request_id"] in pending:
                del pending[msg["request_id"]]
                msg.pop("type")
                yield Completion(**msg)
            elif msg["type"] == "submitted":
                self.vllm_ids.update(msg["vllm_ids"])
            elif msg["type"] == "done":
                self.trace_status = msg.get("trace") or self.trace_status
                self._add_spec_counts(msg.get("spec_decode"))
                break
            elif msg["type"] == "fatal":
                failure = f"vLLM failed mid-run: {msg['error']}"
        if failure is not None:
            self._failed = True  # a worker that failed mid-run is never reused
            failure += self._log_tail()
            for rid in pending:
                yield Completion.failed(rid, failure)
        elif pending:  # the worker said done but skipped some: still never dropped
            for rid in pending:
                yield Completion.failed(rid, "vLLM's worker finished the batch without this request")

    def _keep(self) -> bool:
        """Hand this engine's live worker to kept_workers() (idle, for the next engine of its kind)."""
        proc, key = getattr(self, "proc", None), getattr(self, "_key", None)
        if (
            _KEPT is None
            or key is None
            or proc is None
            or proc.poll() is not None
            or self.options.inject
            or getattr(self, "_failed", False)
        ):
            return False
        _close_kept()  # at most one idle worker: the next cells are of this model
        _KEPT[key] = (proc, self.results, self.log, self.tmp, self.plugin)
        self.proc = self.results = self.log = self.tmp = None
        return True

    def close(self, kill: bool = False) -> None:
        proc = getattr(self, "proc", None)
        if not kill and getattr(self, "ready", None) and self._keep():
            return
        if proc is not None and proc.poll() is None:
            try:
                if kill:
                    raise subprocess.TimeoutExpired(proc.args, 0)
                proc.stdin.close()  # EOF: the worker exits on its own
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: anything it spawned goes too
                except ProcessLookupError:
                    pass
                proc.wait()
        for f in (getattr(self, "results", None), getattr(self, "log", None)):
            if f is not None and not f.closed:
                f.close()
        if getattr(self, "tmp", None) is not None:
            self.tmp.cleanup()
            self.tmp = None
