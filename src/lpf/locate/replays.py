"""The engine side of `lpf locate`: one request replayed op by op through the engine that served it.

Contract: each function takes (run, target, upto) (`target`: `locate.target.choose_target`'s dict; `upto`:
the last row replayed) and returns an `EngineSide` (`builtin_replay`). An engine adapter names its function
in its `locate_replay` capability ("lpf.locate.replays:NAME"); an engine without one is not locatable.
  builtin  the built-in engine with the run's own schedule (`builtin_replay`)
  vllm     vLLM offline through lpf-vllm-trace on the run's workload (`vllm_replay`)
  hf       transformers' decode path alone (generate's left-padded batch is not replayed)
"""

from __future__ import annotations


def builtin(run, target: dict, upto: int):
    from lpf.locate.builtin_replay import replay

    return replay(run, target["request_id"], upto)


def vllm(run, target: dict, upto: int):
    from lpf.locate.vllm_replay import replay

    return replay(run, target["request_id"], upto)


def hf(run, target: dict, upto: int):
    from lpf.core.model_specs import resolve_model
    from lpf.locate.builtin_replay import EngineSide
    from lpf.locate.hf_capture import HFCapture
    from lpf.locate.reference_side import _load

    dtype = (run.manifest["engine"].get("options") or {}).get("dtype", "float32")
    model = _load(resolve_model(run.manifest["model"]["spec"]).path, dtype)
    cap = HFCapture(model, "engine", dtype)
    acts = cap.decode_path(target["ids"][: upto + 1], target["prompt_len"])
    return EngineSide(
        acts,
        description={
            "engine": "hf",
            "schedule": "its decode path alone (generate's left-padded batch is not replayed)",
        },
    )
