"""The analysis' steps, in order: the one list both executions (in memory and streamed) run.

Contract: `STEPS` names each step of `findings.analyze` (in memory) and of `stream.StreamedAnalysis`
(the streamed execution, `lpf analyze --stream`), in the order both run them, with what it reads and
how the streamed execution gets that in bounded memory (`how`):
  chunks    computed chunk by chunk as the tokens are scored (whole requests per chunk)
  first     from the first pass (the run's own |d|) or from no token at all (an expected floor)
  gathered  from the rows the step needs, kept as the chunks go by (in memory, or spilled with the
            logprob columns above `stream_memory.KEEP_TOKENS`) and read when the pass is over
  requests  from the per-request summary, the requests table and the trace (no token table)
  whole     reads its own tables whole (the prompt positions', the prompts' ids: never the output tokens)
  refused   the streamed execution refuses the run in one line (`lpf analyze --no-stream` reads it)
Each execution records the steps it ran, in order (`Ran`: a step is recorded where it runs, whether
or not it applies to the run: a greedy run's decision test runs and finds nothing to test), so a
test walks `STEPS` against both records (tests/test_analysis_steps.py): a step added to one
execution only fails it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    reads: str
    how: str  # how the streamed execution gets what the step reads (module docstring)


STEPS = (
    Step(
        "thresholds",
        "the run's |d| (its own noise floor), or the expected floor (an unknown engine dtype: the pair its |d| fits)",
        "first",
    ),
    Step("scoring", "every token: per-request reductions, greedy flips, top-1 agreement, metric columns", "chunks"),
    Step("verdicts", "the per-request reductions, the requests' answers (inconsistent ones)", "requests"),
    Step("answer_checks", "every token: self-contradicting answers, sure tokens moved past the floor", "chunks"),
    Step("run_test", "every k-th token in arrival order (at most run_test.MAX_TOKENS)", "gathered"),
    Step("localized", "the run-level test's tokens", "gathered"),
    Step("spec_decisions", "the trace's verify rows, and the token and reference rows at their drafts", "gathered"),
    Step(
        "penalty",
        "greedy: the requests a penalty fit samples (rows with a log-sum-exp), their token ids; the requests whose "
        "only flips it explains are lowered from divergent",
        "gathered",
    ),
    Step("metrics", "the logprob columns, a piece at a time", "chunks"),
    Step(
        "tempered", "the tokens departing from the raw logprob (all a request's count reads), their top-k", "gathered"
    ),
    Step("logprob_temperature", "the tokens whose logprob departs from the raw one, their reference top-k", "gathered"),
    Step("crossed_wires", "the tokens that missed the reference's top-1, the trace's steps", "chunks"),
    Step("run_verdict", "the run-level test's result", "requests"),
    Step("shape", "the per-request summary, requests, trace", "requests"),
    Step("hypotheses", "features of requests and trace, the signatures above; mechanisms per request", "requests"),
    Step("evidence", "the requests' answers and attempts", "requests"),
    Step("prefix_cache", "the trace, the engine's options and (with a prefix cache) every prompt's ids", "whole"),
    Step("prompt", "the prompt positions' tokens and reference", "whole"),
)
NAMES = tuple(s.name for s in STEPS)
BY_NAME = {s.name: s for s in STEPS}


class Ran(list):
    """The steps an execution ran, in order. `step(name)` records one (a name not in STEPS is a bug)."""

    def step(self, name: str) -> None:
        if name not in BY_NAME:
            raise KeyError(f"analysis step {name!r} is not in lpf.analysis.steps.STEPS")
        self.append(name)


def record(ran: Ran | None, *names: str) -> None:
    """Record `names` on `ran` (None: the caller keeps no record)."""
    for name in names:
        if ran is not None:
            ran.step(name)
        elif name not in BY_NAME:
            raise KeyError(f"analysis step {name!r} is not in lpf.analysis.steps.STEPS")
