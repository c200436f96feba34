"""Verdict names in order of severity and the `--fail-on` levels built from them.

Request verdicts (`REQUEST_VERDICTS`) are what each request gets; a run's verdict is its worst
request's, or `systematic` when the run-level test (`run_test`) finds the engine's distribution
different from the reference's beyond its dtype's floor while no request is `corrupt`: a lie small
everywhere ranks above one request's divergence and below confident gibberish.

No imports: the command line reads these while it builds its options, before any heavy module loads.
"""

REQUEST_VERDICTS = ("clean", "noise", "divergent", "corrupt")  # in order of severity
VERDICTS = ("clean", "noise", "divergent", "systematic", "corrupt")  # run verdicts, in order of severity
SEVERITY = {v: i for i, v in enumerate(VERDICTS)}
FAIL_LEVELS = (*VERDICTS[1:], "never")


def at_or_above(verdict: str | None, level: str) -> bool:
    """Whether `verdict` is as bad as the `--fail-on` level or worse ('never' never fails; a verdict
    that is not a severity, such as 'error', is not)."""
    return level != "never" and verdict in SEVERITY and SEVERITY[verdict] >= SEVERITY[level]
