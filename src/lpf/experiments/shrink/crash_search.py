"""The shrink's plan for a crash: the fewest, shortest requests and the default-most knobs that still crash.

Contract: `CrashShrink(source, target_seq, judge, state, on_event).run() -> dict`, as `search.Shrink`
(same state, budget, resume and confirmation), for a judge whose signature is a crash
(`judge.Judge(crash=...)`: a candidate reproduces when any of its requests fails with the same
exception from the same innermost frame). An engine that raises fails the whole batch in flight, so
the request that carried the error in the source run is not the one that triggered it: no request
is kept on purpose ("the target" is only the name the shrink goes by).

The plan:
1. The original configuration (every try): if it no longer crashes, `not-reproduced`.
2. Requests: ddmin over all of them (arrival order kept; the empty set is never run: a crash needs
   a request).
3. Lengths, per request left, longest prompt first: max_tokens (1 first, then bisection), then the
   prompt (a prefix; bisection: a crash set off by a prompt's length, such as a prefill that crosses a
   block boundary, has a shortest trigger to find).
4. Knobs toward the engine's defaults (`Shrink.knobs`); if any moved, requests once more.
"""

from __future__ import annotations

from lpf.experiments.shrink.ddmin import ddmin
from lpf.experiments.shrink.judge import BudgetSpent
from lpf.experiments.shrink.search import NotReproduced, Shrink


class CrashShrink(Shrink):
    def run(self) -> dict:
        status = "done"
        try:
            original = self.source.original()
            if not self.test(original, "original", "the original configuration", every_try=True):
                raise NotReproduced
            self.adopt(original)
            self.crash_requests()
            moved = self.crash_lengths()
            moved = self.knobs() or moved
            if moved:
                self.crash_requests()
        except BudgetSpent:
            status = "budget-spent"
        except NotReproduced:
            status = "not-reproduced"
        return self.conclude(status)

    def crash_requests(self) -> None:
        start = self.cur
        if len(start.members) < 2:
            return

        def crashes(sub) -> bool:
            if not sub:
                return False  # no request, no crash: never worth a run
            return self.test(start.with_members(sub), "requests", f"ddmin: {len(sub)} of {len(start.members)} requests")

        ddmin(list(start.members), crashes, on_reduce=lambda sub: sub and self.adopt(start.with_members(sub)))

    def crash_lengths(self) -> bool:
        moved = False
        for m in sorted(self.cur.members, key=lambda m: -m.prompt_len):
            moved = self.smallest(m.seq, "max_tokens", lowest_first=True) or moved
            moved = self.smallest(m.seq, "prompt_len", lowest_first=False) or moved
        return moved
