"""Who is wrong: two engines' runs of the same workload, both rescored by the same reference.

Contract: `diff_tables(a, b, level)` -> (per-request table, summary dict). Pure: Arrow tables in,
table and plain data out. `a` and `b` are `DiffSide`s: a run's per-request summary (summary.parquet:
request_id, seq, verdict, max_abs_logprob_diff, and prompt_verdict / prompt_max_abs_logprob_diff
where the run has prompt positions), its engine tokens (request_id, position, token_id,
engine_logprob), optionally its prompt tokens, and its clean threshold.

Per request present and scored in both runs:
- `a_departs` / `b_departs`: the side's verdict against the reference is at or above `level` (its
  output verdict, or its prompt verdict when that is `divergent` and `level` allows).
- `same_tokens`: both engines produced the same output tokens; `max_abs_diff_ab`: the largest
  |logprob A - logprob B| over the output positions both share up to their first different token,
  and over the prompt positions both returned (a position either engine returned without a logprob
  is left out, `lpf.analysis.absent`; a NaN logprob is infinitely far).
- `agree`: same tokens, and A and B are closer to each other than to the reference: max_abs_diff_ab
  at most the larger of the two clean thresholds, or at most `AGREE_FRACTION` of the smaller
  departure (two float32 engines agree to ~1e-5 while both sit 0.1+ away from a broken reference).
- `suspect`: `none` (neither departs), `A` / `B` (only that one departs), `reference` (both depart
  and they agree with each other: the reference is the odd one out) or `both` (both depart and they
  disagree with each other too).
The summary counts suspects, names the run-level suspect (the most frequent one other than none,
`none` when every request is fine) and says it in one sentence with the counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lpf.analysis import absent
from lpf.analysis.levels import SEVERITY

AGREE_FRACTION = 0.1
SUSPECTS = ("none", "A", "B", "reference", "both")


@dataclass(frozen=True)
class DiffSide:
    name: str  # how the side is named in sentences (its engine, or the run directory)
    summary: pa.Table
    tokens: pa.Table
    clean_abs_diff: float
    prompt_tokens: pa.Table | None = None


def _departs(summary: pa.Table, level: str) -> np.ndarray:
    v = summary.column("verdict").to_pylist()
    out = np.array([x in SEVERITY and SEVERITY[x] >= SEVERITY[level] for x in v], dtype=bool)
    if "prompt_verdict" in summary.column_names and SEVERITY[level] <= SEVERITY["divergent"]:
        pv = summary.column("prompt_verdict").to_pylist()
        out |= np.array([x is not None and SEVERITY.get(x, -1) >= SEVERITY[level] for x in pv], dtype=bool)
    return out


def _worst(summary: pa.Table) -> np.ndarray:
    """Each request's largest |d| against the reference, output or prompt."""
    w = summary.column("max_abs_logprob_diff").fill_null(0.0).to_numpy(zero_copy_only=False).astype(np.float64)
    if "prompt_max_abs_logprob_diff" in summary.column_names:
        p = summary.column("prompt_max_abs_logprob_diff").fill_null(0.0).to_numpy(zero_copy_only=False)
        w = np.maximum(w, p)
    return w


def _by_request(tokens: pa.Table | None) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """{request_id: (token ids, logprobs, whether each came back without one: `absent`)} in position order."""
    if tokens is None or not tokens.num_rows:
        return {}
    t = tokens.select(["request_id", "position", "token_id", "engine_logprob"]).sort_by(
        [("request_id", "ascending"), ("position", "ascending")]
    )
    ids = t.column("request_id").to_pylist()
    tok = t.column("token_id").to_numpy(zero_copy_only=False)
    lp = t.column("engine_logprob").to_numpy(zero_copy_only=False)
    gone = absent.mask(t.column("engine_logprob"))
    gone = np.zeros(len(lp), bool) if gone is None else gone
    out, start = {}, 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            out[ids[start]] = (tok[start:i], lp[start:i], gone[start:i])
            start = i
    return out


def _compare(x: tuple | None, y: tuple | None) -> tuple[bool, int | None, float]:
    """(same tokens, first position where the tokens differ, max |lp_x - lp_y| before it)."""
    if x is None or y is None:
        return x is None and y is None, None, 0.0
    n = min(len(x[0]), len(y[0]))
    differ = np.flatnonzero(x[0][:n] != y[0][:n])
    first = int(differ[0]) if differ.size else (None if len(x[0]) == len(y[0]) else n)
    upto = n if first is None else first
    with np.errstate(invalid="ignore"):
        d = np.abs(x[1][:upto] - y[1][:upto])
    d = np.where(np.isfinite(d), d, np.inf)  # a NaN value departs without bound
    d[x[2][:upto] | y[2][:upto]] = 0.0  # a token either engine returned without a logprob: nothing to compare
    return first is None, first, float(d.max()) if d.size else 0.0


