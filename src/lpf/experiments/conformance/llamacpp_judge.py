"""Judging a llama.cpp float32 cell per token, with its two known, traced departures named, never hidden.

Why: two departures of llama-server that docs/real-engines.md traces to its source make every clean
float32 cell look like a bug at run level. (1) The reported logprobs are normalised by a float32
running sum (tools/server/server-common.cpp, `get_token_probabilities`, lines 1574-1597) that loses
the tail: every logprob of a position is too high by the same tiny amount (at most V x 2^-24 nats,
V the vocabulary), so the run-level test rejects on its `over` sub-test while the top-k spread,
which a per-position shift cannot move, passes. (2) `completion_probabilities` skips every token
that ends inside a UTF-8 character (tools/server/server-context.cpp, `process_token`, lines
1825-1860): random tiny models emit such tokens and the adapter stores them with no logprob. The
analysis judges such a token from the token alone (`lpf.analysis.absent`: no logprob error), so the
cell's own verdict is right without this module; `utf8-missing` stays here as the explanation of the
answers' `logprobs_missing` evidence.

Contract: `judge(tokens, reference, findings, vocab_size) -> dict` (pure; Arrow tables of the cell's
`tokens` and `reference`, its findings.json): every engine token that has a logprob is compared
with the reference's: `max_abs` |d|, `over_clean` (tokens past the analysis' clean threshold), `flips`
(tokens that are not the reference's top-1 where its top-1 leads the engine's token by more than
the tie margin); `missing` (tokens without a logprob and the requests they are in). `causes` names
each departure present, with its evidence: `normaliser` when the run-level test rejects only on
`over`/`logprob` with `topk` not rejecting, no token `under`, and every d of a present token within
[-clean, V x 2^-24 + clean]; `utf8-missing` when tokens lack logprobs. `conformance` is `clean` when
every present token is within the clean threshold, nothing flips and every run-level rejection is the
normaliser's; otherwise None (the analysis verdict stands). `bf16` cells are not judged here (their
expectation is the bfloat16 one).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

NORMALISER = (
    "llama-server normalises logprobs with a float32 running sum that drops the tail "
    "(tools/server/server-common.cpp:1574-1597): every logprob of a position a little too high"
)
UTF8 = (
    "llama-server sends no probabilities for a token that ends inside a UTF-8 character "
    "(tools/server/server-context.cpp:1825-1860, process_token / validate_utf8)"
)


def _rejects(test: dict | None, alpha: float) -> bool:
    return bool(test) and test.get("p_value") is not None and test["p_value"] < alpha


def judge(tokens: pa.Table, reference: pa.Table, findings: dict, vocab_size: int) -> dict:
    th = findings.get("thresholds") or {}
    clean, tie = float(th.get("clean_abs_diff", 1e-3)), float(th.get("tie_margin", 1e-3))
    ref = reference.select(["request_id", "position", "ref_logprob", "ref_top1_id", "ref_top1_logprob"])
    j = tokens.select(["request_id", "position", "token_id", "engine_logprob"]).join(ref, ["request_id", "position"])
    have = np.array([x is not None for x in j.column("engine_logprob").to_pylist()], dtype=bool)
    ids = j.column("request_id").to_pylist()
    eng = np.array([x if x is not None else np.nan for x in j.column("engine_logprob").to_pylist()], dtype=float)
    refl = j.column("ref_logprob").to_numpy(zero_copy_only=False).astype(float)
    d = eng - refl
    top1 = np.array(j.column("ref_top1_id").to_pylist())
    tok = np.array(j.column("token_id").to_pylist())
    gap = j.column("ref_top1_logprob").to_numpy(zero_copy_only=False).astype(float) - refl
    flips = int(np.sum((tok != top1) & (gap > tie)))
    present = d[have]
    bound = vocab_size * 2.0**-24
    out = {
        "n_tokens": int(len(d)),
        "n_with_logprob": int(have.sum()),
        "max_abs": float(np.max(np.abs(present))) if present.size else None,
        "mean": float(np.mean(present)) if present.size else None,
        "over_clean": int(np.sum(np.abs(present) > clean)),
        "clean_threshold": clean,
        "flips": flips,
        "missing": int((~have).sum()),
        "missing_requests": len({r for r, h in zip(ids, have) if not h}),
        "normaliser_bound": bound,
        "causes": [],
    }
    rt = findings.get("run_test") or {}
    alpha = rt.get("alpha") or 1e-6
    tests = rt.get("tests") or {}
    run_level_ok = rt.get("result") != "different"
    if rt.get("result") == "different" and present.size:
        shift_only = (
            not _rejects(tests.get("topk"), alpha)
            and not _rejects(tests.get("topk_bulk"), alpha)
            and not _rejects(tests.get("under"), alpha)
            and not (tests.get("under") or {}).get("k")
            and float(present.min()) >= -clean
            and float(present.max()) <= bound + clean
        )
        if shift_only:
            run_level_ok = True
            out["causes"].append(
                {
                    "name": "normaliser",
                    "says": NORMALISER,
                    "evidence": f"run-level test rejects on {rt.get('test')!r} only (over "
                    f"{(tests.get('over') or {}).get('k')}/{(tests.get('over') or {}).get('n')}"
                    f", under 0, top-k spread not rejected); d in "
                    f"[{present.min():.2g}, {present.max():.2g}], bound V x 2^-24 = {bound:.2g}",
                }
            )
    if out["missing"]:
        out["causes"].append(
            {
                "name": "utf8-missing",
                "says": UTF8,
                "evidence": f"{out['missing']} of {out['n_tokens']} tokens in {out['missing_requests']} "
                f"requests have no logprob; the other tokens are judged",
            }
        )
    per_token_ok = present.size > 0 and out["over_clean"] == 0 and flips == 0
    out["conformance"] = "clean" if per_token_ok and run_level_ok else None
    return out
