"""Which hybrid / state-space / linear-attention architectures can be audited, asked of both sides.

Contract: `discover(engine) -> dict` with `engine`, `engine_version`, `reference` (transformers'
version) and `architectures`: one entry per architecture that either side knows as stateful, each
with `architecture`, `model_type` (transformers'), `status` and `reason`:
  audit                         both sides load it and a tiny recipe exists (`tiny.SCALE`)
  not supported                 the engine's build cannot run it (vLLM's CPU build: a Mamba1 model
                                needs the compiled selective_scan_fwd op, absent there; the built-in
                                engine: not one of its two architectures)
  engine cannot import          vLLM's registry names it but its module does not import here
  removed from the engine       vLLM's own previously-supported list names it (with the last version)
  no engine implementation      transformers has it, the engine does not
  no reference implementation   the engine has it, the installed transformers does not
  no tiny recipe                both have it, lpf has no scaled-down recipe for it yet
Nothing is skipped silently: every architecture either side lists appears with its reason.

The reference side is the installed transformers: every causal-LM model type whose own default
config carries state-space or linear-attention fields (`STATE_KEYS`, or layer types such as
linear_attention / conv / hybrid). The vLLM side is vLLM's own registry, asked in vLLM's interpreter
(`vllm_probe.py`, ~15 s): the architectures whose module declares HasInnerState / IsHybrid /
IsAttentionFree, plus every reference-side name, with the flags vLLM computes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from lpf.experiments.conformance.tiny import SCALE
from lpf.core.errors import LpfError, did_you_mean

PROBE = Path(__file__).with_name("vllm_probe.py")
STATE_KEYS = (
    "mamba_d_state",
    "ssm_state_size",
    "state_size",
    "mamba_n_heads",
    "linear_num_key_heads",
    "conv_L_cache",
    "linear_conv_kernel_dim",
    "short_conv_kernel_size",
    "mamba_expand",
    "linear_num_heads",
)
STATE_LAYERS = ("linear_attention", "conv", "mamba", "hybrid", "recurrent")
AUDIT = "audit"


def reference_architectures() -> dict[str, str]:
    """{architecture: model_type} of the installed transformers' stateful causal LMs."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from lpf.core.torch_utils import quiet_transformers

    quiet_transformers()
    out = {}
    for model_type, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            cfg = AutoConfig.for_model(model_type).to_dict()
        except Exception:  # noqa: BLE001 - a config that needs arguments to build is not one we can scale down
            continue
        layers = cfg.get("layer_types") or cfg.get("layers_block_type") or []
        if any(k in cfg for k in STATE_KEYS) or (isinstance(layers, list) and any(t in STATE_LAYERS for t in layers)):
            out[arch if isinstance(arch, str) else arch[0]] = model_type
    return out


def probe_vllm(python: Path, names: list[str], timeout_s: float = 600) -> dict:
    """vLLM's own answer (see `vllm_probe.py`), or LpfError with the tail of what it printed."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # lpf's paths must not shadow vLLM's packages
    try:
        proc = subprocess.run(
            [str(python), str(PROBE), ",".join(sorted(names))],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise LpfError(f"asking vLLM's registry took over {timeout_s:g} s") from None
    for line in proc.stdout.splitlines():
        if line.startswith("LPF-PROBE "):
            return json.loads(line[len("LPF-PROBE ") :])
    tail = " | ".join(ln.strip() for ln in (proc.stderr or proc.stdout).strip().splitlines()[-3:])
    raise LpfError(f"vLLM's registry could not be asked (exit {proc.returncode}): {tail}")


def _entry(arch: str, model_type: str | None, status: str, reason: str, **extra) -> dict:
    return {"architecture": arch, "model_type": model_type, "status": status, "reason": reason, **extra}


def classify_vllm(ref: dict[str, str], probe: dict) -> list[dict]:
    """Both sides' lists -> one entry per architecture (pure)."""
    engine = {a["architecture"]: a for a in probe.get("archs") or []}
    removed = probe.get("removed") or {}
    mamba1_ok = (probe.get("ops") or {}).get("selective_scan_fwd", True) or not probe.get("cpu_build")
    out = []
    for arch in sorted(
        set(ref)
        | {
            a
            for a, e in engine.items()
            if "error" in e or e.get("has_inner_state") or e.get("is_hybrid") or e.get("is_attention_free")
        }
    ):
        mt, e = ref.get(arch), engine.get(arch)
        flags = (
            {
                k: e.get(k)
                for k in (
                    "has_inner_state",
                    "is_hybrid",
                    "is_attention_free",
                    "supports_mamba_prefix_caching",
                    "mamba1",
                    "module",
                )
            }
            if e
            else {}
        )
        if e is None:
            why = (
                f"vLLM {probe.get('vllm_version')} no longer has it (last supported in {removed[arch]})"
                if arch in removed
                else f"vLLM {probe.get('vllm_version')} has no implementation"
            )
            out.append(
                _entry(arch, mt, "removed from the engine" if arch in removed else "no engine implementation", why)
            )
        elif "error" in e:
            out.append(_entry(arch, mt, "engine cannot import", f"importing {e['module']}: {e['error']}", **flags))
        elif mt is None:
            out.append(
                _entry(
                    arch,
                    None,
                    "no reference implementation",
                    "the installed transformers has no causal-LM class of this name",
                    **flags,
                )
            )
        elif e.get("mamba1") and not mamba1_ok:
            out.append(
                _entry(
                    arch,
                    mt,
                    "not supported",
                    "Mamba1: vLLM's CPU build has no compiled "
                    "torch.ops._C.selective_scan_fwd (the Mamba1 prefill scan in "
                    "layers/mamba/ops/mamba_ssm.py); its decode step has a CPU kernel, its prefill none",
                    **flags,
                )
            )
        elif mt not in SCALE:
            out.append(_entry(arch, mt, "no tiny recipe", f"lpf has no scaled-down recipe for {mt} yet", **flags))
        else:
            out.append(_entry(arch, mt, AUDIT, "", **flags))
    return out


