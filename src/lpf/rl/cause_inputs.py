"""What the cause tests can use of a dump: `ExplainInputs`, built from a `Dump` by `inputs_of`. Pure.

Per token (flat, as the dump's `tok_*` arrays): r, t, the position, the sensitivity (the reference's
exact one when `lpf rl rescore` ran, else the bound sqrt(2) (1 - p_trainer) from the token's own
trainer probability, said which), the reference's log kept mass under the rollout's sampling
(processed logprobs; without the settings, the reference's cumulative top probabilities they are inferred
from), and per lag K the score of the generating policy K steps back, beside the
score now it is compared with (`stale_base`): the trainer's own lag columns (`trainer_logprobs_lag{K}`,
base = the trainer's logprobs) win over the reference's lagged checkpoints (base = the reference).
The reference's own logprob (with it the residual splits into its rollout and trainer sides) and a
floor-table row per side. Per response: step, request id, the batch features the dump records (`BATCH_FEATURES`, or the
framework's layout: prime-rl's samples per (rank, micro_step), slime's micro-batch from its
dp_shards) and the policy version when the dump says it; which responses are in spike steps and which are
quiet (`lpf.rl.analyze.detect`, set by the caller), and whether the floor is to be estimated from the quiet
ones (no dtype recorded). `missing` says, per input, why it is absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from lpf.rl.dump import Dump

BATCH_FEATURES = ("micro_batch_size", "micro_batch_tokens", "micro_batch_padding")


@dataclass
class ExplainInputs:
    fmt: str
    steps: np.ndarray  # per response
    request_ids: list
    tok_resp: np.ndarray
    tok_pos: np.ndarray
    r: np.ndarray
    t: np.ndarray
    resp_unit: np.ndarray  # slime's averaging units
    sensitivity: np.ndarray
    sensitivity_source: str
    log_kept: np.ndarray | None = None
    log_kept_lag: dict = field(default_factory=dict)
    stale_scores: dict = field(default_factory=dict)  # lag -> per-token score of the generating policy
    stale_base: np.ndarray | None = None
    stale_source: str | None = None
    batch: dict = field(default_factory=dict)  # feature -> per-response values
    policy_version: np.ndarray | None = None
    reference: np.ndarray | None = None  # the reference's logprob per token (lpf rl rescore)
    floors: dict = field(default_factory=dict)  # side -> floor-table row (rollout, trainer, or both)
    layers: dict | None = None  # {"mamba": n, "attention": m} when the model's config says
    sampling: dict | None = None
    missing: dict = field(default_factory=dict)
    top_cum: np.ndarray | None = None  # [tokens, N] the reference's cumulative top probabilities (nucleus.py)
    kept_grid: tuple | None = None  # (top-p values, [tokens, len] log kept mass at each) (nucleus.py)
    spike_resp: np.ndarray | None = None  # per response: its step spikes (`lpf.rl.analyze.detect`)
    quiet_resp: np.ndarray | None = None  # per response: neither in a spike step nor implicated
    estimate_floor: bool = False  # no dtype recorded: the floor comes from the quiet responses, or cannot be judged


def inputs_of(dump: Dump, floors: dict | None = None, layers: dict | None = None) -> ExplainInputs:
    resp = dump.responses
    missing = {}
    if dump.tok_sensitivity is not None:
        sens, source = dump.tok_sensitivity, "reference"
    else:
        sens, source = np.sqrt(2.0) * -np.expm1(np.minimum(dump.tok_trainer, 0.0)), "trainer"
    sampling = (dump.reference or {}).get("sampling")
    if dump.tok_reference is None:
        missing["processed_logprobs"] = (
            "needs the reference's kept mass under the rollout's top-p/top-k: "
            "lpf rl rescore DUMP --reference MODEL --top-p P --top-k K"
        )
    elif dump.tok_log_kept is None and dump.tok_top_cum is None:
        missing["processed_logprobs"] = (
            "reference.parquet has no kept mass: the rollout's sampling settings were "
            "not given and it predates the stored top probabilities (rerun lpf rl rescore, or give --top-p P --top-k K)"
        )
    inp = ExplainInputs(
        fmt=dump.fmt,
        steps=resp.column("step").to_numpy(),
        request_ids=resp.column("request_id").to_pylist(),
        tok_resp=dump.tok_resp,
        tok_pos=dump.tok_pos,
        r=dump.tok_rollout,
        t=dump.tok_trainer,
        resp_unit=dump.resp_group,
        sensitivity=sens,
        sensitivity_source=source,
        log_kept=dump.tok_log_kept,
        log_kept_lag=dict(dump.tok_log_kept_lag),
        reference=dump.tok_reference,
        floors=floors or {},
        layers=layers,
        sampling=sampling,
        missing=missing,
        top_cum=dump.tok_top_cum if dump.tok_log_kept is None else None,
        kept_grid=dump.tok_kept_grid,
    )
    if dump.tok_trainer_lag:
        inp.stale_scores, inp.stale_base, inp.stale_source = dict(dump.tok_trainer_lag), dump.tok_trainer, "trainer"
    elif dump.tok_reference_lag and dump.tok_reference is not None:
        inp.stale_scores, inp.stale_base, inp.stale_source = (
            dict(dump.tok_reference_lag),
            dump.tok_reference,
            "reference",
        )
    else:
        missing["stale_weights"] = (
            "needs the generating policy's scores of the same tokens: trainer_logprobs_lag1 in "
            "the dump, or lpf rl rescore --reference 'CKPT/step_{step}' --lags 0,1"
        )
    inp.batch = batch_features(dump)
    if not inp.batch:
        missing["batch_shape"] = _NO_BATCH.get(
            dump.fmt,
            "the dump does not say the trainer's micro-batches (micro_batch_size / micro_batch_tokens per response)",
        )
    if "policy_version" in resp.column_names:
        pv = resp.column("policy_version")
        if pv.null_count < len(pv):
            inp.policy_version = np.asarray(pv.to_numpy(zero_copy_only=False), dtype=np.float64)
    return inp


_NO_BATCH = {
    "nemo-rl": "NeMo-RL's train_data_step{N}.jsonl does not record the log-prob micro-batches "
    "(policy.logprob_batch_size, dynamic batching, sequence packing)",
    "verl": "verl's rollout_data_dir dump does not record the log-prob micro-batches (add "
    "micro_batch_size per sample to the dumped fields)",
}


def _numeric(resp: pa.Table, name: str) -> np.ndarray | None:
    if name not in resp.column_names:
        return None
    col = resp.column(name)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)) or col.null_count == len(col):
        return None
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)


def batch_features(dump: Dump) -> dict[str, np.ndarray]:
    """Per-response batch-shape features that vary in this dump."""
    resp = dump.responses
    out = {}
    for name in BATCH_FEATURES:
        x = _numeric(resp, name)
        if x is not None:
            out[name] = x
    if not out and {"micro_step", "rank"} <= set(resp.column_names):  # prime-rl: samples packed per micro step
        keys = list(
            zip(resp.column("step").to_pylist(), resp.column("rank").to_pylist(), resp.column("micro_step").to_pylist())
        )
        counts: dict = {}
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
        out["micro_batch_size"] = np.array([counts[k] for k in keys], dtype=np.float64)
        if "micro_sequence_idx" in resp.column_names:
            out["micro_sequence_idx"] = np.asarray(
                resp.column("micro_sequence_idx").to_numpy(zero_copy_only=False), dtype=np.float64
            )
    return {k: v for k, v in out.items() if np.isfinite(v).all() and np.unique(v).size >= 2}
