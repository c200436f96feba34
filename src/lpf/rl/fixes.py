"""What each mismatch cause calls for, per framework, and which corrections it makes a waste.

Pure data. Every key below was read in the framework's source at the snapshots docs/rl.md names
(verl b178a3cd, prime-rl 559b4477, NeMo-RL 7ea279ab, slime 624b824a; vLLM 0.32.0 as installed):
  verl     verl/trainer/config/_generated_ppo_trainer.yaml (actor_rollout_ref.rollout.logprobs_mode,
           top_p, top_k, log_prob_micro_batch_size_per_gpu, engine_kwargs.vllm; algorithm.
           rollout_correction.rollout_is / rollout_is_threshold / rollout_rs), verl/trainer/config/
           algorithm.py (RolloutCorrectionConfig), verl/experimental/fully_async_policy/config
           (async_training.staleness_threshold); verl issue #6280 (micro-batch sizes)
  prime-rl packages/prime-rl-configs/src/prime_rl/configs/inference.py (logprobs_mode defaults to
           processed_logprobs; [inference.vllm] extras go to vLLM), orchestrator.py (train sampling
           sends top_p 1.0; max_off_policy_steps), trainer.py (DefaultLossConfig dppo_mask_low /
           dppo_mask_high; seq_len packing)
  NeMo-RL  examples/configs/grpo_math_1B.yaml (policy.generation.top_p / top_k, vllm_cfg.logprobs_mode,
           vllm_kwargs; policy.logprob_batch_size, dynamic_batching, sequence_packing; loss_fn.
           use_importance_sampling_correction, truncated_importance_sampling_type / _ratio;
           grpo.seq_logprob_error_threshold, grpo.async_grpo.max_trajectory_age_steps), the Nemotron
           recipes' vllm_kwargs.mamba_ssm_cache_dtype: float32
  slime    slime/utils/arguments.py (--rollout-top-p, --rollout-top-k, --use-tis, --tis-clip,
           --tis-clip-low, --custom-tis-function-path, --use-rollout-logprobs, --partial-rollout,
           --mask-offpolicy-in-partial-rollout; SGLang flags pass through as --sglang-*),
           slime/backends/megatron_utils/loss.py (get_rollout_top_p_logprob_kwargs: with top-p < 1
           the trainer renormalises over the rollout's recorded top-p token set)
  vLLM     config/model.py logprobs_mode, config/cache.py mamba_ssm_cache_dtype, envs.py VLLM_BATCH_INVARIANT
  SGLang   --mamba-ssm-dtype, --enable-deterministic-inference
`fixes(cause, framework)` -> {"fix": [...], "correction": [...], "wasted": [...], "why": str}.
"""

from __future__ import annotations

FRAMEWORKS = ("verl", "prime-rl", "nemo-rl", "slime")

# cause -> why it happens and what is wasted on it (framework-independent)
WHY = {
    "processed_logprobs": "the rollout reports logprobs after top-p/top-k, renormalised over the kept tokens, while "
    "the trainer scores the whole distribution: every ratio pi_train/pi_rollout = kept mass < 1, "
    "a bias on every token, not noise",
    "stale_weights": "the rollout policy is older than the trainer's: a real off-policy gap, which importance "
    "sampling exists to correct",
    "batch_shape": "the trainer's logprobs depend on how its micro-batch is shaped (sequences per micro-batch, "
    "padding): kernels that are not batch-invariant",
    "position_growth": "the rollout's error grows along the response: state carried from token to token (a hybrid "
    "model's recurrent SSM state) kept at lower precision or updated inexactly",
    "dtype_floor": "the rounding two honest implementations at these dtypes differ by",
    "unexplained": "mismatch no tested cause accounts for",
}

WASTED = {
    "processed_logprobs": [
        "batch-invariant kernels / deterministic inference (not numerics: the bias is by construction)",
        "token-level truncated IS (every ratio is below 1: an upper clip never fires)",
        "mamba_ssm_cache_dtype float32",
    ],
    "stale_weights": [
        "batch-invariant kernels / deterministic inference (bitwise-equal kernels cannot make two "
        "different policies agree)",
        "raw/processed logprob switches",
        "mamba_ssm_cache_dtype float32",
    ],
    "batch_shape": ["raw/processed logprob switches", "mamba_ssm_cache_dtype float32", "staleness limits"],
    "position_growth": [
        "batch-invariant trainer kernels (the error is the rollout's state path)",
        "sequence masking by logprob error (drops the long responses the error grows in: NeMo-RL "
        "#4243 masked 60-71% of eligible sequences)",
        "staleness limits",
    ],
    "dtype_floor": [
        "bitwise rollout = trainer stacks (SGLang deterministic mode at +34%, vLLM + TorchTitan "
        "bitwise at 2.4x) buy exactness this mismatch does not need; token-level IS bounds it"
    ],
    "unexplained": [],
}

