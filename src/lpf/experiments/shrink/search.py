"""The shrink's plan: from a run's lying request to the smallest configuration that still tells the same lie.

Contract: `Shrink(source, target_seq, judge, state, on_event).run() -> dict` (the shrink.json
document, also on disk). Every configuration goes through `test`, which looks it up in the state
first (a rerun after a kill replays the plan from the recorded outcomes and runs nothing twice),
then has the judge run it (k-of-n, charged against `--budget-runs`). The current configuration
only ever moves to one that reproduced (`adopt`), and `state.path` lists those moves.

The plan:
0. What the run knows first (`suspects`): for a speculative-decoding hypothesis, the target with the
   few requests its mechanism names (`narrow_suspects`: the last users of the slot its verify step read,
   the verify step that left its state wrong and who left the batch before it, the checkpoint's writer;
   a leaver cut to one token beside one of the others, so the batch is permuted from its second step);
   then the target with the requests its trace names (who held
   its state slot before it, who wrote or published the block it resumed from, who shared its
   first step), then that set under the knob moves that make what the top hypothesis names (a
   one-token first step on a reused slot: step budget 2 with 2 sequences, or 1 with 1; short chunks:
   a small step budget; a resume from a truncated state: an odd budget below a Mamba block). A hit
   here is the starting point.
1. Else a starting point, small before large: the target alone, then with the last 1, 2, 4, ...
   requests that arrived before it (an engine's state comes mostly from what ran just before),
   then with every earlier request and the later ones that ran beside it, then the original
   configuration itself with every try. If even that does not show the lie, the shrink ends
   `not-reproduced`: "did not reproduce in K tries", never a false minimum.
2. The cheap cuts, before any ddmin: the target's max_tokens (bisection) and prompt (a prefix: 1
   token first, then bisection), then every other request at 1 prompt token and max_tokens 1 at
   once. A few runs each, and they can take the timing out of the lie: an engine that queues
   every request at once (vLLM offline) gives the target its one token of budget only in the
   original's exact schedule, so no subset of the requests keeps that, while a one-token prompt
   is scheduled as one token whatever else runs.
3. Requests: ddmin (`ddmin.ddmin`) over the other requests, arrival order kept. If more than one
   other request is left and the top hypothesis' knob moves were tried on the suspects without a
   reproduction, those moves once more on the few (a move that needs one request's steps to
   itself, such as chunks ending inside a block, may not show among the suspects, where others
   share the steps), and ddmin again after one that reproduces. Then, with 3-5 others left, the
   target with each pair of them (ddmin's halves never mix neighbours from both halves).
4. Lengths of the others that ddmin kept: at their shortest at once again, else each one alone
   (1, then once halfway).
5. Knobs, one at a time, each off the engine's default (`Source.movable`): the default, else
   halfway to it (geometric for positive numbers).
6. If 4 or 5 moved, requests once more (shorter requests and default knobs can make more of them
   unnecessary).
A spent budget ends the search where it stands (`budget-spent`, the best configuration so far is
the minimum). When the engine was not shown deterministic, the minimum is then run until `--tries`
runs and the count of runs that showed the lie is reported (`confirmation`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations
from typing import Callable

from lpf.experiments.shrink.config import Config, Source
from lpf.experiments.shrink.ddmin import ddmin
from lpf.experiments.shrink.judge import BudgetSpent, Judge
from lpf.experiments.shrink.state import State
from lpf.experiments.shrink.suspects import leaver


PAIRS_UP_TO = 5  # others left by ddmin whose pairs are tried (at most 10 runs)


class NotReproduced(Exception):
    """Neither the original configuration nor any smaller one showed the target's lie."""


def midpoint(value, default):
    """A value halfway from `value` to `default` (geometric for positive numbers), or None."""
    if (
        isinstance(value, bool)
        or isinstance(default, bool)
        or not all(isinstance(x, (int, float)) for x in (value, default))
    ):
        return None
    mid = math.sqrt(value * default) if value > 0 and default > 0 else (value + default) / 2
    if isinstance(value, int) and isinstance(default, int):
        mid = int(round(mid))
    else:
        mid = float(f"{mid:.3g}")
    return None if mid in (value, default) else mid


