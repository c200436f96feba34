"""The calibration stage: the reference model again at the engine's dtype, the floor the engine cannot move.

`calibrate_run` writes `calibration/` parts (resumable like rescore); `calibration_for(run, reference)`
is what analyze uses: the calibration table that belongs to the run's current reference, if any.
"""

from __future__ import annotations


import pyarrow as pa

from lpf.adapters import get_engine_class
from lpf.core.errors import LpfError
from lpf.pipeline.callbacks import OnStart, Tick, no_start, no_tick
from lpf.core.model_specs import resolve_model
from lpf.run.store import RunDir


FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def engine_dtype(m: dict) -> str | None:
    """The dtype the engine computed in: its manifest options, else the float dtype its configuration records
    (what a server said of itself, e.g. `lpf serve`'s /v1/models, or the user declared), else its Options'
    default."""
    engine = m.get("engine") or {}
    opts = engine.get("options") or {}
    if opts.get("dtype"):
        return str(opts["dtype"])
    said = ((engine.get("configuration") or {}).get("dtype") or {}).get("value")
    if said in FLOAT_DTYPES:
        return str(said)
    try:
        options = get_engine_class(engine.get("name", "")).Options
    except LpfError:
        return None
    return options.default("dtype") if "dtype" in options.model_fields else None


def calibrate_run(
    run: RunDir, token_budget: int = 16384, on_start: OnStart = no_start, tick: Tick = no_tick, device: str = "cpu"
) -> dict:
    """The calibration run: teacher-force the reference model again, at the engine's dtype, over
    every request the reference scored, into `calibration/` parts (resumable like rescore). Its
    |calibration - reference| per token is what an honest implementation at that dtype deviates by:
    `analyze` takes the noise floor from it instead of from the engine's own (possibly lying)
    errors. The head stays at that dtype too (`float32_head=False`), as such an engine computes it.
    When the engine's dtype is the reference's, the calibration run would be the reference
    itself (floor 0): nothing is computed and the manifest says so. Returns manifest["calibration"]."""
    with run.writer():
        return _calibrate(run, token_budget, on_start, tick, device)


NO_CALIBRATION = (
    "--calibrate runs the reference model at the engine's dtype: it needs a transformers reference, not {spec}"
)


def _calibrate(run: RunDir, token_budget: int, on_start: OnStart, tick: Tick, device: str) -> dict:
    from lpf.pipeline.reference import Rescorer, ScoreItem

    m = run.manifest
    ref = m.get("reference")
    if not ref or not run.has("reference"):
        from lpf.pipeline.generate import all_failed

        why = all_failed(run)  # nothing was scored because the engine answered nothing: say that instead
        raise LpfError(
            f"{run.path}: {why}; nothing to calibrate"
            if why
            else f"{run.path} has no reference scores yet: rescore it before calibrating"
        )
    if ref.get("kind") in ("http", "self"):
        raise LpfError(NO_CALIBRATION.format(spec=ref.get("spec")))
    dtype = engine_dtype(m)
    if dtype not in ("float32", "float16", "bfloat16"):
        raise LpfError(
            f"cannot calibrate {run.path}: the engine's dtype is {dtype or 'not recorded'} "
            f"(a calibration run needs float32, float16 or bfloat16; set the engine's --dtype)"
        )
    prev = m.get("calibration") or {}
    if (prev.get("spec"), prev.get("dtype"), prev.get("reference_dtype")) != (ref.get("spec"), dtype, ref.get("dtype")):
        for p in run.parts("calibration"):  # made for another reference or dtype: not this run's floor
            p.unlink()
        prev = {}
    if dtype == ref.get("dtype"):
        m["calibration"] = {
            "spec": ref.get("spec"),
            "dtype": dtype,
            "reference_dtype": ref.get("dtype"),
            "same_as_reference": True,
        }
        run.save_manifest()
        return m["calibration"]
    try:
        rescorer = Rescorer(
            resolve_model(ref["spec"]),
            dtype=dtype,
            device=device,
            token_budget=token_budget,
            topk=m["sampling"].get("logprobs", 5),
            float32_head=False,
        )
    except RuntimeError as e:
        raise _cannot_run(run, ref, dtype, e) from None
    m["calibration"] = {
        **{k: v for k, v in rescorer.describe().items() if k != "tokenizer_sha256"},
        "reference_dtype": ref.get("dtype"),
        "same_as_reference": False,
    }
    run.save_manifest()
    scored = set(run.read("reference", ["request_id"]).column("request_id").to_pylist())
    done = set(run.read("calibration", ["request_id"]).column("request_id").to_pylist())
    req = run.read("requests", ["request_id", "prompt_token_ids", "output_token_ids"]).to_pylist()
    req = [r for r in req if r["request_id"] in scored]
    items = [
        ScoreItem(r["request_id"], r["prompt_token_ids"], r["output_token_ids"])
        for r in req
        if r["request_id"] not in done
    ]
    total = sum(len(r["output_token_ids"]) for r in req)
    on_start(total, total - sum(len(it.output_token_ids) for it in items))
    try:
        for table in rescorer.score(items, tick):
            run.append("calibration", table)
    except RuntimeError as e:
        raise _cannot_run(run, ref, dtype, e) from None
    return m["calibration"]


def _cannot_run(run: RunDir, ref: dict, dtype: str, e: Exception) -> LpfError:
    """A model whose HF code has no kernel for that dtype here (Jamba's Mamba scan in bf16 on CPU)."""
    what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return LpfError(
        f"the calibration run stopped: the reference {ref.get('spec')} does not run at {dtype} here "
        f"({what}); `lpf analyze {run.path}` uses the calibration parts scored so far, or the "
        f"shipped floor table when there are none"
    )


def calibration_applies(manifest: dict) -> bool:
    """Whether the manifest's calibration run was made for its current reference (model and dtype)."""
    cal, ref = manifest.get("calibration"), manifest.get("reference") or {}
    return bool(cal) and (cal.get("spec"), cal.get("reference_dtype")) == (ref.get("spec"), ref.get("dtype"))


def calibration_for(run: RunDir, reference: pa.Table) -> tuple[pa.Table | None, dict | None]:
    """(calibration table, its manifest entry) when the run has a calibration run for its current
    reference; the reference itself when the engine computed at the reference's dtype."""
    cal = run.manifest.get("calibration")
    if not calibration_applies(run.manifest):
        return None, None
    if cal.get("same_as_reference"):
        return reference, cal
    return (run.read("calibration"), cal) if run.has("calibration") else (None, None)
