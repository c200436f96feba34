"""Run the RL frameworks' own metric functions on an lpf RL dump and compare them with `lpf rl analyze`.

    python scripts/rl_metrics_vs_frameworks.py DUMP --verl VERL_CHECKOUT --nemo-rl NEMO_RL_CHECKOUT \
        --prime-rl PRIME_RL_CHECKOUT --slime SLIME_CHECKOUT

The functions are read from the checkouts at run time (ast: only the named top-level functions), and
executed with torch and stand-ins for what they import but do not use here (slime's Megatron
parallel state: one context-parallel rank); nothing of the frameworks is copied into lpf. Per step,
the dump's responses become the padded [batch, length] tensors the frameworks see (right padding,
the response mask), float32 as their trainers hold logprobs (`--float64` to see lpf's own rounding).
Prints, per metric, the largest relative difference between the framework's value and lpf's
per-step series (`lpf.rl.analyze`), relative to max(|value|, 1e-9), over all steps and over the
spike steps.

Functions run: verl `compute_offpolicy_metrics`, `compute_is_metrics` (rollout_corr_helper.py) and
`calculate_debug_metrics` (utils/debug/metrics.py) with verl's `masked_sum` / `masked_mean`;
NeMo-RL `calculate_kl`, `masked_mean` (algorithms/utils.py) and
`compute_and_apply_seq_logprob_error_masking` (algorithms/grpo.py); prime-rl
`compute_importance_ratio_and_mismatch_kl` (trainer/rl/loss.py) reduced as `Tensors.compute_stats`
does; slime `get_sum_of_sample_mean` (backends/megatron_utils/cp_utils.py) divided by the rollout
count as `reduce_train_step_metrics` does. NeMo-RL's token_mult_prob_error and js_divergence_error are
inline in `ClippedPGLossFn.__call__`; they are evaluated with its `masked_mean` on the same formula.
"""

from __future__ import annotations

import argparse
import ast
import json
import types
from pathlib import Path

import pyarrow.parquet as pq
import torch


FLOOR = 1e-9


def functions(path: Path, names: list[str], namespace: dict) -> dict:
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in keep}
    if missing:
        raise SystemExit(f"{path}: no function {', '.join(sorted(missing))}")
    for n in keep:
        n.decorator_list = []
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)
    return {n: namespace[n] for n in names}


