"""The words of `lpf rl explain`: one evidence sentence per cause, hints for untested ones, the summary. Pure.

Sentences carry the test's numbers (slope and standard error, p-value, variance ratio, the profile
over positions, the batch levels) so a reader can check the claim without the JSON.
"""

from __future__ import annotations

import numpy as np

HINT_SIGN = 0.9  # this share of tokens with the rollout above the trainer is the processed-logprob signature


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def evidence(cause: str, test: dict, share: float, inp) -> str:
    st = test.get("status")
    if st == "untested":
        return f"untested: {test.get('missing')}"
    if st == "not applicable":
        return test.get("reason", "not applicable")
    if cause == "processed_logprobs" and test.get("reason"):  # nothing inferred from the reference's heads
        return test["reason"]
    if cause in ("processed_logprobs", "stale_weights"):
        f = test.get("fit") or {}
        if f.get("beta") is None:
            return "no token to fit"
        what = (
            "d against the reference's log kept mass"
            if cause == "processed_logprobs"
            else f"d against the {test.get('source')}'s score now minus {test.get('lag') or 'its best'} step(s) back"
        )
        s = f"{what}: slope {f['beta']:.4f} +- {f['se']:.2g} over {f['n']} tokens"
        if cause == "stale_weights" and st == "passed":
            s += f", applied to {test.get('responses_applied')} responses"
        if cause == "processed_logprobs":
            s = _processed_steps(test, s)
        return s + ("" if st == "passed" else " (not 1: not this cause)")
    if cause == "position_growth":
        prof = test.get("profile") or {}
        at = test.get("steps")
        where = f"at spike steps {_list(at)} (each on its own tokens, against the quiet steps' floor): " if at else ""
        shown = ", ".join(f"{k}: {v:.3g}" for k, v in list(prof.items())[:8])
        s = where + (
            f"{test.get('side')} side: error / sensitivity by position {{{shown}}}; Spearman {test.get('spearman', 0):.3f}, p "
            f"{test.get('p_value', 1):.3g}, variance ratio {test.get('variance_ratio', 1):.3g}"
        )
        layers = test.get("layers")
        if st == "passed" and layers:
            if layers.get("mamba"):
                s += (
                    f"; the model is hybrid ({layers['mamba']} recurrent, {layers['attention']} attention layers): "
                    f"attention reads K/V written once, the recurrent state is carried token to token, so growth "
                    f"points at the state path"
                )
            else:
                s += "; the model has no recurrent layer: growth points at the KV-cache path or long-context numerics"
        return s
    if cause == "batch_shape":
        lv = test.get("levels") or {}
        shown = ", ".join(f"{k}: {v:.3g}" for k, v in list(lv.items())[:8])
        return (
            f"{test.get('side')} side: error / sensitivity by {test.get('feature')} {{{shown}}}; p {test.get('p_value', 1):.3g}, variance "
            f"ratio {test.get('variance_ratio', 1):.3g} (features tested: {', '.join(test.get('features_tested', []))})"
        )
    if cause == "dtype_floor":
        return "; ".join(
            f"{name}: base sigma {t.get('sigma_residual_base', 0):.3g} vs the floor's "
            f"{t.get('sigma_floor') or 0:.3g} ({t.get('detail') or 'no floor known'})"
            + (f"; {t['unmeasured']}" if t.get("unmeasured") else "")
            for name, t in (test.get("sides") or {}).items()
        )
    if cause == "unexplained":
        n = test.get("n_outlier_responses", 0)
        s = f"{_pct(share)} of the mass"
        if n:
            s += f"; {n} outlier responses (first: {', '.join(map(str, test.get('outlier_responses', [])[:3]))})"
        if test.get("sigma_systematic"):
            s += f"; a systematic level sigma {test['sigma_systematic']:.3g} above the floor"
        return s
    return ""


def _list(steps) -> str:
    steps = [] if steps is None else [int(x) for x in steps]
    return ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "")


