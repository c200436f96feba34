"""Verdict names in order of severity and the `--fail-on` levels built from them.

No imports: the command line reads these while it builds its options, before any heavy module loads.
"""

VERDICTS = ("clean", "noise", "divergent", "corrupt")  # in order of severity
SEVERITY = {v: i for i, v in enumerate(VERDICTS)}
FAIL_LEVELS = (*VERDICTS[1:], "never")


def at_or_above(verdict: str | None, level: str) -> bool:
    """Whether `verdict` is as bad as the `--fail-on` level or worse ('never' never fails; a verdict
    that is not a severity, such as 'error', is not)."""
    return level != "never" and verdict in SEVERITY and SEVERITY[verdict] >= SEVERITY[level]
