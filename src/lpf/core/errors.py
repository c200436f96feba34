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
