"""Is this vLLM one whose runner the plugin was checked against, and is every hook where it expects it?

`problem(version, lookup)` returns None when the plugin may install its hooks, else one sentence
saying why not. `lookup(module, qualname)` resolves a dotted name (default: import the module and
walk the attributes), so the check itself is a plain function of what it is shown.
"""

from __future__ import annotations

import dataclasses
import importlib

# versions whose V1 runner, Mamba metadata and batch reorder this plugin was read against
KNOWN_VLLM = ("0.32.0",)

RUNNER = "vllm.v1.worker.gpu_model_runner"
MAMBA = "vllm.v1.attention.backends.mamba_attn"
SCHED = "vllm.v1.core.sched.scheduler"
MANAGER = "vllm.v1.core.single_type_kv_cache_manager"
MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
# (module, attribute path, what it is for)
HOOKS = [
    (RUNNER, "GPUModelRunner.execute_model", "one call per engine step (dummy and capture runs bypass it)"),
    (RUNNER, "GPUModelRunner._may_reorder_batch", "the batch reorder, and the stale-state drill's"),
    (RUNNER, "GPUModelRunner._build_attention_metadata", "the per-layer metadata, Mamba's split included"),
    (
        RUNNER,
        "GPUModelRunner._update_states_after_model_execute",
        "the sampled token ids after verification: each row's accepted drafts (speculative decoding)",
    ),
    (MAMBA, "split_decodes_and_prefills", "the Mamba metadata's prefill/decode split (stale-state drill)"),
    (MAMBA, "BaseMambaAttentionMetadata", "the Mamba metadata"),
    (SCHED, "Scheduler.schedule", "one scheduler step: the prefix-cache publications travel on its output"),
    (SCHED, "Scheduler._mamba_block_aligned_split", "the align-mode chunk clip (unaligned-chunk-hashed drill)"),
    (MANAGER, "MambaManager.cache_blocks", "where vLLM publishes a Mamba state block's hash"),
    (MANAGER, "MambaManager.__init__", "the same-step hit guard (publish-before-write drill)"),
    (MAMBA_UTILS, "collect_mamba_copy_meta", "the block column an align-mode resume copies its state from"),
]
MAMBA_FIELDS = ("num_prefills", "num_decodes", "num_reqs", "state_indices_tensor_p", "state_indices_tensor_d")


def _lookup(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def problem(version: str, lookup=_lookup) -> str | None:
    base = version.split("+")[0]
    if base not in KNOWN_VLLM:
        return (
            f"vLLM {version} is not a version the plugin knows (it was checked against "
            f"{', '.join(KNOWN_VLLM)}); upgrade lpf-vllm-trace"
        )
    for module, path, what in HOOKS:
        try:
            obj = lookup(module, path)
        except (ImportError, AttributeError):
            return f"hook {module}.{path} missing ({what})"
        owner, _, name = path.rpartition(".")
        if owner and name not in vars(lookup(module, owner)):
            # inherited or moved to a subclass: patching the class named here would miss the real one
            return f"hook {module}.{path} missing (not defined on {owner} itself; {what})"
        if path == "BaseMambaAttentionMetadata":
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            lost = [f for f in MAMBA_FIELDS if f not in fields]
            if lost:
                return f"hook {module}.{path} changed: no field(s) {', '.join(lost)}"
    return None
