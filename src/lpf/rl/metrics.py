"""Per-step (and per-response) rollout/trainer mismatch metrics, under the names RL frameworks chart them.

Pure numpy over the flat token arrays of a `Dump` (no torch, no I/O). Per scored token, r = rollout
(inference engine) logprob, t = trainer logprob, d = t - r = log(pi_train / pi_rollout),
rho = exp(clip(d, +-20)) (verl's SAFETY_BOUND). "token mean" = over the step's scored tokens; "sequence
mean" = over the step's responses of a per-response value. Each follows the framework code named
(docs/rl.md cites the files and snapshot commits):

  verl  verl/utils/debug/metrics.py calculate_debug_metrics (charted as training/<name>)
  rollout_probs_diff_{max,mean,std}  |exp t - exp r| over the tokens (std: ddof 1, as torch.std)
  rollout_actor_probs_pearson_corr   Pearson correlation of exp t and exp r over the tokens
  verl  verl/trainer/ppo/rollout_corr_helper.py (charted as rollout_corr/<name>)
  k3_kl                              token mean of exp(d) - d - 1
  chi2_token                         token mean of rho^2, minus 1
  chi2_seq                           sequence mean of exp(2 clip(sum d, +-20)), minus 1
  log_ppl_diff                       sequence mean of (mean r - mean t)
  ppl_ratio                          sequence mean of exp(mean r - mean t)
  rollout_is_eff_sample_size         1 / token mean of (w / mean w)^2, w = clip(rho, 1/2, 2) (verl's default
                                     rollout_is_threshold 2.0)
  ess                                the same without the truncation ((sum rho)^2 / (n sum rho^2)): lpf's,
                                     because truncation caps what a spike can show
  slime slime/backends/megatron_utils/loss.py + cp_utils.get_sum_of_sample_mean
  train_rollout_logprob_abs_diff     slime's default: per averaging unit (a sample; samples sharing a
                                     rollout id are one unit) sum |d| / its token count, mean over units
  train_rollout_logprob_abs_diff_per_token   token mean of |d| (slime with --calculate-per-token-loss)
  NeMo-RL nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn, grpo.py (seq error metrics)
  token_mult_prob_error              token mean of exp(|d|)
  gen_kl_error                       token mean of exp(d) - 1 - d (= k3_kl)
  policy_kl_error                    token mean of exp(-d) - 1 + d
  js_divergence_error                token mean of (KL(P_t||M) + KL(P_r||M)) / 2 with the k3 form,
                                     M = (exp t + exp r) / 2
  max_seq_mult_prob_error            max over responses of their token mean of exp(|d|)
  prime-rl src/prime_rl/trainer/rl/loss.py compute_importance_ratio_and_mismatch_kl, utils.Tensors
  mismatch_kl_{mean,median,max}      exp(d) - d - 1 over the tokens (median: the lower middle value, as
                                     torch.median); charted as mismatch_kl/all/{mean,median,max}
"""

from __future__ import annotations

import numpy as np

STEP_METRICS = (
    "rollout_probs_diff_max",
    "rollout_probs_diff_mean",
    "rollout_probs_diff_std",
    "rollout_actor_probs_pearson_corr",
    "k3_kl",
    "chi2_token",
    "chi2_seq",
    "log_ppl_diff",
    "ppl_ratio",
    "rollout_is_eff_sample_size",
    "ess",
    "train_rollout_logprob_abs_diff",
    "train_rollout_logprob_abs_diff_per_token",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "max_seq_mult_prob_error",
    "mismatch_kl_mean",
    "mismatch_kl_median",
    "mismatch_kl_max",
)
SAFETY_BOUND = 20.0
IS_THRESHOLD = 2.0


def token_terms(rollout: np.ndarray, trainer: np.ndarray) -> dict[str, np.ndarray]:
    """The per-token quantities every aggregate is built from."""
    d = trainer - rollout
    rho = np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND))
    with np.errstate(over="ignore"):
        p_t, p_r = np.exp(trainer), np.exp(rollout)
        log_m = np.logaddexp(trainer, rollout) - np.log(2.0)
        a, b = trainer - log_m, rollout - log_m
        return {
            "r": rollout,
            "t": trainer,
            "d": d,
            "abs_d": np.abs(d),
            "p_t": p_t,
            "p_r": p_r,
            "prob_diff": np.abs(p_t - p_r),
            "k3": np.expm1(d) - d,  # expm1 keeps float32-sized d from cancelling to 0 or below
            "policy_k3": np.expm1(-d) + d,
            "js": 0.5 * (np.expm1(a) - a) + 0.5 * (np.expm1(b) - b),
            "rho": rho,
            "w": np.clip(rho, 1.0 / IS_THRESHOLD, IS_THRESHOLD),
            "mult": np.exp(np.abs(d)),
        }


