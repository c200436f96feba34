"""The per-step side of `lpf.rl.causes`: causes judged where the mismatch is, not pooled over a clean majority.
Pure numpy.

The spikes are `lpf.rl.analyze.detect`'s (the caller sets `ExplainInputs.spike_resp` / `quiet_resp`).
- `side_floors`: when the dump records no dtype, each side's floor is the sigma of e / sensitivity over the
  quiet responses' tokens (those of quiet steps, else those no spike implicates), said so; without quiet
  tokens, or when their residual is one-sided (rounding is unbiased: one sign is a bias), it cannot be
  judged (`fit_side` then calls nothing floor).
- `local_fits`: when some steps spike and others are quiet, each spike step is fitted on its own tokens and
  the quiet steps together on theirs (settled tokens left out; batch shape stays pooled: a step holds too
  few micro-batch groups); their weights replace the pooled ones there. `local_tests` records the spike
  steps where position growth passed on its own.
- `cap_floor_at_spikes`: a spike step's floor is at most what a quiet step of its size carries (the quiet
  responses' mean |d| per token); the rest goes to unexplained, so a spike is never inside the floor.
"""

from __future__ import annotations

import numpy as np

from lpf.rl import cause_tests as ct
from lpf.rl.cause_residual import BLIND, fit_side, quiet_sigma

ONE_SIDED = 0.9  # this share of the quiet residual's tokens of one sign: a bias, never a floor


def side_floors(inp, residuals: dict) -> dict:
    """side -> floor_override for `fit_side`: None (the floor table's row) unless the dump records no
    dtype, then (sigma of the quiet responses' u, what it is) or (None, why it cannot be judged)."""
    if not inp.estimate_floor:
        return {name: None for name in residuals}
    quiet = inp.quiet_resp if inp.quiet_resp is not None else np.zeros(inp.steps.size, dtype=bool)
    quiet_steps = quiet & ~(inp.spike_resp if inp.spike_resp is not None else False)
    tok_q = np.flatnonzero(quiet[inp.tok_resp])
    n_steps_q = np.unique(inp.steps[quiet_steps]).size
    out = {}
    for name, res in residuals.items():
        tok = tok_q if name == "trainer" else tok_q[np.abs(inp.r[tok_q]) > BLIND]
        sigma = quiet_sigma(inp, res, tok)
        nz = res[tok][res[tok] != 0]
        one_sided = nz.size >= 32 and max(np.mean(nz > 0), np.mean(nz < 0)) >= ONE_SIDED
        if one_sided:  # rounding is unbiased: a quiet level of one sign is a cause, not a floor
            out[name] = (
                None,
                f"no dtype recorded, and the quiet responses' residual is one-sided ({100 * max(np.mean(nz > 0), np.mean(nz < 0)):.0f}% "
                f"of {nz.size} tokens of one sign): a bias, not rounding; cannot judge the floor",
            )
        elif sigma is None:
            out[name] = (None, "no dtype recorded and no quiet response to estimate the floor from: cannot judge")
        else:
            where = f"{n_steps_q} quiet steps" if n_steps_q else "the responses no spike implicates"
            out[name] = (sigma, f"no dtype recorded: estimated from the dump's {where} ({tok.size} tokens)")
    return out


MAX_LOCAL = 200  # spike steps fitted on their own; beyond, the rest keep the pooled fit


def local_fits(inp, residuals, sides, overrides, rng) -> dict:
    """side -> [(token indices, Side)]: when some steps spike and others are quiet, each spike step is
    judged on its own tokens (a cause at 2 of 12 steps is tested where it is, against the floor, not
    diluted by the clean majority) and the quiet steps together, on theirs. Batch shape stays with the
    pooled fit (the micro-batch layout repeats over steps; one step holds too few groups)."""
    if inp.spike_resp is None or not inp.spike_resp.any() or inp.spike_resp.all():
        return {}
    spike_tok = inp.spike_resp[inp.tok_resp]
    steps_tok = inp.steps[inp.tok_resp]
    groups = [np.flatnonzero(steps_tok == s) for s in np.unique(inp.steps[inp.spike_resp])[:MAX_LOCAL]]
    groups.append(np.flatnonzero(~spike_tok))
    out = {}
    for name, res in residuals.items():
        ov = overrides[name]
        if ov is None:  # the table's floor, as the pooled fit saw it
            ov = (sides[name].tests["dtype_floor"]["sigma_floor"], sides[name].tests["dtype_floor"].get("detail"))
        fits = []
        for tok in groups:
            sub = tok if tok.size <= ct.MAX_TOKENS_TESTED else np.sort(rng.choice(tok, ct.MAX_TOKENS_TESTED, False))
            fits.append((tok, fit_side(inp, res, inp.floors.get(name), rng, sub, "none", ov, drop_settled=True)))
        out[name] = fits
    return out


def local_tests(tests: dict, local: dict, inp) -> None:
    """The steps where a step's own position test passed (spike steps only): the cause is found there
    even when the pooled test is not."""
    found: dict = {}
    for name, fits in local.items():
        for tok, fit in fits:
            t = fit.tests["position_growth"]
            step_ids = np.unique(inp.steps[inp.tok_resp[tok]])
            if step_ids.size != 1 or not inp.spike_resp[inp.tok_resp[tok[0]]]:
                continue
            if t["status"] == "passed":
                found.setdefault(int(step_ids[0]), {})[name] = {
                    k: t[k] for k in ("spearman", "p_value", "variance_ratio", "profile")
                }
    if not found:
        return
    pg = tests.setdefault("position_growth", {})
    pg["steps"] = sorted(found)
    pg["step_tests"] = found
    if pg.get("status") != "passed":
        first = next(iter(found.values()))
        side, t = next(iter(first.items()))
        pg.update(t)
        pg.update(status="passed", side=side, scope="spike steps")
        pg["pooled_status"] = "failed"


def cap_floor_at_spikes(inp, d, shares, col) -> list:
    """A spike step's floor is at most what a quiet step of its size carries (the quiet responses' mean
    |d| per token); the rest of its floor share goes to unexplained: a spike is never inside the floor."""
    if inp.spike_resp is None or not inp.spike_resp.any() or inp.quiet_resp is None or not inp.quiet_resp.any():
        return []
    a = np.abs(d)
    quiet_tok = inp.quiet_resp[inp.tok_resp]
    per_tok = float(a[quiet_tok].mean())
    steps_tok = inp.steps[inp.tok_resp]
    capped = []
    f, u = col["dtype_floor"], col["unexplained"]
    for s in np.unique(inp.steps[inp.spike_resp]):
        m = steps_tok == s
        floor_mass = float((a[m] * shares[m, f]).sum())
        cap = per_tok * int(m.sum())
        if floor_mass > cap and floor_mass > 0:
            keep = cap / floor_mass
            moved = shares[m, f] * (1 - keep)
            shares[m, f] -= moved
            shares[m, u] += moved
            capped.append(int(s))
    return capped