def padded(rows: list[dict], dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(r["response_token_ids"]) for r in rows)
    old = torch.zeros(len(rows), width, dtype=dtype)
    roll = torch.zeros(len(rows), width, dtype=dtype)
    mask = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        n = len(r["response_token_ids"])
        m = r.get("loss_mask") or [1] * n
        old[i, :n] = torch.tensor(r["trainer_logprobs"], dtype=dtype)
        roll[i, :n] = torch.tensor(r["rollout_logprobs"], dtype=dtype)
        mask[i, :n] = torch.tensor(m, dtype=dtype)
    return old, roll, mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    for name in ("verl", "nemo-rl", "prime-rl", "slime"):
        ap.add_argument(f"--{name}", type=Path, required=True)
    ap.add_argument(
        "--float64",
        action="store_true",
        help="Run the frameworks' code in float64 (default float32, "
        "as their trainers hold logprobs): what is left is lpf's own rounding.",
    )
    a = ap.parse_args()
    dtype = torch.float64 if a.float64 else torch.float32

    from lpf.rl.analyze import analyze
    from lpf.rl.formats import read_dump

    lpf_steps = {r["step"]: r for r in analyze(read_dump(a.dump))[0].to_pylist()}

    vF = types.SimpleNamespace(
        **functions(a.verl / "verl/utils/torch_functional.py", ["masked_sum", "masked_mean"], {"torch": torch})
    )
    verl = functions(
        a.verl / "verl/trainer/ppo/rollout_corr_helper.py",
        ["compute_offpolicy_metrics", "compute_is_metrics"],
        {
            "torch": torch,
            "verl_F": vF,
            "SAFETY_BOUND": 20.0,
            "Optional": __import__("typing").Optional,
            "Any": __import__("typing").Any,
        },
    )
    verl.update(
        functions(
            a.verl / "verl/utils/debug/metrics.py",
            ["calculate_debug_metrics", "pearson_correlation_coefficient", "calculate_log_prob_diff"],
            {"torch": torch, "DataProto": object, "logger": types.SimpleNamespace(debug=print, warning=print)},
        )
    )
    nemo = functions(
        a.nemo_rl / "nemo_rl/algorithms/utils.py",
        ["calculate_kl", "masked_mean"],
        {"torch": torch, "Optional": __import__("typing").Optional},
    )
    nemo.update(
        functions(
            a.nemo_rl / "nemo_rl/algorithms/grpo.py",
            ["compute_and_apply_seq_logprob_error_masking"],
            {"torch": torch, "Optional": __import__("typing").Optional, "BatchedDataDict": dict},
        )
    )
    prime = functions(
        a.prime_rl / "src/prime_rl/trainer/rl/loss.py",
        ["compute_importance_ratio_and_mismatch_kl"],
        {"torch": torch, "Tensor": torch.Tensor},
    )
    mpu = types.SimpleNamespace(get_context_parallel_world_size=lambda: 1)
    slime = functions(
        a.slime / "slime/backends/megatron_utils/cp_utils.py",
        ["get_sum_of_sample_mean"],
        {"torch": torch, "mpu": mpu, "Callable": __import__("typing").Callable},
    )

    rows = pq.read_table(a.dump).to_pylist()
    worst: dict[str, float] = {}
    worst_spike: dict[str, float] = {}
    for step in sorted({r["step"] for r in rows}):
        rs = [r for r in rows if r["step"] == step]
        old, roll, mask = padded(rs, dtype)
        theirs = {}
        off = verl["compute_offpolicy_metrics"](old, roll, mask)
        theirs.update({k: off[k] for k in ("k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "ppl_ratio")})
        lr = old - roll
        w = torch.exp(torch.clamp(lr, -20, 20)) * mask
        theirs["rollout_is_eff_sample_size"] = verl["compute_is_metrics"](w, lr, mask, "token", 2.0)[
            "rollout_is_eff_sample_size"
        ]
        batch = types.SimpleNamespace(
            batch={
                "rollout_log_probs": roll,
                "old_log_probs": old,
                "response_mask": mask,
                "responses": torch.zeros_like(old, dtype=torch.long),
            }
        )
        dbg = verl["calculate_debug_metrics"](batch)
        theirs.update(
            {k.removeprefix("training/"): v for k, v in dbg.items() if k != "training/rollout_probs_diff_valid"}
        )
        # NeMo-RL: its loss reads [:, 1:]; a leading zero column makes these the response tokens
        z = torch.zeros(len(rs), 1, dtype=dtype)
        g, p, m = torch.cat([z, roll], 1), torch.cat([z, old], 1), torch.cat([z, mask], 1)
        gm, pm, mm = g[:, 1:], p[:, 1:], m[:, 1:]
        ntok = mm.sum()
        theirs["token_mult_prob_error"] = nemo["masked_mean"](
            torch.exp(torch.abs(gm - pm) * mm), mm, global_normalization_factor=ntok
        ).item()
        for key, (lp, ref) in {"gen_kl_error": (gm, pm), "policy_kl_error": (pm, gm)}.items():
            kl = nemo["calculate_kl"](
                logprobs=lp, logprobs_reference=ref, kl_type="k3", input_clamp_value=None, output_clamp_value=None
            )
            theirs[key] = nemo["masked_mean"](kl, mm, global_normalization_factor=ntok).item()
        mix = torch.log(0.5 * torch.exp(pm) + 0.5 * torch.exp(gm))
        js = 0.5 * (torch.exp(pm - mix) - (pm - mix) - 1) + 0.5 * (torch.exp(gm - mix) - (gm - mix) - 1)
        theirs["js_divergence_error"] = nemo["masked_mean"](js, mm, global_normalization_factor=ntok).item()
        seq = nemo["compute_and_apply_seq_logprob_error_masking"](
            {
                "token_mask": m,
                "sample_mask": torch.ones(len(rs), dtype=dtype),
                "prev_logprobs": p,
                "generation_logprobs": g,
            },
            torch.zeros(len(rs)),
            None,
        )
        theirs["max_seq_mult_prob_error"] = seq["max_seq_mult_prob_error"]
        _, _, mkl = prime["compute_importance_ratio_and_mismatch_kl"](old, roll)
        mkl = mkl[mask.bool()]
        theirs.update(
            mismatch_kl_mean=mkl.mean().item(),
            mismatch_kl_median=torch.median(mkl).item(),
            mismatch_kl_max=mkl.max().item(),
        )
        lengths = [len(r["response_token_ids"]) for r in rs]
        flat = torch.cat([(old[i, :n] - roll[i, :n]).abs() for i, n in enumerate(lengths)])
        masks = [mask[i, :n] for i, n in enumerate(lengths)]
        for key, per_token in (
            ("train_rollout_logprob_abs_diff", False),
            ("train_rollout_logprob_abs_diff_per_token", True),
        ):
            reducer = slime["get_sum_of_sample_mean"](lengths, lengths, masks, None, per_token)
            div = sum(max(float(x.sum()), 1.0) for x in masks) if per_token else len(rs)
            theirs[key] = reducer(flat).item() / div
        ours = lpf_steps[step]
        for k, v in theirs.items():
            # relative, with a floor: on clean steps a KL of 1e-15 is 0 in float32, which is no disagreement
            rel = abs(ours[k] - v) / max(abs(v), FLOOR)
            worst[k] = max(worst.get(k, 0.0), rel)
            if ours["spike"]:
                worst_spike[k] = max(worst_spike.get(k, 0.0), rel)
    print(
        json.dumps(
            {
                k: {"all_steps": float(f"{worst[k]:.3g}"), "spike_steps": float(f"{worst_spike.get(k, 0):.3g}")}
                for k in sorted(worst)
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
