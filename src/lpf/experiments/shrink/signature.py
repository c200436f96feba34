"""What "the same lie" means while shrinking: the target request's signature, and whether a run shows it.

Contract (pure: findings dicts and Arrow tables in, plain data out):
- A `Signature` is three things about the target request: its verdict (`corrupt` or `divergent`),
  the class of its first-divergence position (`first-token`: output position 0, a state handed in
  before the first decode; `later`: during decoding), and, when the run's hypotheses name a
  mechanism the target carries, that feature (a boolean the target has, or a numeric feature's
  best split that its value satisfies, e.g. `max_state_slot >= 27`).
- `mechanism_hypothesis(hypotheses)` is the first hypothesis whose feature describes a mechanism
  rather than the workload's shape: arrival index, rollout index and prompt length are what a
  shrink changes on purpose, so they are never part of a signature.
- `target_feature(name, seq, requests, trace, engine_info, ...)` is the value of one feature for
  the request with arrival index `seq` (None when the run lacks what the feature needs), computed by
  the same functions the run analysis uses (`analysis.features`, `analysis.signatures`,
  `analysis.speculative_features.spec_divergence` and `analysis.speculative_decisions.decision_signature`, which
  read the run's `summary`).
- `signature_of(row, hypothesis, value)` builds the signature of the original run's target (its
  summary row and its value of the hypothesis' feature); `shows(sig, row, value)` says whether a
  request's summary row and feature value show the same lie, with the words for what was seen.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

FLAGGED = ("divergent", "corrupt")
SHAPE_FEATURES = ("seq", "rollout", "prompt_length")  # what shrinking changes on purpose
TOKEN_SIGNATURES = ("crossed_wires", "tempered_logprobs")  # computed from tokens, not the trace
# computed from the run's summary (where each request first diverged, or why the decision test raised it)
SUMMARY_SIGNATURES = (
    "diverged_at_first_spec_decode",
    "spec_decision_against_odds",
    "positional_onset",
    "collapsed_to_one_token",
)


def position_class(position: int | None) -> str | None:
    if position is None:
        return None
    return "first-token" if position == 0 else "later"


POSITION_WORDS = {"first-token": "at the first output token (position 0)", "later": "after the first output token"}


@dataclass(frozen=True)
class Signature:
    verdict: str
    position_class: str
    feature: str | None = None
    split: dict | None = None  # numeric features: {"op": ">=" | "<=", "value": float}
    phrase: str | None = None  # the hypothesis' words for the feature

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Signature":
        return cls(**{k: d.get(k) for k in ("verdict", "position_class", "feature", "split", "phrase")})

    def describe(self) -> str:
        words = f"{self.verdict}, first divergence {POSITION_WORDS.get(self.position_class, self.position_class)}"
        if self.feature:
            words += f", and {self.feature_words()}"
        return words

    def feature_words(self) -> str:
        if self.split:
            return f"{self.feature} {self.split['op']} {_num(self.split['value'])}"
        return f"{self.feature} ({self.phrase})" if self.phrase else self.feature or ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


def mechanism_hypothesis(hypotheses: list[dict] | None) -> dict | None:
    return next((h for h in hypotheses or [] if h.get("feature") and h["feature"] not in SHAPE_FEATURES), None)


def carries(value, split: dict | None) -> bool:
    """Whether a feature value has the feature: a true boolean, or a number on the split's side."""
    if value is None:
        return False
    if split is None:
        return bool(value)
    x = float(value)
    if x != x:  # NaN: unknown
        return False
    return x >= split["value"] if split["op"] == ">=" else x <= split["value"]


def signature_of(row: dict, hypothesis: dict | None, value) -> tuple[Signature, str | None]:
    """(the target's signature, why the hypothesis' feature was left out, or None when it is in or
    there was none). `row` is the target's summary row (verdict, first_divergence)."""
    base = dict(verdict=row["verdict"], position_class=position_class(row["first_divergence"]))
    if hypothesis is None:
        return Signature(**base), None
    split = hypothesis.get("split")
    if not carries(value, split):
        return Signature(**base), (
            f"the top mechanism ({hypothesis['feature']}) does not describe this request, "
            f"so it is not part of the signature"
        )
    return Signature(**base, feature=hypothesis["feature"], split=split, phrase=_phrase(hypothesis)), None


def _phrase(hypothesis: dict) -> str | None:
    """The hypothesis sentence's words for what a request did: '7/7 corrupt requests <words>; ...'."""
    head = (hypothesis.get("sentence") or "").split(";")[0].rstrip(".")
    parts = head.split(" requests ", 1)
    # a run-wide signature's sentence reads 'k/n requests (a/b flagged ones) <words>'
    return re.sub(r"^\([^)]*\)\s*", "", parts[1]).strip() if len(parts) == 2 else None


def shows(sig: Signature, row: dict | None, value) -> tuple[bool, str]:
    """(whether the request shows the same lie, what was seen in a few words)."""
    if row is None:
        return False, "missing from the run"
    verdict, pos = row.get("verdict"), row.get("first_divergence")
    seen = str(verdict) + (f" at position {pos}" if pos is not None and verdict in FLAGGED else "")
    if sig.feature:
        has = carries(value, sig.split)
        seen += f", {'with' if has else 'without'} {sig.feature}"
    else:
        has = True
    same = verdict == sig.verdict and position_class(pos) == sig.position_class and has
    return same, seen


def target_feature(
    name: str,
    seq: int,
    requests,
    trace,
    engine_info: dict | None,
    tokens=None,
    reference=None,
    temperature: float = 0.0,
    thresholds=None,
    summary=None,
):
    """The value of feature `name` for the request with arrival index `seq`, or None when the run
    cannot say (no trace for a trace feature, no token tables for a token signature)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from lpf.analysis.verdicts import by_arrival

    req = by_arrival(requests)
    where = pc.index(req.column("seq"), pa.scalar(seq, req.column("seq").type)).as_py()
    if where < 0:
        return None
    if name in SUMMARY_SIGNATURES:
        if summary is None:
            return None
        from lpf.analysis.onset_features import onset_features
        from lpf.analysis.speculative_decisions import decision_signature
        from lpf.analysis.speculative_features import spec_divergence

        if name in ("positional_onset", "collapsed_to_one_token"):  # a candidate's flagged requests, even one
            flagged = pc.is_in(summary.column("verdict"), value_set=pa.array(list(FLAGGED))).to_numpy(
                zero_copy_only=False
            )
            f = next(
                (x for x in onset_features(summary, req, flagged, engine_info, least=1)[0] if x.name == name), None
            )
        elif name == "spec_decision_against_odds":
            f = decision_signature(summary)
        else:
            f = spec_divergence(summary, req, trace)
        rid = req.column("request_id")[where].as_py()
        at = summary.column("request_id").to_pylist()
        return bool(f.values[at.index(rid)]) if f is not None and rid in at else False
    if name in TOKEN_SIGNATURES:
        if tokens is None or reference is None:
            return None
        from lpf.analysis import signatures
        from lpf.analysis.metrics import join_grouped

        joined, _ = join_grouped(tokens, reference)
        if name == "crossed_wires":
            ids = signatures.crossed_wires(joined, req, trace)
        elif temperature and thresholds is not None:
            ids = signatures.tempered_logprobs(joined, reference, temperature, thresholds)
        else:
            return None
        return None if ids is None else req.column("request_id")[where].as_py() in set(ids.to_pylist())
    from lpf.analysis.features import request_features

    for f in request_features(req, trace, engine_info):
        if f.name == name:
            value = f.values[where]
            return bool(value) if f.kind == "bool" else float(value)
    return None
