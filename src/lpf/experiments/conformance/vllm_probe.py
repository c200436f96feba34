"""Asks vLLM's own model registry which architectures keep inner state (run with vLLM's interpreter).

Usage: PYTHON vllm_probe.py [ARCH,ARCH,...]. Needs only vLLM and the standard library; never imported by lpf. Prints
one line `LPF-PROBE {json}` on stdout: `vllm_version`, `cpu_build`, `archs` (every text-generation
architecture whose module declares HasInnerState / IsHybrid / IsAttentionFree, and every one named
on the command line (the reference's stateful architectures, whose module may re-export), with the registry's
flags as vLLM computes them, whether its layers use the Mamba1 mixer, or the import error),
`removed` (vLLM's own previously-supported list: architecture -> last version) and `ops` (whether
the compiled kernels that Mamba1's prefill scan needs exist in this build).
"""

import importlib
import importlib.util
import json
import os
import sys

# This file sits inside lpf's package: its directory must not shadow anything vLLM imports.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

MARKERS = ("HasInnerState", "IsHybrid", "IsAttentionFree")


def main() -> int:
    import torch
    import vllm
    from vllm.model_executor.models import interfaces as iface
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform

    asked = set(sys.argv[1].split(",")) if len(sys.argv) > 1 and sys.argv[1] else set()
    archs = []
    for name, (mod, cls_name) in sorted(registry._TEXT_GENERATION_MODELS.items()):
        module = mod if "." in mod else f"vllm.model_executor.models.{mod}"
        try:
            spec = importlib.util.find_spec(module)
            source = open(spec.origin).read() if spec and spec.origin else ""
        except (ImportError, ValueError, OSError):
            source = ""
        if name not in asked and not any(m in source for m in MARKERS):
            continue
        entry = {
            "architecture": name,
            "module": module,
            "class": cls_name,
            "mamba1": "layers.mamba.mamba_mixer import" in source,
        }
        try:
            cls = getattr(importlib.import_module(module), cls_name)
            entry.update(
                has_inner_state=bool(iface.has_inner_state(cls)),
                is_hybrid=bool(iface.is_hybrid(cls)),
                is_attention_free=bool(iface.is_attention_free(cls)),
                supports_mamba_prefix_caching=bool(iface.supports_mamba_prefix_caching(cls)),
            )
        except Exception as e:  # noqa: BLE001 - an architecture this build cannot even import: say why
            entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        archs.append(entry)
    try:
        selective_scan = hasattr(torch.ops._C, "selective_scan_fwd")
    except (AttributeError, RuntimeError):
        selective_scan = False
    doc = {
        "vllm_version": vllm.__version__,
        "cpu_build": bool(current_platform.is_cpu()),
        "archs": archs,
        "removed": dict(getattr(registry, "_PREVIOUSLY_SUPPORTED_MODELS", {})),
        "ops": {"selective_scan_fwd": selective_scan},
    }
    print("LPF-PROBE " + json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