_F = {
    "processed_logprobs": {
        "verl": [
            "actor_rollout_ref.rollout.top_p=1 and top_k=-1 for training rollouts (logprobs_mode "
            "processed_logprobs then only applies the temperature the actor also applies)",
            "or actor_rollout_ref.rollout.logprobs_mode=raw_logprobs with temperature 1",
        ],
        "prime-rl": [
            "keep top_p 1.0 (orchestrator sends it for training); drop top_k / min_p from "
            'sampling.extra_body, or set [inference.vllm] logprobs_mode = "raw_logprobs" at temperature 1'
        ],
        "nemo-rl": [
            "policy.generation.top_p: 1.0 and top_k: null for training, or "
            "policy.generation.vllm_cfg.logprobs_mode: raw_logprobs at temperature 1"
        ],
        "slime": [
            "--rollout-top-p 1.0 --rollout-top-k -1, or keep top-p with the rollout's top-p token ids "
            "recorded so the trainer renormalises over the same set (get_rollout_top_p_logprob_kwargs)"
        ],
        "_correction": {},
    },
    "stale_weights": {
        "verl": ["fewer steps of staleness: async_training.staleness_threshold (fully async policy)"],
        "prime-rl": ["orchestrator.max_off_policy_steps (default 8) lower"],
        "nemo-rl": ["grpo.async_grpo.max_trajectory_age_steps lower"],
        "slime": ["no --partial-rollout, or --mask-offpolicy-in-partial-rollout"],
        "_correction": {
            "verl": ["algorithm.rollout_correction.rollout_is=token (or sequence) with rollout_is_threshold"],
            "prime-rl": ["the IS ratio and trainer.loss.dppo_mask_low / dppo_mask_high already correct it"],
            "nemo-rl": [
                "loss_fn.use_importance_sampling_correction: true (required with async GRPO), "
                "truncated_importance_sampling_type: tis and truncated_importance_sampling_ratio"
            ],
            "slime": ["--use-tis --tis-clip 2.0 (--tis-clip-low), or --custom-tis-function-path for MIS"],
        },
    },
    "batch_shape": {
        "verl": [
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu equal to "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (verl #6280), the same use_dynamic_bsz in "
            "both passes, or batch-invariant trainer kernels"
        ],
        "prime-rl": [
            "a fixed packing (trainer seq_len) for the log-prob and training passes, or batch-invariant trainer kernels"
        ],
        "nemo-rl": [
            "policy.logprob_batch_size equal to policy.train_micro_batch_size (its default), the same "
            "dynamic_batching / sequence_packing settings in both passes"
        ],
        "slime": [
            "the same micro-batch schedule for log-prob and training passes (slime's default: do not "
            "raise a log-prob-only token budget)"
        ],
        "_correction": {},
    },
    "position_growth": {
        "verl": ["actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_ssm_cache_dtype=float32 (vLLM's knob)"],
        "prime-rl": ['[inference.vllm] mamba_ssm_cache_dtype = "float32"'],
        "nemo-rl": ["policy.generation.vllm_kwargs.mamba_ssm_cache_dtype: float32 (the Nemotron recipes set it)"],
        "slime": ["--sglang-mamba-ssm-dtype float32"],
        "_correction": {},
    },
    "dtype_floor": {
        "verl": ["nothing to fix"],
        "prime-rl": ["nothing to fix"],
        "nemo-rl": ["nothing to fix"],
        "slime": ["nothing to fix"],
        "_correction": {
            "verl": ["algorithm.rollout_correction.rollout_is=token, rollout_is_threshold 2.0"],
            "prime-rl": ["trainer.loss.dppo_mask_low / dppo_mask_high (defaults 0.2)"],
            "nemo-rl": ["loss_fn.truncated_importance_sampling_type: tis"],
            "slime": ["--use-tis"],
        },
    },
}


def fixes(cause: str, framework: str | None) -> dict:
    """The fix for `cause` in `framework` (every framework's when it is none of them: lpf's layout)."""
    entry = _F.get(cause)
    out = {"why": WHY[cause], "wasted": WASTED.get(cause, [])}
    if entry is None:
        return {**out, "fix": [], "correction": []}
    names = [framework] if framework in FRAMEWORKS else list(FRAMEWORKS)
    fix = [f"{n}: {x}" if len(names) > 1 else x for n in names for x in entry.get(n, [])]
    corr = [f"{n}: {x}" if len(names) > 1 else x for n in names for x in entry["_correction"].get(n, [])]
    return {**out, "fix": fix, "correction": corr}
