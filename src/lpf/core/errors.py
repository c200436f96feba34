"""The one user-facing exception type.

Anything the user can fix (a bad flag, a malformed prompts file, a missing model) raises `LpfError`
with a message that fits on one line; the CLI prints it as `error: ...` and exits 2. Everything else
is a bug and keeps its traceback.
"""


class LpfError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits 2."""


def did_you_mean(name: str, choices) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def raised_at(e: BaseException) -> str:
    """'; raised at FILE:LINE in FUNC', the innermost frame of `e`: with the type, a crash's signature
    (lpf shrink). The vLLM worker has its own copy: it runs in vLLM's interpreter, without lpf."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    return f"; raised at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
