"""A vLLM imported once that forks the `vllm` adapter's workers: their start-up without vLLM's import.

Run by vLLM's own interpreter (never imported by lpf; standard library and vLLM only, plus two files
loaded by path: the worker and `lpf/core/fresh_process.py`):
  PYTHON vllm_zygote_server.py NAME IDLE_S
It imports vLLM (what every worker otherwise pays: ~9 s of CPU on this 2-core machine, against ~3 s
for building `vllm.LLM` itself) and the worker (`vllm_worker.py`), then serves on the abstract unix
socket NAME. Each connection asks for one worker: one JSON line {"argv": [CONFIG_PATH], "env": {...},
"cwd": DIR} sent with three file descriptors (SCM_RIGHTS): the worker's stdin, its log (stdout and
stderr) and its results pipe. The server forks; the child makes itself a session leader, takes the
descriptors as 0, 1, 2 and 3, the environment and the directory, runs `vllm_worker.main()` with
argv [CONFIG_PATH, "3"] and exits with its code, as the interpreter would (`fresh_process`: random
state drawn again, threads joined, atexit handlers run). The server answers {"pid": PID} on the connection
and, once it has reaped that child, {"exit": CODE} (subprocess' convention: -N for signal N), then
closes it. A line {"stop": true} instead makes the server exit (its workers run on).
A forked worker is what a fresh `vllm_worker.py` process is but for what was fixed while vLLM was
imported: the client keys servers by the environment variables that can matter there
(`lpf.adapters.vllm_zygote`), and vLLM loads its plugins (lpf-vllm-trace reads its variables then)
when an engine is built, in the child. The server refuses to serve if the import left a thread
running that a fork does not stop (a fork keeps only the forking thread; `fork_safe`). It exits
after IDLE_S seconds with no worker alive and no request.
"""

import importlib.util
import json
import os
import selectors
import signal
import socket
import sys
import time

# This file sits beside lpf's own `vllm.py` adapter: the script's directory must not shadow vLLM.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

# what a forked child does to be a fresh process, shared with lpf's kept cell server (standard library only)
FRESH_PROCESS = os.path.join(os.path.dirname(_here), "core", "fresh_process.py")
MAX_REQUEST = 1 << 20  # one JSON line: the environment is the largest part


def load(path: str, name: str):
    """A module from its file (the worker's directory is off sys.path, on purpose, and lpf is not on it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def preload() -> None:
    """Everything a worker imports before it builds its engine."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.engine.arg_utils import EngineArgs  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    # lpf-vllm-trace is not imported here: vLLM loads it in each worker, from the files on disk then


def threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def fork_safe() -> bool:
    """Whether a fork leaves this process single-threaded: one throwaway fork runs the libraries'
    fork handlers (numpy's and OpenCV's OpenBLAS stop their thread pools before a fork and start them
    again when next used), and a thread still running after it has no handler: a forked worker would
    miss it."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return threads() == 1


def child(worker, fresh, request: dict, fds: list[int], closing: list) -> None:
    """In the forked child: become the worker the request describes; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for obj in closing:  # the server's sockets and pipes are not the worker's
            try:
                obj.close() if hasattr(obj, "close") else os.close(obj)
            except OSError:
                pass
        os.setsid()
        for target, fd in zip((0, 1, 2, 3), (fds[0], fds[1], fds[1], fds[2])):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 3:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        fresh.renew_process_state()
        sys.argv = [os.path.join(_here, "vllm_worker.py"), *request["argv"], "3"]
        code = worker.main()
    except SystemExit as e:
        code = fresh.exit_code(e)
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback on stderr, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        fresh.finish_like_the_interpreter(code if isinstance(code, int) else 1)


def send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.sendall((json.dumps(obj) + "\n").encode())
    except OSError:
        pass  # the client is gone: it learns nothing more from us


def serve(name: str, idle_s: float) -> int:
    worker = load(os.path.join(_here, "vllm_worker.py"), "lpf_vllm_worker")
    fresh = load(FRESH_PROCESS, "lpf_fresh_process")
    preload()
    if not fork_safe():
        print(
            f"lpf zygote: vLLM's import left {threads() - 1} thread(s) a fork would lose; not forking", file=sys.stderr
        )
        return 3
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
    except OSError:
        return 0  # another server holds the name: the clients use it
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    children: dict[int, socket.socket] = {}
    last = time.monotonic()
    print(f"lpf zygote: serving {name} (pid {os.getpid()})", flush=True)
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "wake":
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            elif key.data == "accept":
                conn, _ = listener.accept()
                last = time.monotonic()
                request, fds = receive(conn)
                if request is None:
                    conn.close()
                    continue
                if request.get("stop"):
                    return 0
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    child(worker, fresh, request, fds, [sel, listener, conn, wake_r, wake_w, *children.values()])
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                send(conn, {"pid": pid})
        while children:  # reap every worker that has exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
            last = time.monotonic()
        if not children and time.monotonic() - last > idle_s:
            return 0


def receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """One request line and the descriptors sent with it (none: a malformed request, dropped)."""
    data, fds = b"", []
    conn.settimeout(10)
    try:
        while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
            chunk, got, _, _ = socket.recv_fds(conn, 65536, 3)
            if not chunk:
                break
            data += chunk
            fds += got
    except OSError:
        pass
    conn.settimeout(None)
    try:
        request = json.loads(data)
    except ValueError:
        request = None
    if request is not None and not request.get("stop") and len(fds) != 3:
        request = None
    if request is None:
        for fd in fds:
            os.close(fd)
    return request, fds


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], float(sys.argv[2])))
