"""`lpf repeat`'s verdict over the copies it generated: pure functions, no engine.

Contract: `compare(outputs, tolerance)` groups the copies' (token ids, logprobs) into unique completions
(token sequences; logprob vectors bit for bit and within `tolerance`) and finds where they first diverge;
`batch_shape(copies, tolerance, server)` says whether copies sent among other requests depart from the
copy sent alone while copies sent alone agree (a batch-shape dependence), naming the server's knob that
controls it where lpf knows one (`BATCH_SHAPE_KNOBS`). An answer without logprobs makes both compare
tokens only. `lpf.experiments.repeat` generates the copies and writes what these return.
"""

from __future__ import annotations

# Reduction-order rounding of a float32 forward pass moves logprobs by ~1e-5 (CPU sgemm picks other
# kernels for other row counts); 1e-4 sits above that and below float16/bfloat16-level noise (~1e-3).
DEFAULT_TOLERANCE = 1e-4


def compare(outputs: list[tuple[list[int], list[float]]], tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """Unique completions and first divergence over the copies' (token ids, logprobs).

    Logprob vectors are compared bit for bit (`unique_logprob_vectors`) and, because a float32 GEMM
    already rounds differently for different batch sizes, also up to `tolerance`
    (`unique_logprob_vectors_at_tolerance`: a copy joins the first group with the same tokens whose
    first member is within `tolerance` at every position). `first_divergence.tokens` is the first position where
    the copies' tokens disagree (a copy that already stopped counts as disagreeing);
    `first_divergence.logprobs` is the first position where tokens or logprobs disagree, with the
    min/max logprob across copies there. `max_logprob_spread` is the largest max-min over positions
    where every copy still has the same context (before the first token divergence). When any copy
    came back without logprobs (None) only the tokens are compared: the logprob fields are None.
    """
    tokens_only = any(lps is None for _, lps in outputs)
    if tokens_only:  # a server that returned no logprobs: the tokens are all there is to compare
        outputs = [(toks, [0.0] * len(toks)) for toks, _ in outputs]
    tok_groups: dict[tuple, int] = {}
    lp_groups: dict[tuple, int] = {}
    tg, lg = [], []
    for toks, lps in outputs:
        tg.append(tok_groups.setdefault(tuple(toks), len(tok_groups)))
        lg.append(lp_groups.setdefault((tuple(toks), tuple(lps)), len(lp_groups)))
    reps: list[tuple[list[int], list[float]]] = []
    tolg = []
    for toks, lps in outputs:
        for g, (rt, rl) in enumerate(reps):
            if rt == list(toks) and all(abs(a - b) <= tolerance for a, b in zip(lps, rl)):
                tolg.append(g)
                break
        else:
            tolg.append(len(reps))
            reps.append((list(toks), list(lps)))
    longest = max((len(t) for t, _ in outputs), default=0)
    first_tok = first_lp = None
    spread = 0.0
    for p in range(longest):
        toks = [t[p] if p < len(t) else None for t, _ in outputs]
        lps = [lp[p] for t, lp in outputs if p < len(t)]
        same_tok = len(set(toks)) == 1
        if first_lp is None and (not same_tok or len(set(lps)) > 1):
            first_lp = {
                "position": p,
                "min_logprob": None if tokens_only else min(lps),
                "max_logprob": None if tokens_only else max(lps),
                "tokens_agree": same_tok,
                "distinct_tokens": sorted({t for t in toks if t is not None}),
            }
        if not same_tok:
            first_tok = {
                "position": p,
                "distinct_tokens": sorted({t for t in toks if t is not None}),
                "copies_stopped": sum(t is None for t in toks),
            }
            break
        spread = max(spread, max(lps) - min(lps))
    return {
        "compared": "tokens" if tokens_only else "tokens and logprobs",
        "unique_token_sequences": len(tok_groups),
        "unique_logprob_vectors": None if tokens_only else len(lp_groups),
        "unique_logprob_vectors_at_tolerance": None if tokens_only else len(reps),
        "tolerance": tolerance,
        "tokens_group": tg,
        "logprobs_group": lg,
        "tolerance_group": tolg,
        "first_divergence": {"tokens": first_tok, "logprobs": None if tokens_only else first_lp},
        "max_logprob_spread": None if tokens_only else spread,
    }


# what controls a server's batch-shape dependence, where known: (the knob in words, how to turn it off)
BATCH_SHAPE_KNOBS = {
    "llama-server": (
        "flash attention (on by default in llama-server: its kernel's reduction order follows the batch)",
        "llama-server --flash-attn off (-fa off); lpf's llamacpp engine: -E flash_attn=off",
    ),
}


def batch_shape(copies: list[dict], tolerance: float, server: str | None = None) -> dict:
    """Whether the copies sent among other requests depart from the copy sent alone (copy 0) beyond
    `tolerance` or in their tokens, while the copies sent alone (copy 0, and any whose batch sizes were
    all 1) agree with each other: {dependent, alone, shared, departing, tokens_differ, max_abs_diff,
    alone_spread, compared, tolerance, server, knob, turn_off, sentence}; a copy with `alone` set (one request
    in flight) ran alone too; with no logprobs (max_abs_diff_vs_copy0 None) the tokens alone decide."""
    base = copies[0]
    sizes = lambda c: [b for b in c.get("batch_sizes") or () if b is not None]  # noqa: E731  (null: not said)
    alone = [c for c in copies if c["n_fillers"] == 0 or c.get("alone") or (sizes(c) and max(sizes(c)) == 1)]
    shared = [c for c in copies if c not in alone]
    diff = lambda c: c["max_abs_diff_vs_copy0"] or 0.0  # noqa: E731  (None: tokens only, no logprobs)
    tokens_only = any(c["max_abs_diff_vs_copy0"] is None for c in copies)
    tokens_differ = [c for c in shared if c["output_token_ids"] != base["output_token_ids"]]
    departing = [c for c in shared if c in tokens_differ or diff(c) > tolerance]
    spread = max((diff(c) for c in alone), default=0.0)
    alone_agree = spread <= tolerance and all(c["output_token_ids"] == base["output_token_ids"] for c in alone)
    dependent = bool(departing) and alone_agree
    worst = max((diff(c) for c in shared), default=0.0)
    knob, turn_off = BATCH_SHAPE_KNOBS.get(server or "", (None, None))
    if not shared:
        sentence = "no copy shared the server with other requests: nothing tells whether the batch's shape matters"
    elif dependent and tokens_only:
        sentence = (
            f"batch-shape dependence: the same prompt's tokens change with what else is in the batch ({len(departing)} "
            f"of {len(shared)} copies sent among other requests; tokens only: the server returned no logprobs)"
            + (f"; {server}'s {knob} controls it: {turn_off}" if knob else "")
        )
    elif dependent:
        sentence = (
            f"batch-shape dependence: the same prompt's logprobs change with what else is in the batch "
            f"({len(departing)} of {len(shared)} copies sent among other requests depart from the copy sent "
            f"alone, by up to {worst:.3g}, tolerance {tolerance:g}"
            + (f"; {len(tokens_differ)} with other tokens" if tokens_differ else "")
            + ")"
            + (f"; {server}'s {knob} controls it: {turn_off}" if knob else "")
        )
    elif departing:
        sentence = (
            f"copies differ, but copies sent alone differ too (by up to {spread:.3g}): run-to-run "
            f"nondeterminism, not (only) the batch's shape"
        )
    elif tokens_only:
        sentence = (
            f"no batch-shape dependence in the tokens: all {len(shared)} copies sent among other requests gave "
            f"the copy sent alone's tokens (tokens only: the server returned no logprobs)"
        )
    else:
        sentence = f"no batch-shape dependence: every copy within {tolerance:g} of the copy sent alone"
    return {
        "dependent": dependent,
        "alone": len(alone),
        "shared": len(shared),
        "departing": len(departing),
        "tokens_differ": len(tokens_differ),
        "max_abs_diff": None if tokens_only else worst,
        "alone_spread": None if tokens_only else spread,
        "compared": "tokens" if tokens_only else "tokens and logprobs",
        "tolerance": tolerance,
        "server": server,
        "knob": knob,
        "turn_off": turn_off,
        "sentence": sentence,
    }
