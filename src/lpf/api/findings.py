"""`Findings`: a finished run's findings.json as typed Python objects, and the assertion a test makes on them.

`Findings.load(run_dir)` reads `RUN/findings.json` (what `lpf audit`, `lpf.audit` and `lpf.compare` write).
Fields: `verdict` (the run's), `counts` (request verdict -> count), `n_requests`, `errors`, `flagged`
(divergent and corrupt requests, worst first, each a `RequestVerdict` with its first divergence and its
mechanism), `mechanisms` (the ranked hypotheses, `Mechanism`), `run_test` (the run-level test's dict, None
without one), `rule` (the peer's rule's outcome when it was asked for, `RuleOutcome`), `run_dir`, `report`
(report.html, None when it could not be drawn), `coverage` (findings.json's `mechanisms`, where the analysis
writes one: which mechanism explains how many flagged requests) and `raw` (findings.json itself).
`requests()` reads every request's verdict from `RUN/summary.parquet`.

A flagged request's mechanism is its own when findings.json carries one (`flagged[i]["mechanism"]`:
{"feature", "sentence", "rank"}), else the run's top hypothesis (the same for every request).

`check(fail_on="divergent")` raises `FindingsCheckFailed` (an `AssertionError`) when the run's verdict or any
request's is at or above `fail_on` (`lpf audit --fail-on`'s levels), or when the peer's rule failed a request
(`fail_on_rule=True`, the default when the rule ran); its message is what a developer reads in a test log:
the verdict line, the worst requests with their first divergence (and their own mechanism where it is not the
top one), the top mechanism (and the coverage, when several share the flagged), the peer's rule's failures, the
run directory and report to open. No I/O but reading the run directory; no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lpf.analysis.levels import FAIL_LEVELS, at_or_above
from lpf.core.errors import LpfError

SHOWN = 5  # requests named in a failed check's message


@dataclass(frozen=True)
class Mechanism:
    """A candidate explanation of the flagged requests: the trace or metadata feature and its sentence."""

    feature: str | None  # None: no hypothesis explains the request (the sentence says so)
    sentence: str
    rank: int = 1

    def __str__(self) -> str:
        # no feature: the analysis's own words for a request no hypothesis explains ("unexplained: ...")
        return f"{self.feature}: {self.sentence}" if self.feature is not None else self.sentence


@dataclass(frozen=True)
class RuleVerdict:
    """The peer's rule on one request: where the first mismatch was and which membership failed."""

    request_id: str
    passed: bool
    position: int | None = None
    engine_token: int | None = None
    reference_token: int | None = None
    engine_in_reference_topk: bool | None = None
    reference_in_engine_topk: bool | None = None


@dataclass(frozen=True)
class RuleOutcome:
    """`rule="first-mismatch-topk"`: vLLM's check_logprobs_close on the same outputs."""

    rule: str
    n_requests: int
    n_failed: int
    n_mismatched: int
    requests: tuple[RuleVerdict, ...]

    @property
    def failed(self) -> tuple[RuleVerdict, ...]:
        return tuple(r for r in self.requests if not r.passed)

    @property
    def passed(self) -> bool:
        return self.n_failed == 0


@dataclass(frozen=True)
class RequestVerdict:
    request_id: str
    verdict: str
    first_divergence: int | None = None
    max_abs_logprob_diff: float | None = None
    seq: int | None = None
    mechanism: Mechanism | None = None


class FindingsCheckFailed(AssertionError):
    """`Findings.check` failed: the message is for a test log; `findings` holds the run (its `run_dir`)."""

    def __init__(self, message: str, findings: "Findings"):
        super().__init__(message)
        self.findings = findings


