"""What a child forked from a server that imported its modules once does to be the fresh process it
stands for (lpf's kept cell server, `lpf.experiments.cell_server`, and the vLLM zygote,
`lpf.adapters.vllm_zygote_server`).

Contract (standard library only: the vLLM zygote runs under vLLM's interpreter, without lpf on its
path, and loads this file by its path):
- `renew_process_state()`: the random state a fresh process draws from the OS at start, drawn again:
  numpy's global generator and torch's CPU generator where they are imported (Python's `random` is
  reseeded at fork by Python itself).
- `exit_code(e)`: the exit code the interpreter gives for an uncaught `SystemExit` (a text code is
  printed on stderr and gives 1).
- `finish_like_the_interpreter(code)`: exit as the interpreter would (non-daemon threads joined,
  atexit handlers run, streams flushed), then `os._exit(code)`. Never returns.
"""

import os
import sys


def renew_process_state() -> None:
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # a fresh process seeds numpy's global generator from the OS
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.seed()  # a fresh process's CPU generator starts from a seed of its own (torch draws one at import)


def exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # what the interpreter does with sys.exit("text")
    return 1


def finish_like_the_interpreter(code: int) -> None:
    import atexit
    import threading

    try:
        threading._shutdown()  # non-daemon threads are joined before exit, as at interpreter exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    os._exit(code)