def _processed_steps(test: dict, pooled: str) -> str:
    """Where the exact test passed step by step, with the top-p / top-k inferred when the dump gave none."""
    at = test.get("steps") or []
    s = ""
    inf = test.get("inferred") or {}
    if inf.get("setting") == "top_p":
        lo, hi = inf["top_p_interval"]
        s += f"top-p {inf['top_p']:g} inferred from d and the reference's heads (any P in ({lo:.4g}, {hi:.4g}] fits); "
    elif inf.get("setting") == "top_k":
        s += f"top-k {inf['top_k']} inferred from d and the reference's heads; "
    if at and len(at) < (test.get("n_steps") or 0):
        fits = test.get("step_fits") or {}
        slopes = [fits[k]["beta"] for k in at if k in fits]
        rng_ = f" (slopes {min(slopes):.4f} to {max(slopes):.4f})" if slopes else ""
        s += f"at steps {_list(at)} of {test['n_steps']}, each fitted on its own{rng_}; over the whole dump, "
    if inf.get("tokens_unknown"):
        s += f"[{inf['tokens_unknown']} tokens' kept head is longer than the stored one: rerun lpf rl rescore --top-p {inf.get('top_p')}] "
    return s + pooled


def hints(inp, ex) -> list[str]:
    """What the untested causes would need, with what the dump already suggests."""
    out = []
    d = inp.t - inp.r
    if ex.tests.get("processed_logprobs", {}).get("status") == "untested" and d.size:
        above = float(np.mean(d < 0))
        steps, code = np.unique(inp.steps[inp.tok_resp], return_inverse=True)
        per = np.bincount(code, weights=(d < 0)) / np.maximum(np.bincount(code), 1)
        sign = steps[per >= HINT_SIGN]
        if above >= HINT_SIGN:
            out.append(
                f"rollout logprobs sit above the trainer's on {_pct(above)} of tokens: the signature of processed "
                f"logprobs; test it with lpf rl rescore --reference MODEL (the top-p / top-k are inferred; "
                f"--top-p P --top-k K gives them)"
            )
        elif sign.size:
            out.append(
                f"at steps {_list(sign)} the rollout's logprobs sit above the trainer's on >= {_pct(HINT_SIGN)} of "
                f"tokens: the signature of processed logprobs there; test it with lpf rl rescore --reference MODEL "
                f"(the top-p / top-k are inferred; --top-p P --top-k K gives them)"
            )
    if inp.policy_version is not None and ex.tests.get("stale_weights", {}).get("status") == "untested":
        lag = inp.steps - inp.policy_version
        if np.nanmax(lag) > 0:
            out.append(
                f"the dump says {int(np.sum(lag > 0))} responses came from an older policy (up to "
                f"{int(np.nanmax(lag))} steps): test stale weights with lpf rl rescore --reference "
                f"'CKPT/step_{{step}}' --lags 0,1"
            )
    for cause, t in ex.tests.items():
        if t.get("status") == "untested" and t.get("missing") and cause != "processed_logprobs":
            out.append(f"{cause.replace('_', ' ')}: {t['missing']}")
    return out


def summary(block: dict) -> str:
    shares = block["shares"]
    by = {c["cause"]: c for c in block["causes"]}
    if block["verdict"] == "cannot-judge":
        return (
            f"cannot judge the dtype floor: no dtype recorded and no quiet step or response to estimate it from "
            f"(give --rollout-dtype); sum |d| {block['total_mass']:.4g} over {block['n_tokens']} tokens, nothing named"
        )
    if block["verdict"] == "inside-floor":
        return (
            f"inside the dtype floor: {_pct(shares['dtype_floor'])} of sum |d| ({block['total_mass']:.4g} over "
            f"{block['n_tokens']} tokens) is what the dtypes explain; nothing named"
        )
    at: dict = {}
    for e in block.get("steps") or []:
        for c in e.get("named") or []:
            at.setdefault(c, []).append(e["step"])
    n_steps = len(block.get("steps") or [])

    def where(c):
        st = at.get(c) or []
        return f" (steps {_list(st)})" if st and len(st) < n_steps else ""

    parts = [f"{by[c]['label']} {_pct(shares[c])}{where(c)}" for c in block["named"]]
    if shares["unexplained"] > 0.005:
        parts.append(f"unexplained {_pct(shares['unexplained'])}{where('unexplained')}")
    parts.append(f"dtype floor {_pct(shares['dtype_floor'])}")
    untested = [by[c]["label"] for c in by if by[c]["status"] == "untested"]
    s = f"sum |d| {block['total_mass']:.4g} over {block['n_tokens']} tokens: " + ", ".join(parts)
    if untested:
        s += f" (untested: {', '.join(untested)})"
    return s