@dataclass(frozen=True)
class Findings:
    verdict: str
    counts: dict[str, int]
    n_requests: int
    errors: int
    flagged: tuple[RequestVerdict, ...]
    mechanisms: tuple[Mechanism, ...]
    run_test: dict | None
    rule: RuleOutcome | None
    run_dir: Path
    report: Path | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    # findings.json's `mechanisms` where the analysis writes one: {"covered": [{"feature", "sentence", "n"}],
    # "unexplained", "n_flagged"}: which mechanism explains how many flagged requests
    coverage: dict | None = None

    @classmethod
    def load(cls, run_dir: Path | str) -> "Findings":
        run_dir = Path(run_dir)
        path = run_dir / "findings.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise LpfError(f"{run_dir} has no findings.json: the run was not analysed") from None
        except (OSError, ValueError) as e:
            raise LpfError(f"{path}: unreadable findings ({e})") from None
        mechanisms = tuple(
            Mechanism(h.get("feature", "?"), h.get("sentence", ""), i + 1)
            for i, h in enumerate(raw.get("hypotheses") or [])
        )
        top = mechanisms[0] if mechanisms else None
        flagged = tuple(
            RequestVerdict(
                request_id=f["request_id"],
                verdict=f["verdict"],
                first_divergence=f.get("first_divergence"),
                max_abs_logprob_diff=f.get("max_abs_logprob_diff"),
                seq=f.get("seq"),
                mechanism=_own_mechanism(f.get("mechanism")) or top,
            )
            for f in raw.get("flagged") or []
        )
        report = run_dir / "report.html"
        return cls(
            verdict=raw.get("verdict", "unscored"),
            counts=dict(raw.get("counts") or {}),
            n_requests=int(raw.get("n_requests") or 0),
            errors=int(raw.get("errors") or 0),
            flagged=flagged,
            mechanisms=mechanisms,
            run_test=raw.get("run_test"),
            rule=_rule(raw.get("peer_rule")),
            run_dir=run_dir,
            report=report if report.is_file() else None,
            raw=raw,
            coverage=raw.get("mechanisms") if isinstance(raw.get("mechanisms"), dict) else None,
        )

    @property
    def top_mechanism(self) -> Mechanism | None:
        return self.mechanisms[0] if self.mechanisms else None

    def requests(self) -> list[RequestVerdict]:
        """Every request's verdict (summary.parquet), in arrival order."""
        import pyarrow.parquet as pq

        path = self.run_dir / "summary.parquet"
        if not path.is_file():
            raise LpfError(f"{self.run_dir} has no summary.parquet: the run was not analysed")
        rows = pq.read_table(
            path, columns=["request_id", "seq", "verdict", "first_divergence", "max_abs_logprob_diff"]
        ).to_pylist()
        mech = {f.request_id: f.mechanism for f in self.flagged}
        return [
            RequestVerdict(
                request_id=r["request_id"],
                verdict=r["verdict"],
                first_divergence=r["first_divergence"],
                max_abs_logprob_diff=r["max_abs_logprob_diff"],
                seq=r["seq"],
                mechanism=mech.get(r["request_id"]),
            )
            for r in sorted(rows, key=lambda r: r["seq"])
        ]

    def failing(self, fail_on: str = "divergent") -> bool:
        """Whether `check(fail_on)` would fail on lpf's verdicts (the peer's rule aside)."""
        _check_level(fail_on)
        return any(at_or_above(v, fail_on) for v in [self.verdict, *(v for v, c in self.counts.items() if c)])

    def check(self, fail_on: str = "divergent", fail_on_rule: bool | None = None) -> "Findings":
        """Raise `FindingsCheckFailed` when lpf's verdicts reach `fail_on` (or, with `fail_on_rule`, default
        True when the peer's rule ran, when that rule failed a request); return self otherwise."""
        __tracebackhide__ = True  # pytest shows the test's line and this message, not lpf's frames
        by_lpf = self.failing(fail_on)
        by_rule = self.rule is not None and not self.rule.passed and (fail_on_rule is None or fail_on_rule)
        if by_lpf or by_rule:
            raise FindingsCheckFailed(self.explain(fail_on), self)
        return self

    def explain(self, fail_on: str = "divergent") -> str:
        """The message `check` fails with (also printable on its own)."""
        lines = [self.verdict_line()]
        worst = [f for f in self.flagged if at_or_above(f.verdict, fail_on)] or list(self.flagged)
        if worst:
            lines.append(f"worst requests ({min(len(worst), SHOWN)} of {len(self.flagged)} flagged):")
            for f in worst[:SHOWN]:
                where = (
                    "no divergent token"
                    if f.first_divergence is None
                    else f"first divergence at token {f.first_divergence}"
                )
                diff = "" if f.max_abs_logprob_diff is None else f", max |logprob diff| {f.max_abs_logprob_diff:.3g}"
                # a request's own mechanism (findings.json's per-request one) when it is not the top one
                own = f"; {_mechanism_words(f.mechanism)}" if f.mechanism and f.mechanism != self.top_mechanism else ""
                lines.append(f"  {f.request_id}: {f.verdict}, {where}{diff}{own}")
        if self.run_test and self.verdict == "systematic":
            lines.append(f"run-level test: {_run_test_line(self.run_test)}")
        top = self.top_mechanism
        lines.append(
            f"top mechanism: {top}"
            if top
            else "top mechanism: none ranked (no trace or metadata feature separates the flagged requests)"
        )
        if self.coverage and len(self.coverage.get("covered") or []) > 1:  # several mechanisms share the flagged
            parts = [f"{c.get('feature')} {c.get('n')}" for c in self.coverage["covered"]]
            unexplained = self.coverage.get("unexplained")
            lines.append(
                f"mechanisms of the {self.coverage.get('n_flagged', '?')} flagged: {', '.join(parts)}"
                + (f", {unexplained} unexplained" if unexplained else "")
            )
        if self.rule is not None:
            r = self.rule
            lines.append(
                f"peer rule {r.rule}: {r.n_failed} of {r.n_requests} requests fail "
                f"({r.n_mismatched} with a token mismatch)"
            )
            for v in r.failed[:SHOWN]:
                lines.append(
                    f"  {v.request_id}: token {v.position}: engine {v.engine_token} "
                    f"{'in' if v.engine_in_reference_topk else 'not in'} the reference's top-k, reference "
                    f"{v.reference_token} "
                    + (
                        "(engine gave no top-k)"
                        if v.reference_in_engine_topk is None
                        else f"{'in' if v.reference_in_engine_topk else 'not in'} the engine's top-k"
                    )
                )
        lines.append(f"run directory: {self.run_dir}")
        if self.report is not None:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)

    def verdict_line(self) -> str:
        shown = ", ".join(f"{c} {v}" for v, c in self.counts.items() if c)
        errors = f", {self.errors} error" if self.errors else ""
        return f"lpf verdict: {self.verdict} ({self.n_requests} requests: {shown or 'none scored'}{errors})"