def _sum(codes: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(codes, weights=values, minlength=n)


def _max(codes: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, -np.inf)
    np.maximum.at(out, codes, values)
    return out


def _lower_median(codes: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    order = np.lexsort((values, codes))
    cnt = np.bincount(codes, minlength=n)
    start = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    out = np.full(n, np.nan)
    has = cnt > 0
    out[has] = values[order][start[has] + (cnt[has] - 1) // 2]
    return out


def _pearson(codes: np.ndarray, x: np.ndarray, y: np.ndarray, n: int, safe: np.ndarray) -> np.ndarray:
    dx = x - (_sum(codes, x, n) / safe)[codes]
    dy = y - (_sum(codes, y, n) / safe)[codes]
    with np.errstate(invalid="ignore", divide="ignore"):
        return _sum(codes, dx * dy, n) / np.sqrt(_sum(codes, dx * dx, n) * _sum(codes, dy * dy, n))


def series(
    tok_code: np.ndarray,
    resp_code: np.ndarray,
    tok_resp: np.ndarray,
    resp_unit: np.ndarray,
    n: int,
    terms: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """The STEP_METRICS (plus n_tokens) for every group 0..n-1. `tok_code` / `resp_code` give the group
    of each token / response, `tok_resp` the response of each token, `resp_unit` the averaging unit of
    each response (slime's per-sample mean; units never span groups). Groups = steps gives the
    per-step series; groups = responses gives each response's own value of every metric."""
    cnt = np.bincount(tok_code, minlength=n).astype(np.float64)
    safe = np.maximum(cnt, 1)
    pd = terms["prob_diff"]
    mean_pd = _sum(tok_code, pd, n) / safe
    var = _sum(tok_code, (pd - mean_pd[tok_code]) ** 2, n) / np.maximum(cnt - 1, 1)
    w = terms["w"]
    rho = terms["rho"]
    s1, s2 = _sum(tok_code, rho, n), _sum(tok_code, rho * rho, n)
    w1, w2 = _sum(tok_code, w, n), _sum(tok_code, w * w, n)
    k3_mean = _sum(tok_code, terms["k3"], n) / safe

    n_resp = resp_code.size
    rn = np.maximum(np.bincount(tok_resp, minlength=n_resp).astype(np.float64), 1)
    seq_d = _sum(tok_resp, terms["d"], n_resp)
    seq_log_ppl_diff = -seq_d / rn  # mean r - mean t
    seq_mult = _sum(tok_resp, terms["mult"], n_resp) / rn
    rcnt = np.maximum(np.bincount(resp_code, minlength=n).astype(np.float64), 1)
    with np.errstate(over="ignore"):
        chi2_seq = _sum(resp_code, np.exp(2.0 * np.clip(seq_d, -SAFETY_BOUND, SAFETY_BOUND)), n) / rcnt - 1.0
        ppl_ratio = _sum(resp_code, np.exp(seq_log_ppl_diff), n) / rcnt

    n_unit = int(resp_unit.max()) + 1 if resp_unit.size else 0
    unit_abs = _sum(resp_unit, _sum(tok_resp, terms["abs_d"], n_resp), n_unit)
    unit_tok = _sum(resp_unit, np.bincount(tok_resp, minlength=n_resp).astype(np.float64), n_unit)
    unit_group = np.zeros(n_unit, dtype=np.int64)
    unit_group[resp_unit] = resp_code
    used = np.bincount(resp_unit, minlength=n_unit) > 0
    per_sample = _sum(unit_group[used], unit_abs[used] / np.maximum(unit_tok[used], 1), n) / np.maximum(
        np.bincount(unit_group[used], minlength=n), 1
    )

    out = {
        "n_tokens": cnt.astype(np.int64),
        "rollout_probs_diff_max": _max(tok_code, pd, n),
        "rollout_probs_diff_mean": mean_pd,
        "rollout_probs_diff_std": np.where(cnt > 1, np.sqrt(np.maximum(var, 0.0)), 0.0),
        "rollout_actor_probs_pearson_corr": _pearson(tok_code, terms["p_t"], terms["p_r"], n, safe),
        "k3_kl": k3_mean,
        "chi2_token": s2 / safe - 1.0,
        "chi2_seq": chi2_seq,
        "log_ppl_diff": _sum(resp_code, seq_log_ppl_diff, n) / rcnt,
        "ppl_ratio": ppl_ratio,
        "rollout_is_eff_sample_size": w1 * w1 / (safe * np.maximum(w2, 1e-300)),
        "ess": s1 * s1 / (safe * np.maximum(s2, 1e-300)),
        "train_rollout_logprob_abs_diff": per_sample,
        "train_rollout_logprob_abs_diff_per_token": _sum(tok_code, terms["abs_d"], n) / safe,
        "token_mult_prob_error": _sum(tok_code, terms["mult"], n) / safe,
        "gen_kl_error": k3_mean,
        "policy_kl_error": _sum(tok_code, terms["policy_k3"], n) / safe,
        "js_divergence_error": _sum(tok_code, terms["js"], n) / safe,
        "max_seq_mult_prob_error": _max(resp_code, seq_mult, n),
        "mismatch_kl_mean": k3_mean,
        "mismatch_kl_median": _lower_median(tok_code, terms["k3"], n),
        "mismatch_kl_max": _max(tok_code, terms["k3"], n),
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
