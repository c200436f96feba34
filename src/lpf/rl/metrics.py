"""Per-step and per-response rollout/trainer mismatch metrics, under the names RL frameworks log them.

Pure numpy over the flat token arrays of a `Dump` (no torch, no I/O). With, per scored token,
r = rollout (inference engine) logprob, t = trainer logprob and d = t - r = log(pi_train / pi_rollout):

  rollout_probs_diff_{max,mean,std}  |exp(t) - exp(r)| over the step's tokens      verl calculate_debug_metrics
  k3_kl                              mean(exp(d) - d - 1)                           verl rollout_corr/k3_kl
  chi2_token                         mean(rho^2) - 1, rho = exp(clip(d, +-20))      verl rollout_corr/chi2_token
  ess                                (sum rho)^2 / (n * sum rho^2), in (0, 1]       normalised effective sample
                                     size of the token IS weights (verl's rollout_is_eff_sample_size
                                     without its [1/2, 2] truncation, which would hide a spike)
  train_rollout_logprob_abs_diff     mean |d|                                       slime
  token_mult_prob_error              mean exp(|d|)                                  NeMo-RL
std is the sample std (ddof 1, as torch.std), 0 for a single token. The +-20 clip is verl's SAFETY_BOUND.
"""

from __future__ import annotations

import numpy as np

STEP_METRICS = ("rollout_probs_diff_max", "rollout_probs_diff_mean", "rollout_probs_diff_std", "k3_kl",
                "chi2_token", "ess", "train_rollout_logprob_abs_diff", "token_mult_prob_error")
SAFETY_BOUND = 20.0


def token_terms(rollout: np.ndarray, trainer: np.ndarray) -> dict[str, np.ndarray]:
    """The per-token quantities every aggregate is built from."""
    d = trainer - rollout
    rho = np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND))
    with np.errstate(over="ignore"):
        return {
            "d": d,
            "abs_d": np.abs(d),
            "prob_diff": np.abs(np.exp(trainer) - np.exp(rollout)),
            "k3": np.expm1(d) - d,  # expm1 keeps float32-sized d from cancelling to 0 or below
            "rho": rho,
            "mult": np.exp(np.abs(d)),
        }


def _group_sum(codes: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(codes, weights=values, minlength=n)


def grouped(codes: np.ndarray, n: int, terms: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The STEP_METRICS (plus n_tokens) for every group code 0..n-1 of the tokens."""
    cnt = np.bincount(codes, minlength=n).astype(np.float64)
    safe = np.maximum(cnt, 1)
    pd = terms["prob_diff"]
    mean_pd = _group_sum(codes, pd, n) / safe
    var = (_group_sum(codes, pd * pd, n) - cnt * mean_pd ** 2) / np.maximum(cnt - 1, 1)
    mx = np.full(n, -np.inf)
    np.maximum.at(mx, codes, pd)
    rho = terms["rho"]
    s1, s2 = _group_sum(codes, rho, n), _group_sum(codes, rho * rho, n)
    out = {
        "n_tokens": cnt.astype(np.int64),
        "rollout_probs_diff_max": mx,
        "rollout_probs_diff_mean": mean_pd,
        "rollout_probs_diff_std": np.where(cnt > 1, np.sqrt(np.maximum(var, 0.0)), 0.0),
        "k3_kl": _group_sum(codes, terms["k3"], n) / safe,
        "chi2_token": s2 / safe - 1.0,
        "ess": s1 * s1 / (safe * np.maximum(s2, 1e-300)),
        "train_rollout_logprob_abs_diff": _group_sum(codes, terms["abs_d"], n) / safe,
        "token_mult_prob_error": _group_sum(codes, terms["mult"], n) / safe,
    }
    empty = cnt == 0
    for k, v in out.items():
        if k != "n_tokens" and v.dtype.kind == "f":
            v[empty] = np.nan
    return out


def response_max_abs(tok_resp: np.ndarray, abs_d: np.ndarray, n_resp: int) -> np.ndarray:
    out = np.zeros(n_resp)
    np.maximum.at(out, tok_resp, abs_d)
    return out


def first_over(tok_resp: np.ndarray, tok_pos: np.ndarray, over: np.ndarray, n_resp: int) -> np.ndarray:
    """Per response, the first position whose token is flagged (`over`), -1 when none."""
    first = np.full(n_resp, np.iinfo(np.int64).max)
    np.minimum.at(first, tok_resp[over], tok_pos[over])
    first[first == np.iinfo(np.int64).max] = -1
    return first