class Shrink:
    def __init__(
        self,
        source: Source,
        target_seq: int,
        judge: Judge,
        state: State,
        on_event: Callable[[dict], None] = lambda e: None,
    ):
        self.source, self.t, self.judge, self.state, self.on_event = source, target_seq, judge, state, on_event
        self.cur: Config | None = None
        self.last: dict | None = None  # the candidate `test` judged last
        # the top hypothesis' moves were tried on the suspects and none reproduced: worth once more on
        # the few requests ddmin leaves (`named_on_the_minimum`), and only then
        self.moves_unseen_among_suspects = False

    # -- one configuration ---------------------------------------------------------------------------
    def test(self, config: Config, phase: str, step: str, every_try: bool = False) -> bool:
        cand = self.state.lookup(config.key())
        if cand is not None and cand["status"] in ("reproduces", "gone"):
            self.last = cand
            self._emit(cand, replayed=True)
            return cand["status"] == "reproduces"
        if cand is None:
            cand = self.state.add(
                config.key(),
                phase,
                step,
                self.source.to_json(config),
                list(self.source.size(config)),
                self.source.describe_size(config),
            )
        self.on_event({"type": "start", "candidate": cand})
        ok, _ = self.judge.judge(
            cand["id"],
            config,
            every_try,
            on_try=lambda t: (self.state.record_try(cand, t), self.on_event({"type": "try", "try": t})),
        )
        self.state.finish(cand, ok)
        self.state.set(deterministic=self.judge.deterministic)
        self.last = cand
        self._emit(cand)
        return ok

    def adopt(self, config: Config) -> None:
        self.cur = config
        if not self.state.doc["path"] or self.state.doc["path"][-1] != self.last["id"]:
            self.state.doc["path"].append(self.last["id"])
        self.state.set(best=self.last["id"])

    def _emit(self, cand: dict, replayed: bool = False) -> None:
        best = self.state.lookup(self.cur.key()) if self.cur is not None else None
        self.on_event(
            {
                "type": "done",
                "candidate": cand,
                "replayed": replayed,
                "runs_used": self.state.doc["runs_used"],
                "budget": self.state.doc["budget_runs"],
                "best": best,
            }
        )

    # -- the plan ------------------------------------------------------------------------------------
    def run(self) -> dict:
        status = "done"
        try:
            self.start()
            self.target_lengths()
            self.others_shortest()
            self.requests()
            if self.named_on_the_minimum():
                self.requests()
            self.pairs()
            moved = self.other_lengths()
            moved = self.knobs() or moved
            if moved:
                self.requests()
        except BudgetSpent:
            status = "budget-spent"
        except NotReproduced:
            status = "not-reproduced"
        return self.conclude(status)

    def conclude(self, status: str) -> dict:
        """Record the minimum reached (confirmed when the search finished) and the status: the shrink's
        document."""
        if self.cur is not None:
            self.state.set(
                minimal={
                    "candidate": self.state.lookup(self.cur.key())["id"],
                    "config": self.source.to_json(self.cur),
                    "size": list(self.source.size(self.cur)),
                    "description": self.source.describe_size(self.cur),
                }
            )
            if status == "done":
                self.confirm()
        self.state.set(status=status)
        return self.state.doc

    def start(self) -> None:
        original = self.source.original()
        target = original.member(self.t)
        before = [m for m in original.members if m.seq < self.t]
        tried, w = set(), 0
        if self.named(original, target, tried):
            return
        while True:
            config = original.with_members(before[len(before) - w :] + [target] if w else [target])
            if config.key() != original.key():
                tried.add(config.key())
                step = "the target alone" if not w else f"the target and the {w} request{'s' * (w != 1)} before it"
                if self.test(config, "requests", step):
                    self.adopt(config)
                    return
            if w >= len(before):
                break
            w = min(len(before), max(1, 2 * w))
        beside = set(self.source.beside(self.t))
        config = original.with_members([m for m in original.members if m.seq <= self.t or m.seq in beside])
        if beside and config.key() not in tried and config.key() != original.key():
            if self.test(
                config, "requests", f"every request before the target and the {len(beside)} that ran beside it"
            ):
                self.adopt(config)
                return
        if self.test(original, "original", "the original configuration", every_try=True):
            self.adopt(original)
            return
        raise NotReproduced

    def _target_with(self, original: Config, target, seqs, who: str, tried: set):
        """The target with the original's requests in `seqs`, run once: (config, its description, held)."""
        config = original.with_members([m for m in original.members if m.seq in seqs and m.seq != self.t] + [target])
        n = len(config.members) - 1
        what = f"the target and the {n} request{'s' * (n != 1)} {who}"
        tried.add(config.key())
        return config, what, self.test(config, "requests", what)

    def named(self, original: Config, target, tried: set) -> bool:
        """The requests the trace names (`Source.suspects`) with the target, at the original knobs,
        then at the values of the knob the top hypothesis names (`Source.named_knob`)."""
        narrow = self.source.narrow_suspects(self.t)
        if narrow:  # the few the top hypothesis' mechanism names, before the wider set
            config, what, held = self._target_with(original, target, narrow, "its mechanism names", tried)
            if held:
                self.adopt(config)
                return True
            if self.leavers(original, target, narrow, tried) or self.named_moves(config, "requests", what, tried):
                return True
        suspects = self.source.suspects(self.t)
        if not suspects:
            return False
        config, what, held = self._target_with(original, target, suspects, "its trace names", tried)
        if held:
            self.adopt(config)
            return True
        if self.named_moves(config, "requests", what, tried):
            return True
        self.moves_unseen_among_suspects = self.source.named_moves(config) is not None
        return False

    def leavers(self, original: Config, target, narrow: dict[int, str], tried: set) -> bool:
        """A count applied after the batch's permutation: the target, one request that ran beside it and
        one that left the batch before, cut to one output token (it leaves after its first step, so its
        row is refilled at once and the two others run permuted from then on), at the top hypothesis'
        first knob move (a batch that small); each leaver with each of the others, the first that
        reproduces adopted."""
        gone = [s for s, why in narrow.items() if leaver(why) and s != self.t]
        mates = [s for s, why in narrow.items() if not leaver(why) and s != self.t]
        named = self.source.named_moves(original)
        move = named[1][0] if named else {}
        for g in gone:
            for m in mates:
                config = original.with_members([replace(original.member(g), max_tokens=1), original.member(m), target])
                for name, value in move.items():
                    config = config.with_knob(name, value)
                if config.key() in tried or self.source.refused(config):
                    continue
                tried.add(config.key())
                what = f"the target, request {self.source.ids[m]} and request {self.source.ids[g]} cut to one token"
                if self.test(config, "requests", f"{what} (it leaves first: the batch permuted)"):
                    self.adopt(config)
                    return True
        return False

    def named_moves(self, config: Config, phase: str, what: str, tried: set | None = None) -> bool:
        """`config` at each knob move the top hypothesis names (`Source.named_moves`), in order; the
        first that reproduces is adopted."""
        named = self.source.named_moves(config)
        if named is None:
            return False
        makes, moves = named
        for move in moves:
            moved = config
            for name, value in move.items():
                moved = moved.with_knob(name, value)
            if self.source.refused(moved):  # as in knobs(): a refused configuration would stop the shrink
                continue
            if tried is not None:
                tried.add(moved.key())
            change = ", ".join(f"{k} {config.knob_dict.get(k, 'default')} -> {v}" for k, v in move.items())
            if self.test(moved, phase, f"{what}, {change} ({makes}: the top hypothesis)"):
                self.adopt(moved)
                return True
        return False

    def named_on_the_minimum(self) -> bool:
        """The top hypothesis' knob moves again, on the few requests ddmin left: a move that needs the
        target's own writer alone (every chunk of one request ending inside a block) may not show
        among the suspects, where other requests share the steps. Only when the moves were tried on
        the suspects and none reproduced (a shrink that found its start without them spends no runs)."""
        if len(self.cur.members) <= 2 or not self.moves_unseen_among_suspects:
            return False
        return self.named_moves(self.cur, "knobs", f"the {len(self.cur.members)} requests ddmin left")

    def requests(self) -> bool:
        start, target = self.cur, self.cur.member(self.t)
        others = [m for m in start.members if m.seq != self.t]
        if not others:
            return False
        ddmin(
            others,
            lambda sub: self.test(
                start.with_members(sub + [target]),
                "requests",
                f"ddmin: {len(sub) + 1} of {len(start.members)} requests",
            ),
            on_reduce=lambda sub: self.adopt(start.with_members(sub + [target])),
        )
        return len(self.cur.members) < len(start.members)

    def pairs(self) -> bool:
        """After ddmin, with 3 to PAIRS_UP_TO other requests left: the target with each pair of them
        (arrival order), the first that reproduces adopted. ddmin's halves keep neighbours together, so a
        lie that needs two requests from different halves (one that leaves the batch, one whose count the
        target reads) is missed; ddmin's result is 1-minimal, not minimal."""
        target = self.cur.member(self.t)
        others = [m for m in self.cur.members if m.seq != self.t]
        if not 3 <= len(others) <= PAIRS_UP_TO:
            return False
        start = len(self.cur.members)
        for a, b in combinations(others, 2):
            config = self.cur.with_members([a, b, target])
            if self.test(config, "requests", f"the target and 2 of the {len(others)} others ddmin left"):
                self.adopt(config)
                return True
        return len(self.cur.members) < start

    def target_lengths(self) -> bool:
        moved = self.smallest(self.t, "max_tokens", lowest_first=False)
        return self.smallest(self.t, "prompt_len", lowest_first=True) or moved

    def others_shortest(self) -> bool:
        """Every other request at 1 prompt token and max_tokens 1, in one candidate."""
        others = [m for m in self.cur.members if m.seq != self.t and (m.prompt_len > 1 or m.max_tokens > 1)]
        if not others:
            return False
        config = self.cur.with_members(
            [m if m.seq == self.t else replace(m, prompt_len=1, max_tokens=1) for m in self.cur.members]
        )
        if self.test(config, "lengths", "every other request at 1 prompt token and max_tokens 1"):
            self.adopt(config)
            return True
        return False

    def other_lengths(self) -> bool:
        """After ddmin: the others at their shortest at once again (fewer of them now), else each
        one's max_tokens and prompt alone (1, then once halfway)."""
        others = [m for m in self.cur.members if m.seq != self.t and (m.prompt_len > 1 or m.max_tokens > 1)]
        if not others or self.others_shortest():
            return bool(others)
        moved = False
        for m in others:
            for dim in ("max_tokens", "prompt_len"):
                moved = self.smallest(m.seq, dim, lowest_first=True, probes=2) or moved
        return moved

    def smallest(self, seq: int, dim: str, lowest_first: bool, probes: int | None = None) -> bool:
        """The smallest value of one request's `dim` that still reproduces (bisection: the current
        value does; `lowest_first` tries 1 before anything else; `probes` bounds the tries)."""
        start = getattr(self.cur.member(seq), dim)
        lo, hi, used = 1, start, 0
        words = {"max_tokens": "max_tokens", "prompt_len": "prompt tokens"}[dim]
        who = "the target's" if seq == self.t else f"request {self.source.ids[seq]}'s"

        def attempt(value: int) -> bool:
            config = self.cur.with_member(replace(self.cur.member(seq), **{dim: value}))
            if self.test(config, "lengths", f"{who} {words} {getattr(self.cur.member(seq), dim)} -> {value}"):
                self.adopt(config)
                return True
            return False

        if lowest_first and hi > 1:
            used += 1
            if attempt(1):
                return True
            lo = 2
        while lo < hi and (probes is None or used < probes):
            mid, used = (lo + hi) // 2, used + 1
            if attempt(mid):
                hi = mid
            else:
                lo = mid + 1
        return getattr(self.cur.member(seq), dim) < start

    def knobs(self) -> bool:
        moved = False
        for name in self.source.movable(self.cur):
            value, default = self.cur.knob_dict[name], self.source.defaults[name]
            config = self.cur.with_knob(name, default)
            if self.source.refused(config):  # e.g. a prefix drill with prefix caching off: never run
                continue
            if self.test(config, "knobs", f"{name} {value} -> {default} (the engine's default)"):
                self.adopt(config)
                moved = True
                continue
            mid = midpoint(value, default)
            if mid is not None and not self.source.refused(self.cur.with_knob(name, mid)):
                config = self.cur.with_knob(name, mid)
                if self.test(config, "knobs", f"{name} {value} -> {mid} (halfway to the default {default})"):
                    self.adopt(config)
                    moved = True
        return moved

    def confirm(self) -> None:
        """How often the minimum shows the lie, unless the engine proved deterministic."""
        cand = self.state.lookup(self.cur.key())
        if self.judge.deterministic or self.judge.tries < 2:
            why = (
                "two runs of one configuration were bit-identical: the engine is deterministic here"
                if self.judge.deterministic
                else "--tries 1: each configuration ran once"
            )
            self.state.set(
                confirmation={"runs": len(cand["tries"]), "lies": sum(t["lie"] for t in cand["tries"]), "note": why}
            )
            return
        try:
            self.judge.top_up(cand["id"], self.cur, len(cand["tries"]), on_try=lambda t: self.state.record_try(cand, t))
        except BudgetSpent:
            pass
        runs = cand["tries"]
        self.state.set(
            confirmation={
                "runs": len(runs),
                "lies": sum(t["lie"] for t in runs),
                "note": f"the minimum showed the lie in {sum(t['lie'] for t in runs)} of "
                f"{len(runs)} runs (the engine is not deterministic here)",
            }
        )