def _own_mechanism(m: dict | None) -> Mechanism | None:
    if not m:
        return None
    return Mechanism(m.get("feature"), m.get("sentence", ""), int(m.get("rank") or 1))


def _mechanism_words(m: Mechanism) -> str:
    """A request's own mechanism as the analysis spells it: its feature, or the unexplained sentence."""
    return f"mechanism: {m.feature}" if m.feature is not None else m.sentence


def _rule(raw: dict | None) -> RuleOutcome | None:
    if not raw:
        return None
    fields = RuleVerdict.__dataclass_fields__
    return RuleOutcome(
        rule=raw["rule"],
        n_requests=raw["n_requests"],
        n_failed=raw["n_failed"],
        n_mismatched=raw["n_mismatched"],
        requests=tuple(RuleVerdict(**{k: v for k, v in r.items() if k in fields}) for r in raw.get("requests") or []),
    )


def _run_test_line(t: dict) -> str:
    """The run-level test in one line: its result, p-value and how far the observed floor is above the expected."""
    parts = [str(t.get("result", "?"))]
    if t.get("log10_p_value") is not None:
        parts.append(f"log10 p {t['log10_p_value']:.1f}")
    if t.get("observed_floor") is not None and t.get("expected_floor") is not None:
        parts.append(
            f"observed floor {t['observed_floor']:.3g} vs expected {t['expected_floor']:.3g} ({t.get('floor_pair', '?')})"
        )
    return ", ".join(parts)


def _check_level(fail_on: str) -> None:
    if fail_on not in FAIL_LEVELS:
        raise LpfError(f"fail_on={fail_on!r}: choose from {', '.join(FAIL_LEVELS)}")