def diff_tables(a: DiffSide, b: DiffSide, level: str = "divergent") -> tuple[pa.Table, dict]:
    if level not in SEVERITY:
        raise ValueError(f"level must be one of {', '.join(SEVERITY)}")
    scored = lambda s: s.filter(pc.is_in(s.column("verdict"), value_set=pa.array(list(SEVERITY))))  # noqa: E731
    sa, sb = scored(a.summary), scored(b.summary)
    common = pc.is_in(sa.column("request_id"), value_set=sb.column("request_id"))
    sa = sa.filter(common)
    sb = sb.take(pc.index_in(sa.column("request_id"), value_set=sb.column("request_id")))
    ids = sa.column("request_id").to_pylist()
    dep_a, dep_b = _departs(sa, level), _departs(sb, level)
    worst_a, worst_b = _worst(sa), _worst(sb)
    ta, tb = _by_request(a.tokens), _by_request(b.tokens)
    pa_, pb_ = _by_request(a.prompt_tokens), _by_request(b.prompt_tokens)
    same, first, ab = [], [], []
    for rid in ids:
        s, f, d = _compare(ta.get(rid), tb.get(rid))
        if rid in pa_ and rid in pb_:  # the prompt tokens are the same by construction: compare logprobs
            d = max(d, _compare(pa_[rid], pb_[rid])[2])
        same.append(s)
        first.append(f)
        ab.append(d)
    same_a, ab_a = np.array(same, dtype=bool), np.array(ab, dtype=np.float64)
    tol = np.maximum(max(a.clean_abs_diff, b.clean_abs_diff), AGREE_FRACTION * np.minimum(worst_a, worst_b))
    agree = same_a & (ab_a <= tol)
    suspect = np.full(len(ids), "none", dtype=object)
    suspect[dep_a & ~dep_b] = "A"
    suspect[~dep_a & dep_b] = "B"
    suspect[dep_a & dep_b & agree] = "reference"
    suspect[dep_a & dep_b & ~agree] = "both"

    def prompt_verdict(s: pa.Table):
        return s.column("prompt_verdict") if "prompt_verdict" in s.column_names else pa.nulls(s.num_rows, pa.string())

    table = pa.table(
        {
            "request_id": pa.array(ids, pa.string()),
            "seq": sa.column("seq"),
            "verdict_a": sa.column("verdict"),
            "verdict_b": sb.column("verdict"),
            "prompt_verdict_a": prompt_verdict(sa),
            "prompt_verdict_b": prompt_verdict(sb),
            "max_abs_diff_a": pa.array(worst_a),
            "max_abs_diff_b": pa.array(worst_b),
            "same_tokens": pa.array(same_a),
            "first_token_difference": pa.array(first, pa.int32()),
            "max_abs_diff_ab": pa.array(ab_a),
            "agree": pa.array(agree),
            "suspect": pa.array(suspect, pa.string()),
        }
    )
    counts = {s: int(np.count_nonzero(suspect == s)) for s in SUSPECTS}
    only = {"A": a.summary.num_rows - len(ids), "B": b.summary.num_rows - len(ids)}
    return table, _summary(a, b, counts, len(ids), int(agree.sum()), only, level)


def _summary(a: DiffSide, b: DiffSide, counts: dict, n: int, n_agree: int, only: dict, level: str) -> dict:
    name = {"A": a.name, "B": b.name, "reference": "the reference", "both": "both engines"}
    blamed = {k: v for k, v in counts.items() if k != "none" and v}
    suspect = max(blamed, key=lambda k: (blamed[k], k == "reference")) if blamed else "none"
    if suspect == "none":
        sentence = (
            f"neither {a.name} (A) nor {b.name} (B) departs from the reference at or above {level} "
            f"in any of {n} requests"
        )
    elif suspect == "reference":
        sentence = (
            f"the reference is the suspect: in {counts['reference']}/{n} requests {a.name} (A) and "
            f"{b.name} (B) agree with each other and both depart from the reference"
        )
    elif suspect == "both":
        sentence = (
            f"both engines depart: in {counts['both']}/{n} requests {a.name} (A) and {b.name} (B) "
            f"each depart from the reference and from each other"
        )
    else:
        other = "B" if suspect == "A" else "A"
        sentence = (
            f"{name[suspect]} ({suspect}) is the suspect: it departs from the reference in "
            f"{counts[suspect]}/{n} requests where {name[other]} ({other}) agrees with it"
        )
    rest = [f"{k}: {v}" for k, v in blamed.items() if k != suspect]
    if rest:
        sentence += " (also " + ", ".join(rest) + ")"
    return {
        "n_requests": n,
        "level": level,
        "counts": counts,
        "n_agree": n_agree,
        "suspect": suspect,
        "suspect_name": name.get(suspect),
        "only_in": only,
        "sentence": sentence,
        "a": a.name,
        "b": b.name,
    }
