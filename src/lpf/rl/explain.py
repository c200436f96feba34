"""`lpf rl explain` (and the causes section of `lpf rl analyze`): a dump's mismatch split into named causes.

`run(dump, rollout_dtype=None, trainer_dtype=None) -> (responses table, steps table, block)` gathers
what the tests need that is not in the dump's arrays (the floor table row for the rollout/trainer
dtypes and the model, the model's layer types from its config.json: this module reads files), runs
the pure `lpf.rl.causes.explain`, and aggregates its per-token shares:

- responses (`rl_causes.parquet`): step, request_id (the framework's identifiers), n_tokens, mass
  (sum |d|), metric_mass (the framework's own metric, `FRAMEWORK_METRIC`), share_<cause> for every
  cause of `CAUSES` (of the response's sum |d|), dominant;
- steps (`rl_cause_steps.parquet`): step, mass, share_<cause> (of the step's sum |d|);
- block (`rl_causes.json`, and `causes` in rl_findings.json): kind "rl-causes", mass (what is split),
  framework_metric, shares and shares_metric over the dump, causes (one entry per cause: label,
  status named | negligible | not found | untested | not applicable | inside | exceeded, share, the
  test and its evidence, what is missing, the fix and the wasted corrections `lpf.rl.fixes` names),
  named, verdict (causes | unexplained | inside-floor), summary, wasted, hints, inputs, worst
  responses and steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from lpf.analysis.floors import expected_floor
from lpf.core.jsonsafe import finite
from lpf.rl import fixes
from lpf.rl.cause_inputs import inputs_of
from lpf.rl.causes import CAUSES, NAMED_MIN, explain
from lpf.rl.dump import Dump

LABEL = {
    "processed_logprobs": "processed logprobs",
    "stale_weights": "stale weights",
    "batch_shape": "batch shape",
    "position_growth": "position-dependent growth",
    "dtype_floor": "dtype floor",
    "unexplained": "unexplained",
}
UNEXPLAINED_MAX = 0.05
# framework -> (metric name as it charts it, what a token contributes to it)
FRAMEWORK_METRIC = {
    "prime-rl": ("mismatch_kl/all/mean", "k3"),
    "verl": ("rollout_corr/k3_kl", "k3"),
    "nemo-rl": ("token_mult_prob_error", "mult"),
    "slime": ("train_rollout_logprob_abs_diff", "unit"),
    "lpf": ("k3_kl", "k3"),
}
MAX_LISTED = 20


def layer_types(model_dir: str | None) -> dict | None:
    """{"mamba": n, "attention": m} from an HF config.json, None when unreadable or unknown."""
    if not model_dir:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg
    n = cfg.get("num_hidden_layers")
    if isinstance(cfg.get("layer_types"), list):
        kinds = ["mamba" if k in ("mamba", "linear_attention") else "attention" for k in cfg["layer_types"]]
    elif cfg.get("attn_layer_period") and n:  # Jamba
        kinds = [
            "attention" if i % cfg["attn_layer_period"] == cfg.get("attn_layer_offset", 0) else "mamba"
            for i in range(n)
        ]
    elif n:
        kinds = ["mamba" if cfg.get("model_type", "").startswith("mamba") else "attention"] * n
    else:
        return None
    return {"mamba": kinds.count("mamba"), "attention": kinds.count("attention")}


def _model_of(dump: Dump) -> tuple[str | None, str | None]:
    """(the model's name for the floor table, its directory) from the simulator's metadata or the reference."""
    spec = (dump.metadata.get("spec") or {}).get("model")
    ref = (dump.reference or {}).get("reference") or {}
    path = ref.get("path")
    if spec and not path:
        try:
            from lpf.core.model_specs import resolve_model

            path = str(resolve_model(spec).path)
        except Exception:  # a name that no longer resolves here: the floor row is enough
            path = None
    return spec or ref.get("spec"), path


def run(
    dump: Dump,
    rollout_dtype: str | None = None,
    trainer_dtype: str | None = None,
    seed: int = 0,
    floor_table: dict | None = None,
    detected: dict | None = None,
) -> tuple[pa.Table, pa.Table, dict]:
    """`detected`: `lpf.rl.analyze.detect`'s spikes (computed here when not given): the spike steps are
    judged on their own and never called floor."""
    if detected is None:
        from lpf.rl.analyze import detect

        detected = detect(dump)
    if floor_table is None:
        from lpf.pipeline.analyze import floor_table as shipped

        floor_table = shipped()
    dtypes = dump.metadata.get("dtypes") or {}
    rollout_dtype = rollout_dtype or dtypes.get("rollout")
    trainer_dtype = trainer_dtype or dtypes.get("trainer") or "float32"
    model, model_dir = _model_of(dump)
    # no rollout dtype recorded: never the most lenient pair silently; the dump's quiet responses say
    # what its floor is (or the verdict says it cannot judge)
    known = rollout_dtype is not None
    if dump.tok_reference is not None:
        ref_dtype = ((dump.reference or {}).get("reference") or {}).get("dtype") or "float32"
        floors = {
            "rollout": expected_floor(floor_table, rollout_dtype, ref_dtype, model) if known else None,
            "trainer": expected_floor(floor_table, trainer_dtype, ref_dtype, model),
        }
    else:
        floors = {
            "rollout and trainer": expected_floor(floor_table, rollout_dtype, trainer_dtype, model) if known else None
        }
    inp = inputs_of(dump, floors, layer_types(model_dir))
    spike_step = detected["spike"][detected["resp_code"]]
    inp.spike_resp = spike_step
    inp.quiet_resp = ~spike_step & ~detected["implicated"]
    inp.estimate_floor = not known
    ex = explain(inp, seed)
    d = inp.t - inp.r
    a = np.abs(d)
    metric_name, kind = FRAMEWORK_METRIC.get(dump.fmt, FRAMEWORK_METRIC["lpf"])
    m = _metric_mass(d, kind, inp.tok_resp, inp.resp_unit)
    n_resp = inp.steps.size
    resp_mass = np.bincount(inp.tok_resp, weights=a, minlength=n_resp)
    resp_parts = np.stack(
        [np.bincount(inp.tok_resp, weights=a * ex.shares[:, j], minlength=n_resp) for j in range(len(CAUSES))], axis=1
    )
    resp_metric = np.bincount(inp.tok_resp, weights=m, minlength=n_resp)
    steps, code = np.unique(inp.steps, return_inverse=True)
    step_mass = np.bincount(code, weights=resp_mass, minlength=steps.size)
    step_parts = np.stack(
        [np.bincount(code, weights=resp_parts[:, j], minlength=steps.size) for j in range(len(CAUSES))], axis=1
    )
    resp_share = _share(resp_parts, resp_mass)
    step_share = _share(step_parts, step_mass)
    n_tok = np.bincount(inp.tok_resp, minlength=n_resp)
    responses = pa.table(
        {
            "step": pa.array(inp.steps, pa.int64()),
            "request_id": pa.array(inp.request_ids, pa.string()),
            "n_tokens": pa.array(n_tok, pa.int64()),
            "mass": pa.array(resp_mass),
            "metric_mass": pa.array(resp_metric),
            **{f"share_{c}": pa.array(resp_share[:, j]) for j, c in enumerate(CAUSES)},
            "dominant": pa.array(_dominant(resp_share, resp_mass), pa.string()),
        }
    )
    step_table = pa.table(
        {
            "step": pa.array(steps, pa.int64()),
            "mass": pa.array(step_mass),
            **{f"share_{c}": pa.array(step_share[:, j]) for j, c in enumerate(CAUSES)},
        }
    )
    total = float(a.sum())
    shares = {c: float(x) for c, x in zip(CAUSES, _share(resp_parts.sum(0)[None], np.array([total]))[0])}
    metric_total = float(m.sum())
    metric_parts = (ex.shares * m[:, None]).sum(0)
    shares_metric = {c: float(x) for c, x in zip(CAUSES, _share(metric_parts[None], np.array([metric_total]))[0])}
    spike_steps = [int(x) for x in detected["steps"][detected["spike"]]]
    block = _block(
        dump,
        inp,
        ex,
        shares,
        shares_metric,
        total,
        metric_name,
        rollout_dtype,
        trainer_dtype,
        model,
        floors,
        responses,
        step_table,
        spike_steps,
    )
    return responses, step_table, finite(block)


def write(out: Path, responses: pa.Table, steps: pa.Table, block: dict) -> None:
    """rl_causes.parquet (per response), rl_cause_steps.parquet (per step), rl_causes.json, atomically."""
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(responses, out / "rl_causes.parquet")
    pq.write_table(steps, out / "rl_cause_steps.parquet")
    tmp = out / "rl_causes.json.tmp"
    tmp.write_text(json.dumps(block, indent=2))
    tmp.replace(out / "rl_causes.json")


STEP_NAMED = 0.25  # a cause named for the dump is named at a step where it carries this share of its mass


def _step_entries(steps: pa.Table, named: list, spike_steps: list) -> list[dict]:
    """Per step: its mass, the dominant share, the causes named there (of those named for the dump, each
    with >= STEP_NAMED of the step's mass; unexplained too where it holds that much of a spike step)."""
    share = np.stack([steps.column(f"share_{c}").to_numpy() for c in CAUSES], 1)
    mass = steps.column("mass").to_numpy()
    dom = _dominant(share, mass)
    spikes = set(spike_steps)
    out = []
    for i, s in enumerate(steps.column("step").to_pylist()):
        here = [c for j, c in enumerate(CAUSES) if c in named and share[i, j] >= STEP_NAMED]
        if int(s) in spikes and share[i, CAUSES.index("unexplained")] >= STEP_NAMED:
            here.append("unexplained")
        out.append(
            {
                "step": int(s),
                "mass": float(mass[i]),
                "dominant": dom[i],
                "spike": int(s) in spikes,
                "named": here,
                "shares": {c: float(share[i, j]) for j, c in enumerate(CAUSES) if share[i, j] >= 0.005},
            }
        )
    return out


def _metric_mass(d: np.ndarray, kind: str, tok_resp: np.ndarray, unit: np.ndarray) -> np.ndarray:
    if kind == "k3":
        return np.expm1(d) - d
    if kind == "mult":
        return np.expm1(np.abs(d))
    tok_unit = unit[tok_resp]
    return np.abs(d) / np.maximum(np.bincount(tok_unit, minlength=int(unit.max()) + 1), 1)[tok_unit]


def _share(parts: np.ndarray, mass: np.ndarray) -> np.ndarray:
    return np.divide(parts, mass[:, None], out=np.zeros_like(parts), where=mass[:, None] > 0)


def _dominant(share: np.ndarray, mass: np.ndarray) -> list:
    return [CAUSES[int(np.argmax(s))] if m > 0 else None for s, m in zip(share, mass)]


def _status(cause: str, test: dict, share: float) -> str:
    st = test.get("status", "untested")
    if cause in ("dtype_floor", "unexplained"):
        return st if cause == "dtype_floor" else ("named" if share > UNEXPLAINED_MAX else "small")
    if st == "passed":
        return "named" if share >= NAMED_MIN else "negligible"
    return {"failed": "not found"}.get(st, st)


def _block(
    dump,
    inp,
    ex,
    shares,
    shares_metric,
    total,
    metric_name,
    rollout_dtype,
    trainer_dtype,
    model,
    floors,
    responses,
    steps,
    spike_steps,
) -> dict:
    from lpf.rl.cause_sentences import evidence, hints, summary

    causes, named, wasted = [], [], []
    for c in CAUSES:
        test = dict(ex.tests.get(c) or {"status": "untested"})
        status = _status(c, test, shares[c])
        entry = {
            "cause": c,
            "label": LABEL[c],
            "status": status,
            "share": shares[c],
            "share_metric": shares_metric[c],
            "test": test,
            "evidence": evidence(c, test, shares[c], inp),
            "missing": test.get("missing"),
        }
        if c != "unexplained":
            entry["fix"] = fixes.fixes(c, dump.fmt)
        if status == "named" and c != "unexplained":
            named.append(c)
            wasted += [w for w in entry["fix"]["wasted"] if w not in wasted]
        causes.append(entry)
    verdict = "causes" if named else ("unexplained" if shares["unexplained"] > UNEXPLAINED_MAX else "inside-floor")
    floor_status = (ex.tests.get("dtype_floor") or {}).get("status")
    if not named and floor_status == "cannot judge":  # an unjudged floor contains nothing, explains nothing
        verdict = "cannot-judge"
    elif verdict == "inside-floor" and spike_steps:  # a spike that rl analyze reports is never inside the floor
        verdict = "unexplained"
    order = np.argsort(-responses.column("mass").to_numpy())[:MAX_LISTED]
    worst = [
        {k: responses.column(k)[int(i)].as_py() for k in ("step", "request_id", "mass", "dominant")}
        | {"shares": {c: responses.column(f"share_{c}")[int(i)].as_py() for c in CAUSES}}
        for i in order
    ]
    block = {
        "kind": "rl-causes",
        "source": dump.source,
        "format": dump.fmt,
        "mass": "sum of |d| over scored tokens, d = trainer - rollout logprob",
        "framework_metric": {
            "name": metric_name,
            "format": dump.fmt,
            "note": "each token's term of the metric, split in the same proportions as its |d|",
        },
        "total_mass": total,
        "n_tokens": int(inp.r.size),
        "n_responses": int(inp.steps.size),
        "shares": shares,
        "shares_metric": shares_metric,
        "causes": causes,
        "named": named,
        "verdict": verdict,
        "wasted": wasted,
        "hints": hints(inp, ex),
        "inputs": {
            "rollout_dtype": rollout_dtype,
            "trainer_dtype": trainer_dtype,
            "model": model,
            "floor_pairs": {k: (v or {}).get("pair") for k, v in floors.items()},
            "sensitivity": inp.sensitivity_source,
            "reference": bool(dump.tok_reference is not None),
            "sampling": inp.sampling,
            "stale_source": inp.stale_source,
            "lags": sorted(inp.stale_scores),
            "batch_features": sorted(inp.batch),
            "layers": inp.layers,
        },
        "model": ex.model,
        "worst_responses": worst,
        "spike_steps": spike_steps,
        "steps": _step_entries(steps, named, spike_steps)[:1000],
    }
    block["summary"] = summary(block)
    return block
