"""What came back from the engine, and so what each analysis step can and cannot judge (findings' `judged`).

Contract: `what_came_back(tokens, has_prompt, engine_info, sampling, seeded)` -> {"logprobs": "all" |
"none" | "some", "top_k": the widest top-k list returned, "prompt_logprobs": bool, "seeded_replay": bool,
"route", "notes" (the adapter's, e.g. a fallback to text prompts), "steps": {step: sentence}}, one
sentence per analysis step saying what it judged from that and what it could not. `tokens_only(tokens)`:
whether no scored token has an engine logprob (the run is then judged by `lpf.analysis.tokens_only`).
Both take the tokens table, or its `counts(parts)`: rows, rows without a logprob and the widest
top-k, summed part by part (what a caller that must not hold the whole table passes). In a run where
only some tokens came back without a logprob (`logprobs` "some": llama-server leaves out a token that
ends inside a UTF-8 character), those tokens are judged from the token alone (`lpf.analysis.absent`),
never counted as logprob errors; a NaN logprob value stays an engine error. `no_logprob`: how many
(present only when some are, so runs with every logprob keep their findings as they were).
Pure: an Arrow table and plain data in, plain data out.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc


def counts(parts) -> dict:
    """{rows, no_logprob, top_k} of tokens tables (each with engine_logprob, engine_topk_ids optional)."""
    out = {"rows": 0, "no_logprob": 0, "top_k": 0}
    for t in parts:
        out["rows"] += t.num_rows
        out["no_logprob"] += t.column("engine_logprob").null_count if t.num_rows else 0
        out["top_k"] = max(out["top_k"], _top_k(t))
    return out


def tokens_only(tokens) -> bool:
    c = tokens if isinstance(tokens, dict) else counts([tokens])
    return c["rows"] > 0 and c["no_logprob"] == c["rows"]


def _top_k(tokens: pa.Table) -> int:
    if tokens.num_rows == 0 or "engine_topk_ids" not in tokens.column_names:
        return 0
    return int(pc.max(pc.list_value_length(tokens.column("engine_topk_ids"))).as_py() or 0)


def what_came_back(tokens, has_prompt: bool, engine_info: dict | None, sampling: dict, seeded: bool = False) -> dict:
    info = engine_info or {}
    c = tokens if isinstance(tokens, dict) else counts([tokens])
    nulls = c["no_logprob"]
    logprobs = "none" if c["rows"] and nulls == c["rows"] else ("some" if nulls else "all")
    k = c["top_k"]
    greedy = not (sampling.get("temperature") or 0)
    steps = {}
    if logprobs == "none":
        steps["per_request"] = (
            "from tokens alone: the reference's probability of each returned token (a request "
            "whose tokens the reference finds improbable, sustained, is corrupt; a greedy token "
            "that is not the reference's argmax past the tie margin is divergent); no logprob "
            "error, so no `noise` verdict"
        )
        steps["run_test"] = (
            "the tokens-only test: "
            + (
                "greedy flips against the flip rate the dtype explains"
                if greedy
                else "the sampled tokens' top-1 share at the requested temperature (a martingale)"
            )
            + (
                "; the seeded draws replayed with the engine's sampler"
                if seeded
                else "; no seeded replay (the sampler is not one lpf can replay, or the run is greedy)"
            )
        )
        steps["topk"] = "not judged: no top-k came back"
        steps["hypotheses"] = "ranked over the requests flagged from their tokens"
    else:
        steps["per_request"] = "logprob error of every returned token against the reference" + (
            f" ({nulls} tokens came back without a logprob: judged from their tokens alone, as a tokens-only "
            "run judges every token (a greedy flip past the tie margin, or a token the reference finds "
            "improbable, still flags its request); no logprob error, so out of |logprob diff|; the summary's "
            "n_no_logprob counts them per request)"
            if nulls
            else ""
        )
        steps["run_test"] = (
            "logprob error against the expected floor"
            + (f", and the top-{k} spread" if k >= 2 else "; the top-k spread not judged (fewer than 2 alternatives)")
            + (f"; the {nulls} tokens without a logprob count by their greedy flips only" if nulls else "")
        )
        steps["topk"] = f"top-{k} lists compared" if k else "not judged: no top-k came back"
        steps["hypotheses"] = "ranked over the flagged requests"
    steps["prompt"] = "prompt positions judged apart" if has_prompt else "not judged: no prompt logprobs came back"
    return {
        "logprobs": logprobs,
        **({"no_logprob": nulls} if nulls else {}),
        "top_k": k,
        "prompt_logprobs": has_prompt,
        "seeded_replay": seeded,
        "route": info.get("routes"),
        "prompt_form": info.get("prompt_form"),
        "notes": info.get("notes") or [],
        "steps": steps,
    }
