"""The run-level test on tokens alone: for servers that return no logprobs (or whose logprobs are not trusted).

Contract (pure: numpy arrays in arrival order in, dicts out):
  token_evidence(cols, floor, sampling, seeded=None) -> per-token evidence from `token_evidence.
      evidence_columns`' reference arrays and the engine's token ids only (engine logprobs are never read).
  seeded_columns(seeded, joined, order) -> the `seeded` table's draws lined up with those arrays.
  decide(ev, lo, hi, alpha) -> the decision over tokens lo..hi (the detection benchmark's windows).
  run_test(ev, floor, alpha) -> findings.json's `run_test` for a tokens-only run (`kind: "tokens"`).
What it can judge, by the run's sampling:
  greedy    `flips`: the engine's token is not the reference's argmax although the reference prefers
            its argmax by more than the expected tie margin (`floors.tie_margin`, the top-2 margin honest
            implementations at the dtype pair move by, KAPPA x their 99th percentile). At each position
            an honest engine flips with probability at most pi(m), m the reference's top-2 margin: 1 within
            the tie margin, NULL_RATE x (tie / m)^2 beyond it (the margin error's tail past KAPPA x its 99th
            percentile falls at least as fast as a Chebyshev tail; a flip against a margin a thousand times
            the tie is then a one-in-10^8 event). The flips past the tie margin are tested against the sum
            of pi over the positions: a sum of indicators whose conditional probabilities are at most the
            predictable pi_t, so P(K >= k) <= exp(k - mu - k log(k / mu)) (the Chernoff bound holds for
            such a martingale).
  sampled   (0 < T <= 1, no top-k / top-p) `sampling`: how often the token is the reference's top-1 at
            the requested temperature, the martingale test of `run_test` (Freedman's bound, the floor's
            margin allowed); it needs no engine logprob.
  seeded    (`seeded`: the reference's own draw with the engine's sampler and the request's seed, from
            the rescore stage's replay: per token the draw, `margin` (how far the engine's token was from
            being drawn) and `runner_up` (how far the closest other token was from winning), nats of
            log p - log q) `seeded`: the engine's token differs from the reference's draw by more than
            allow = 2 KAPPA (token.q99 + settled.q99) / T (each of the two tokens' log p moved by the
            floor at that temperature), tested like the flips with pi from `runner_up`.
What it cannot judge: logprob error, the top-k spread (the engine's numbers are not there), `noise`
verdicts; at T > 1 or with top-k / top-p sampling and no seed, no test runs (`result` None, said why).
`tokens_needed`: the smallest prefix (every length to 200, then 5% steps) at which it rejects.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from lpf.analysis.floors import KAPPA
from lpf.analysis.run_test import (
    DEFAULT_ALPHA,
    MIN_TOKENS,
    NULL_RATE,
    first_rejecting_prefix,
    freedman_log_bound,
    sampling_evidence,
)


def _graded(margin: np.ndarray, tie: float) -> np.ndarray:
    """pi(m): the most an honest implementation's flip probability can be at a top-2 margin m."""
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = NULL_RATE * np.minimum(1.0, (tie / np.maximum(margin, 1e-300)) ** 2)
    return np.where(~np.isfinite(margin) | (margin <= tie), 1.0, tail)