def discover(engine: str) -> dict:
    import transformers

    ref = reference_architectures()
    if engine == "vllm":
        from lpf.adapters.vllm import vllm_python

        probe = probe_vllm(vllm_python(), list(ref))
        entries = classify_vllm(ref, probe)
        return {
            "engine": engine,
            "engine_version": probe.get("vllm_version"),
            "cpu_build": probe.get("cpu_build"),
            "reference": f"transformers {transformers.__version__}",
            "architectures": _paired(entries, ref, vllm_source(vllm_python()), "vLLM"),
        }
    if engine == "llamacpp":
        from lpf.adapters.llamacpp_gguf import find_tools
        from lpf.experiments.conformance.llamacpp_side import classify_llamacpp, converter_architectures

        tools = find_tools()
        version = tools.source() or str(tools.root)
        registered = converter_architectures(tools.converter_dir)
        return {
            "engine": engine,
            "engine_version": version,
            "cpu_build": True,
            "reference": f"transformers {transformers.__version__}",
            "architectures": classify_llamacpp(ref, registered, version),
        }
    if engine == "builtin":
        import lpf
        from lpf.builtin.config import SUPPORTED_ARCHITECTURES

        archs = [
            _entry(
                a,
                mt,
                AUDIT if a in SUPPORTED_ARCHITECTURES else "not supported",
                ""
                if a in SUPPORTED_ARCHITECTURES
                else "the built-in engine runs GraniteMoeHybrid, Jamba, Qwen3.5 and Kimi Linear (KDA layers) only",
            )
            for a, mt in sorted(ref.items())
        ]
        for a in archs:
            if a["status"] == AUDIT and a["model_type"] not in SCALE:
                a.update(status="no tiny recipe", reason=f"lpf has no scaled-down recipe for {a['model_type']} yet")
        return {
            "engine": engine,
            "engine_version": lpf.__version__,
            "reference": f"transformers {transformers.__version__}",
            "architectures": archs,
        }
    raise LpfError(f"lpf conformance audits the vllm, llamacpp or builtin engine, not {engine!r}")


def vllm_source(python: Path) -> Path | None:
    """vLLM's installed package directory in the venv of its interpreter (read as text for family pairing;
    the interpreter itself is a link out of the venv, so its path is not resolved)."""
    found = sorted(Path(python).absolute().parent.parent.glob("lib/python3*/site-packages/vllm"))
    return found[0] if found else None


def _paired(entries: list[dict], ref: dict[str, str], source: Path | None, engine_name: str) -> list[dict]:
    """`families.fold` over the entries, with the pairs the engine's own source states (`families`)."""
    from lpf.experiments.conformance.families import fold, pairing_evidence

    if source is None:
        return entries
    engine_only = [e["architecture"] for e in entries if e["status"] == "no reference implementation"]
    ref_only = {
        e["architecture"]: ref[e["architecture"]]
        for e in entries
        if e["status"] == "no engine implementation" and e["architecture"] in ref
    }
    return fold(entries, pairing_evidence(source, engine_only, ref_only), engine_name)


def select(architectures: list[dict], wanted: list[str]) -> list[dict]:
    """The entries named by `wanted` (architecture or model type, any case; empty: all), in order."""
    if not wanted:
        return architectures
    keys = {}
    for a in architectures:
        for k in (a["architecture"], a["architecture"].removesuffix("ForCausalLM"), a["model_type"]):
            if k:
                keys[k.lower()] = a
    out = []
    for w in wanted:
        a = keys.get(w.strip().lower())
        if a is None:
            raise LpfError(
                f"unknown architecture {w!r}{did_you_mean(w.strip().lower(), keys)}; known: "
                f"{', '.join(sorted(x['architecture'].removesuffix('ForCausalLM') for x in architectures))}"
            )
        if a not in out:
            out.append(a)
    return out
