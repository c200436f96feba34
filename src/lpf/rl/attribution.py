"""A third opinion: which side of a rollout/trainer disagreement departs from the reference.

Pure numpy. With r = rollout logprob, t = trainer logprob and f = the reference's (HF transformers,
teacher-forced over the same tokens: `lpf rl rescore`), per token:

- A response's evidence is its tokens where the two sides disagree most (|r - t| at least half its
  largest |r - t|): that is where the lie is, wherever in the response it starts.
- Over the evidence, E_r = mean |r - f|, E_t = mean |t - f| and the gap E_g = mean |r - t|. A side
  departs when its E exceeds both that side's own noise against the reference (the 99.9th percentile
  of |side - f| over the quiet tokens, never below abs_min: a bf16 trainer is never exact) and a
  quarter of the gap. Since E_r + E_t >= E_g, at least one side departs unless the reference is
  noisier than the gap itself ("unclear").
- A response is `rollout` (the engine departs, the trainer agrees with the reference: a rollout-engine
  bug), `trainer` (the reverse: a trainer-side effect such as micro-batch size, TP or padding), `both`,
  or `unclear`. A spike is the one side all its attributed responses share, else `both`.

`step_series` adds the three curves per step: mean |r - f|, mean |t - f| beside the existing mean
|r - t|, and the mean logprob of each of the three.
"""

from __future__ import annotations

import numpy as np

from lpf.rl.spikes import token_threshold

SIDES = ("rollout", "trainer", "both", "unclear")
GAP_SHARE = 0.25


def step_series(tok_code: np.ndarray, n: int, r: np.ndarray, t: np.ndarray, f: np.ndarray) -> dict[str, np.ndarray]:
    cnt = np.maximum(np.bincount(tok_code, minlength=n), 1).astype(np.float64)

    def mean(v):
        return np.bincount(tok_code, weights=v, minlength=n) / cnt

    return {
        "rollout_ref_abs_diff": mean(np.abs(r - f)),
        "trainer_ref_abs_diff": mean(np.abs(t - f)),
        "rollout_logprob_mean": mean(r),
        "trainer_logprob_mean": mean(t),
        "reference_logprob_mean": mean(f),
    }


def attribute(
    tok_resp: np.ndarray, n_resp: int, r: np.ndarray, t: np.ndarray, f: np.ndarray, quiet: np.ndarray, abs_min: float
) -> tuple[np.ndarray, dict]:
    """(side per response as an index into SIDES, the thresholds used). Every response gets a side;
    the caller reads those of the implicated ones."""
    gap, dev_r, dev_t = np.abs(r - t), np.abs(r - f), np.abs(t - f)
    thr_r, thr_t = token_threshold(dev_r, quiet, abs_min), token_threshold(dev_t, quiet, abs_min)
    resp_max = np.zeros(n_resp)
    np.maximum.at(resp_max, tok_resp, gap)
    ev = gap >= 0.5 * resp_max[tok_resp]
    cnt = np.maximum(np.bincount(tok_resp[ev], minlength=n_resp), 1)

    def mean(v):
        return np.bincount(tok_resp[ev], weights=v[ev], minlength=n_resp) / cnt

    e_g, e_r, e_t = mean(gap), mean(dev_r), mean(dev_t)
    off_r = e_r > np.maximum(thr_r, GAP_SHARE * e_g)
    off_t = e_t > np.maximum(thr_t, GAP_SHARE * e_g)
    side = np.where(off_r & off_t, 2, np.where(off_r, 0, np.where(off_t, 1, 3)))
    return side, {"rollout_noise": thr_r, "trainer_noise": thr_t, "gap_share": GAP_SHARE}


def spike_side(member_sides: np.ndarray) -> tuple[str, dict]:
    counts = {s: int((member_sides == i).sum()) for i, s in enumerate(SIDES)}
    seen = {SIDES[i] for i in np.unique(member_sides) if SIDES[i] != "unclear"}
    side = "unclear" if not seen else seen.pop() if len(seen) == 1 else "both"
    return side, counts


def sentence(spike_sides: list[str], model: str) -> str:
    n = len(spike_sides)
    if not n:
        return f"reference {model}: no spike to attribute"
    c = {s: spike_sides.count(s) for s in SIDES}
    if c["rollout"] == n:
        return f"against the reference {model}, every spike is the rollout engine's (the trainer agrees with the reference)"
    if c["trainer"] == n:
        return f"against the reference {model}, every spike is the trainer's (the rollout engine agrees with the reference)"
    parts = [f"{c[s]} {s}" for s in SIDES if c[s]]
    return f"against the reference {model}, spikes by side: " + ", ".join(parts)