def token_evidence(cols: dict, floor: dict, sampling: dict, seeded: dict | None = None) -> dict:
    tok = np.asarray(cols["token_id"])
    ref = np.asarray(cols["ref_logprob"], dtype=np.float64)
    top1 = np.asarray(cols["ref_top1_logprob"], dtype=np.float64)
    lp = np.asarray(cols["ref_topk_logprobs"], dtype=np.float64)
    top2 = lp[:, 1] if lp.shape[1] > 1 else np.full(len(tok), -np.inf)
    tie = float(floor["tie_margin"])
    temperature = float(sampling.get("temperature") or 0.0)
    ev: dict = {"n": len(tok), "tie_margin": tie}
    if temperature == 0:
        margin = top1 - ref  # how much the reference prefers its argmax over the engine's token
        ev["flip"] = (tok != np.asarray(cols["ref_top1_id"])) & (margin > tie)
        ev["flip_pi"] = _graded(top1 - top2, tie)
    elif 0 < temperature <= 1 and not sampling.get("top_k") and (sampling.get("top_p") or 1.0) >= 1.0:
        ev.update(sampling_evidence(tok, cols, temperature, floor))
    if seeded is not None and temperature > 0:
        allow = seeded_allow(floor, temperature)
        margin = np.asarray(seeded["margin"], dtype=np.float64)
        ev["seeded"] = (tok != np.asarray(seeded["token"])) & (margin > allow)
        runner_up = np.asarray(seeded["runner_up"], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            tail = NULL_RATE * np.minimum(1.0, (allow / np.maximum(runner_up, 1e-300)) ** 2)
        ev["seeded_pi"] = np.where(runner_up > allow, tail, 1.0)
    return ev


def seeded_allow(floor: dict, temperature: float) -> float:
    """How far an honest implementation can move a seeded draw's margin: both tokens' log p by tau / T."""
    return 2 * KAPPA * (floor["token"]["q99"] + floor["settled"]["q99"]) / temperature


def seeded_columns(seeded: pa.Table | None, joined: pa.Table, order: np.ndarray) -> dict | None:
    """The replay's columns for the rows of `joined` taken in `order` (`evidence_columns`' order); a row
    without a draw gets none (token -1, margin 0, runner-up inf: no evidence either way)."""
    if seeded is None or seeded.num_rows == 0:
        return None
    keys = joined.select(["request_id", "position"]).take(pa.array(order))
    keys = keys.append_column("_k", pa.array(np.arange(keys.num_rows)))
    j = keys.join(seeded, keys=["request_id", "position"], join_type="left outer").sort_by("_k")
    return {
        "token": j.column("seeded_token").fill_null(-1).to_numpy(),
        "margin": j.column("seeded_margin").fill_null(0.0).to_numpy(),
        "runner_up": j.column("seeded_runner_up").fill_null(np.inf).to_numpy(),
    }


def _chernoff(k: int, mu: float) -> float:
    """log of the Chernoff bound on P(K >= k) for a sum of indicators with predictable means summing to mu."""
    if k <= mu:
        return 0.0
    if mu <= 0:
        return -math.inf
    return k - mu - k * math.log(k / mu)


def decide(ev: dict, lo: int, hi: int, alpha: float = DEFAULT_ALPHA) -> dict:
    n = hi - lo
    tests: dict[str, dict] = {}
    for name in ("flip", "seeded"):
        if name in ev:
            k = int(np.count_nonzero(ev[name][lo:hi]))
            mu = float(ev[name + "_pi"][lo:hi].sum())
            tests[{"flip": "flips", "seeded": "seeded"}[name]] = {
                "k": k,
                "n": n,
                "expected_at_most": mu,
                "log_p": _chernoff(k, mu),
            }
    if "is_top1" in ev:
        o = float(np.count_nonzero(ev["is_top1"][lo:hi]))
        e_lo, e_hi = float(ev["p_top1_lo"][lo:hi].sum()), float(ev["p_top1_hi"][lo:hi].sum())
        allow = float(ev["p_top1_allow"][lo:hi].sum())
        var = float((ev["p_top1_hi"][lo:hi] * (1 - ev["p_top1_lo"][lo:hi])).clip(0, 0.25).sum())
        log_p = min(freedman_log_bound(o - e_hi - allow, var), freedman_log_bound(e_lo - allow - o, var)) + math.log(2)
        tests["sampling"] = {"k": int(o), "n": n, "expected": [e_lo, e_hi], "log_p": min(0.0, log_p)}
    out = {"result": None, "n_tokens": n, "p_value": None, "log10_p_value": None, "test": None, "statistic": None}
    if not tests:
        out["reason"] = (
            "no tokens-only test applies to this sampling (temperature above 1, or top-k / top-p "
            "without a seed the sampler can be replayed with)"
        )
    elif n < MIN_TOKENS:
        out["reason"] = f"{n} scored tokens (the test needs {MIN_TOKENS})"
    else:
        best = min(tests, key=lambda t: tests[t]["log_p"])
        log_p = min(0.0, tests[best]["log_p"] + math.log(len(tests)))
        out.update(
            result="different" if log_p < math.log(alpha) else "same",
            p_value=math.exp(log_p),
            log10_p_value=log_p / math.log(10),
            test=best,
            statistic=tests[best]["k"] / tests[best]["n"] if tests[best]["n"] else 0.0,
        )
    for v in tests.values():
        v["log10_p"] = v.pop("log_p") / math.log(10)
    out["tests"] = tests
    return out


def tokens_needed(ev: dict, alpha: float = DEFAULT_ALPHA) -> int | None:
    """The smallest prefix (every length to 200, then 5% steps) at which this test rejects."""
    return first_rejecting_prefix(ev, decide, alpha)


def run_test(ev: dict, floor: dict, alpha: float = DEFAULT_ALPHA) -> dict:
    out = decide(ev, 0, ev["n"], alpha)
    out["kind"] = "tokens"
    out["tokens_needed"] = tokens_needed(ev, alpha) if out["result"] == "different" else None
    out.update(
        alpha=alpha,
        kappa=KAPPA,
        null_rate=NULL_RATE,
        tie_margin=ev["tie_margin"],
        floor_source=floor.get("source"),
        floor_pair=floor.get("pair"),
        floor_detail=floor.get("detail"),
        effect_size=None,
        topk_effect_size=None,
        floor_far_above_expected=False,
        floor_sentence=None,
        expected_floor=None,
        observed_floor=None,
    )
    out["sentence"] = _sentence(out)
    return out


def _sentence(r: dict) -> str:
    pair = (r.get("floor_pair") or "?").replace("/", " vs ")
    if r["result"] is None:
        return f"tokens-only run-level test not decided: {r.get('reason')}"
    p = f"{r['p_value']:.2g}" if r["p_value"] and r["p_value"] > 1e-300 else f"1e{r['log10_p_value']:.0f}"
    parts = []
    for name, t in r["tests"].items():
        if name == "sampling":
            parts.append(
                f"{t['k']}/{t['n']} tokens were the reference's top-1 where {t['expected'][0]:.0f}.."
                f"{t['expected'][1]:.0f} were expected"
            )
        else:
            what = (
                "greedy tokens not the reference's argmax past the tie margin"
                if name == "flips"
                else "sampled tokens not the reference's own draw under the same seed"
            )
            parts.append(f"{t['k']}/{t['n']} {what} (at most {t['expected_at_most']:.2g} expected from {pair})")
    head = "same: within" if r["result"] == "same" else "different: beyond"
    tail = "" if r["result"] == "same" else f", rejected after {r['tokens_needed']} tokens"
    return f"{head} what {pair} explains, from tokens alone ({'; '.join(parts)}; p = {p}{tail})"
