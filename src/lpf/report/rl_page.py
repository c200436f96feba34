"""The report page of an RL directory (`lpf rl analyze DUMP --out DIR`): rl_findings.json and
rl_steps.parquet into one JSON-ready dict.

Per-step series (probability gap between rollout and trainer, KL and error metrics under the
frameworks' names, the robust z-score that marks spikes, importance-sampling health, with a third
opinion the rollout / trainer / reference curves, and the causes' shares of each step) with spike
steps marked; spikes (with their side),
bad rows, hypotheses and the noise floor pass through for tables. A panel whose first column the
writer did not produce is skipped, not invented.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from lpf.core.errors import LpfError
from lpf.report import experiment_charts

PANELS = [  # (title, columns, log y); the first column must exist for a panel to be drawn
    ("rollout vs trainer probability gap per step", ["rollout_probs_diff_max", "rollout_probs_diff_mean"], False),
    ("robust z-score of the step (spikes marked)", ["robust_z"], False),
    # the three curves of a third opinion (lpf rl rescore): which side moved away from the reference
    (
        "rollout, trainer and reference: mean |logprob difference| per step",
        ["rollout_ref_abs_diff", "trainer_ref_abs_diff", "train_rollout_logprob_abs_diff_per_token"],
        True,
    ),
    (
        "mean logprob per step: rollout, trainer, reference",
        ["rollout_logprob_mean", "trainer_logprob_mean", "reference_logprob_mean"],
        False,
    ),
    ("KL and logprob error per step", ["k3_kl", "train_rollout_logprob_abs_diff", "token_mult_prob_error"], True),
    (
        "NeMo-RL and prime-rl errors per step",
        ["policy_kl_error", "js_divergence_error", "mismatch_kl_median", "mismatch_kl_max"],
        True,
    ),
    ("importance-sampling health", ["ess", "rollout_is_eff_sample_size", "chi2_token"], False),
    ("responses and tokens per step", ["n_responses", "n_tokens"], True),
    # lpf rl explain's split of each step's sum |d| into named causes (rl_findings.json `causes`)
    (
        "mismatch causes per step (share of the step's sum |d|)",
        [
            "cause_processed_logprobs",
            "cause_stale_weights",
            "cause_batch_shape",
            "cause_position_growth",
            "cause_dtype_floor",
            "cause_unexplained",
        ],
        False,
    ),
]


def load(path: Path) -> dict:
    try:
        findings = json.loads((path / "rl_findings.json").read_text())
    except json.JSONDecodeError as e:
        raise LpfError(f"{path / 'rl_findings.json'}: unreadable JSON ({e.msg})") from None
    try:
        steps = pq.read_table(path / "rl_steps.parquet")
    except Exception as e:  # pyarrow raises several types for a bad file; all mean the same to a user
        raise LpfError(f"{path / 'rl_steps.parquet'}: unreadable ({str(e).splitlines()[0]})") from None
    if "step" not in steps.column_names:
        raise LpfError(f"{path / 'rl_steps.parquet'}: no step column")
    steps = steps.sort_by("step")
    x = steps.column("step").to_numpy(zero_copy_only=False)
    spikes = (
        steps.column("spike").fill_null(False).to_numpy(zero_copy_only=False) if "spike" in steps.column_names else None
    )
    noise = findings.get("noise_floor") or {}
    z_line = next(
        (noise[k] for k in ("z_threshold", "spike_z", "threshold") if isinstance(noise.get(k), (int, float))), None
    )
    panels = []
    for title, cols, log_y in PANELS:
        if cols[0] not in steps.column_names:
            continue
        have = {c: _col(steps, c) for c in cols if c in steps.column_names}
        band = None
        if "rollout_probs_diff_mean" in have and "rollout_probs_diff_std" in steps.column_names:
            band = (have["rollout_probs_diff_mean"], _col(steps, "rollout_probs_diff_std"))
        marks = spikes if cols[0] not in ("n_responses", "cause_processed_logprobs") else None  # metrics only
        panels.append(
            {
                "title": title,
                "figure": experiment_charts.rl_series(
                    x, have, marks, log_y=log_y, band=band, y_line=z_line if cols == ["robust_z"] else None
                ),
            }
        )
    return {
        "kind": "rl",
        "findings": findings,
        "charts": panels,
        "n_spike_steps": int(np.count_nonzero(spikes)) if spikes is not None else len(findings.get("spikes") or []),
    }


def _col(t, name: str) -> np.ndarray:
    return t.column(name).to_numpy(zero_copy_only=False).astype(float)
