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
        return s + ("" if st == "passed" else " (not 1: not this cause)")
    if cause == "position_growth":
        prof = test.get("profile") or {}
        shown = ", ".join(f"{k}: {v:.3g}" for k, v in list(prof.items())[:8])
        s = (
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


def hints(inp, ex) -> list[str]:
    """What the untested causes would need, with what the dump already suggests."""
    out = []
    d = inp.t - inp.r
    if ex.tests.get("processed_logprobs", {}).get("status") == "untested" and d.size:
        above = float(np.mean(d < 0))
        if above >= HINT_SIGN:
            out.append(
                f"rollout logprobs sit above the trainer's on {_pct(above)} of tokens: the signature of processed "
                f"logprobs; test it with lpf rl rescore --top-p P --top-k K (the rollout's settings)"
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
    if block["verdict"] == "inside-floor":
        return (
            f"inside the dtype floor: {_pct(shares['dtype_floor'])} of sum |d| ({block['total_mass']:.4g} over "
            f"{block['n_tokens']} tokens) is what the dtypes explain; nothing named"
        )
    parts = [f"{by[c]['label']} {_pct(shares[c])}" for c in block["named"]]
    if shares["unexplained"] > 0.005:
        parts.append(f"unexplained {_pct(shares['unexplained'])}")
    parts.append(f"dtype floor {_pct(shares['dtype_floor'])}")
    untested = [by[c]["label"] for c in by if by[c]["status"] == "untested"]
    s = f"sum |d| {block['total_mass']:.4g} over {block['n_tokens']} tokens: " + ", ".join(parts)
    if untested:
        s += f" (untested: {', '.join(untested)})"
    return s
